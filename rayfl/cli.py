"""`rayfl run | validate | ls | ls-runs | compare | tune | report`.

Every error a user can cause ends in one line on stderr and exit code 2, never a traceback.
"""

from __future__ import annotations

import argparse
import errno
import logging
import os
import shlex
import signal
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NoReturn

from rayfl.config import build_config, load_config
from rayfl.errors import UserError
from rayfl.launch import default_run_dir, simulate
from rayfl.schema import RunConfig
from rayfl.tracking.provenance import COMMAND_ENV

log = logging.getLogger("rayfl")


def format_table(rows: Sequence[tuple[str, str]], title: str = "") -> str:
    width = max(len(k) for k, _ in rows)
    lines = [title] if title else []
    lines += [f"  {k.ljust(width)}  {v}" for k, v in rows]
    return "\n".join(lines)


def final_table(result: Any, wall_s: float) -> str:
    cfg: RunConfig = result.config
    final = result.final
    rows: list[tuple[str, str]] = accuracy_rows(final, cfg.eval.targets)
    if "baseline/local_acc" in final:
        rows.append(("local-only acc, same partition", f"{final['baseline/local_acc']:.4f}"))
        rows.append(("gain over local (points)", f"{final['baseline/gain_points']:+.2f}"))
    if "baseline/control_acc" in final:
        rows.append(("no-federation control acc", f"{final['baseline/control_acc']:.4f}"))
        gain = final["baseline/federated_gain_points"]
        rows.append(("federated gain over control (points)", f"{gain:+.2f}"))
    for key in (
        "proxy/acc",
        "global/acc",
        "pfedes/kl_local_proxy",
        "fedfd/distill_loss",
        "privacy/epsilon",
    ):
        if key in final:
            chance = final.get("proxy/chance") if key == "proxy/acc" else None
            note = "" if chance is None else f"  (chance {chance:.4f})"
            rows.append((key, f"{final[key]:.4f}{note}"))
    rounds = max(1, len(result.history))
    rows.append(
        (
            "comm MB up / down per round",
            f"{final.get('comm/bytes_up_total', 0) / rounds / 1e6:.3f} / "
            f"{final.get('comm/bytes_down_total', 0) / rounds / 1e6:.3f}",
        )
    )
    rows.append(
        (
            "comm MB up / down total",
            f"{final.get('comm/bytes_up_total', 0) / 1e6:.2f} / "
            f"{final.get('comm/bytes_down_total', 0) / 1e6:.2f}",
        )
    )
    rows.append(("rounds", f"{len(result.history)}"))
    rejected, replies = rejected_replies(result.history)
    rows.append(("server/rejected", f"{rejected:g} of {replies:g} replies"))
    mean_round = sum(r["time/round_s"] for r in result.history) / rounds
    rows.append(("seconds per round (mean)", f"{mean_round:.2f}"))
    rows.append(("wall time s", f"{wall_s:.1f}"))
    title = (
        f"{cfg.name}: {cfg.algorithm.name} on {cfg.data.dataset}, {cfg.data.num_clients} clients, "
        f"seed {cfg.seed}, status {result.status}"
    )
    from rayfl.engine.callbacks import proxy_health

    warning = proxy_health(cfg, result.history)
    return format_table(rows, title) + (f"\n  {warning}" if warning else "")


def accuracy_rows(final: dict[str, float], targets: Sequence[float]) -> list[tuple[str, str]]:
    """The final table's accuracy lines: the last round's personalized accuracy with the 95%
    confidence interval of the client mean, its other statistics and losses, per architecture;
    the test accuracy at the round chosen on validation (never a round chosen on test data);
    the rounds, bytes and seconds to each `eval.targets` accuracy, or "not reached"."""
    from rayfl.engine.metrics import AT_BEST_VAL, target_key

    def num(key: str, prefix: str = "") -> str:
        value = final.get(prefix + key)
        return "-" if value is None else f"{value:.4f}"

    rows = [("last round: personal/acc", num("personal/acc"))]
    if "personal/acc_ci95" in final:
        rows.append(
            ("  client mean ± 95% CI", f"{num('personal/acc_mean')} ± {num('personal/acc_ci95')}")
        )
    for key in ("personal/acc_std", "personal/acc_worst10", "personal/loss"):
        if key in final:
            rows.append((f"  {key}", num(key)))
    for key in ("personal/val_acc", "personal/val_loss"):
        if key in final:
            rows.append((f"  {key} (validation)", num(key)))
    for key in sorted(k for k in final if k.startswith("personal/acc/arch=")):
        rows.append((f"  {key}", num(key)))
    if AT_BEST_VAL + "round" in final:
        chosen = int(final[AT_BEST_VAL + "round"])
        label = f"at best validation round ({chosen}): personal/acc"
        ci = final.get(AT_BEST_VAL + "personal/acc_ci95")
        mean = f"  (client mean {num('personal/acc_mean', AT_BEST_VAL)} ± {ci:.4f})" if ci else ""
        rows.append((label, num("personal/acc", AT_BEST_VAL) + mean))
    for t in targets:
        rounds = final.get(target_key("rounds", t))
        reached = (
            "not reached"
            if rounds is None
            else f"round {rounds:g}, {final[target_key('bytes', t)] / 1e6:.2f} MB, "
            f"{final[target_key('seconds', t)]:.1f} s"
        )
        rows.append((f"to personal/acc {t:g}", reached))
    return rows


def rejected_replies(history: Sequence[dict[str, float]]) -> tuple[float, float]:
    """Replies the server rejected (non-finite or empty) and replies received, over the run."""
    rejected = sum(r.get("server/rejected", 0.0) for r in history)
    replies = sum(r.get("clients", 0.0) for r in history)
    return rejected, replies


# ------------------------------------------------------------------------------------ commands


class Interrupted(KeyboardInterrupt):
    """Ctrl-C (or SIGTERM) with the command line that resumes what was interrupted."""

    def __init__(self, resume_hint: str) -> None:
        super().__init__(resume_hint)
        self.resume_hint = resume_hint


def cmd_run(args: argparse.Namespace) -> int:
    if args.resume:
        from rayfl.engine.rundir import resume_config

        run_dir = Path(args.resume)
        if not run_dir.is_dir():
            raise UserError(
                f"--resume {run_dir}: not a directory; pass a run directory written by rayfl run"
            )
        # `rayfl run --resume DIR engine.rounds=8`: argparse puts the first override in `config`
        overrides = [args.config, *args.overrides] if args.config else list(args.overrides)
        if any("=" not in o for o in overrides):
            raise UserError(
                "--resume takes the run directory's own config.yaml; pass only key=value overrides"
            )
        # an untrusted directory: checked in full before Ray starts
        cfg = resume_config(run_dir, overrides)
    else:
        if not args.config:
            raise UserError("rayfl run needs a config file (e.g. experiments/pfedes_fmnist.yaml)")
        path, overrides = Path(args.config), list(args.overrides)
        refuse_other_kinds(path)
        cfg = load_config(path, overrides)
        run_dir = Path(args.out) if args.out else default_run_dir(cfg)
    start = time.perf_counter()
    try:
        result = simulate(
            cfg,
            run_dir,
            progress=not args.no_progress,
            resume=bool(args.resume),
            existing="archive" if args.force else "refuse",
        )
    except KeyboardInterrupt:
        raise Interrupted(
            f"the run directory keeps its last checkpoint; resume with: "
            f"{shlex.join(['rayfl', 'run', '--resume', str(run_dir)])}"
        ) from None
    except OSError as exc:
        if exc.errno not in ENVIRONMENT:
            raise
        raise UserError(
            f"{environment_error(exc)} (the run directory keeps its last checkpoint); once "
            f"fixed, resume with: {shlex.join(['rayfl', 'run', '--resume', str(run_dir)])}"
        ) from None
    print(final_table(result, time.perf_counter() - start))
    print(f"run directory: {run_dir}")
    rejected, replies = rejected_replies(result.history)
    if replies and rejected > replies / 2:
        print(
            f"rayfl: warning: the server rejected {rejected:g} of {replies:g} replies (non-finite "
            "or empty); the results rest on few clients: lower train.lr or set train.grad_clip",
            file=sys.stderr,
        )
    return 0


def cmd_ls_runs(args: argparse.Namespace) -> int:
    import contextlib

    from rayfl.engine.rundir import list_runs
    from rayfl.gate import untrusted

    with untrusted() if args.untrusted else contextlib.nullcontext():
        runs = list_runs(Path(args.dir))
    if not runs:
        print(f"no run directories in {args.dir}")
        return 0
    width = max(len(str(r.path)) for r in runs)
    print(f"{'run directory'.ljust(width)}  {'status':8s}  rounds  personal/acc")
    for r in runs:
        metric = "-" if r.metric is None else f"{r.metric:.4f}"
        status = r.status if r.owner is None else f"{r.status} (pid {r.owner})"
        print(f"{str(r.path).ljust(width)}  {status:8s}  {r.rounds:6d}  {metric}")
    return 0


# the file kinds that are not one run, by their top-level key: (what it is, the command to use)
OTHER_KINDS = {
    "suite": ("a comparison suite (algorithms x seeds)", "rayfl compare"),
    "sweep": ("a hyperparameter sweep", "rayfl tune"),
    "bench": ("a benchmark", "python3 experiments/benchmarks/bench.py"),
}


def refuse_other_kinds(path: Path) -> None:
    """`rayfl run` on a suite, sweep or benchmark file: one line naming the command to use."""
    from rayfl.clusterconfig import is_cluster_file
    from rayfl.config import read_yaml

    raw = read_yaml(path)
    for key, (what, command) in OTHER_KINDS.items():
        if key in raw:
            raise UserError(f"{path} is {what}, not one run; run it with: {command} {path}")
    if is_cluster_file(raw):
        raise UserError(
            f"{path} is a Ray cluster launcher file, not a run; start the cluster with "
            f"ray up {path}, then run experiments with engine.address=auto"
        )


def split_overrides(args: Sequence[str]) -> tuple[list[str], list[str]]:
    """Positional arguments -> (files, key=value overrides): an argument with `=` that is not an
    existing file is an override."""
    files = [a for a in args if "=" not in a or Path(a).exists()]
    return files, [a for a in args if a not in files]


def cmd_validate(args: argparse.Namespace) -> int:
    files, positional = split_overrides(args.configs)
    if not files:
        raise UserError(
            "rayfl validate needs at least one file (e.g. experiments/pfedes_fmnist.yaml)"
        )
    overrides = [*positional, *args.overrides]
    cluster = load_cluster(args.cluster) if args.cluster else None
    for path in files:
        notes: list[str] = []
        describe = validate_file(path, overrides, cluster=cluster, notes=notes)
        fits = f"; fits {args.cluster} at its maximum size" if cluster else ""
        print(f"{path}: ok ({describe}{fits})")
        for note in notes:
            print(f"{path}: warning: {note}")
    return 0


def load_cluster(path: str | Path) -> Any:
    """The `rayfl.clusterconfig.ClusterSize` of the cluster launcher file `--cluster` names."""
    from rayfl.clusterconfig import cluster_size, validate_cluster_config

    return cluster_size(validate_cluster_config(path), path)


def validate_file(
    path: str | Path,
    overrides: Sequence[str] = (),
    cluster: Any = None,
    notes: list[str] | None = None,
) -> str:
    """Validate a run, suite, sweep, benchmark or Ray cluster launcher file; return a one-line
    description.

    Every check that needs no Ray is made, so that `rayfl run` does not stop on one after
    starting Ray: with `cluster` (a `rayfl.clusterconfig.ClusterSize`, `--cluster FILE`) the
    runs' workers and server must fit that cluster at its maximum size; without it, a local
    run (no `engine.address`) that this machine cannot place (a GPU asked of a machine without
    one) adds a warning to `notes`.

    Raises:
        UserError: a problem in the file, or runs that can never be placed (one line).
    """
    from rayfl.config import read_yaml

    raw = read_yaml(path)
    from rayfl.clusterconfig import describe_cluster, is_cluster_file, validate_cluster_config

    if is_cluster_file(raw):
        return describe_cluster(validate_cluster_config(path))
    configs: list[Any]
    if "suite" in raw:
        from rayfl.compare import load_suite

        suite = load_suite(path, overrides)
        configs, describe = [r.config for r in suite.runs], f"suite of {len(suite.runs)} runs"
    elif "sweep" in raw:
        from rayfl.tune import load_sweep

        sweep = load_sweep(path, overrides)
        configs, describe = [sweep.config], f"sweep over {', '.join(sweep.space)}"
    else:
        # a benchmark's base is one run (its variants: experiments/benchmarks/bench.py)
        bench = raw.pop("bench", None) is not None
        cfg = build_config(raw, overrides)
        from rayfl.checks import check_family

        archs = check_family(cfg)
        configs = [cfg]
        describe = (
            f"{'benchmark: ' if bench else ''}{cfg.algorithm.name} on {cfg.data.dataset}, "
            f"{cfg.data.num_clients} clients, {len(set(archs))} architectures"
        )
    check_placement(configs, cluster, notes)
    for cfg in configs:  # valid settings an algorithm knows to be pointless (`Params.notes`)
        for note in getattr(cfg.algorithm.params, "notes", list)():
            if notes is not None and note not in notes:
                notes.append(note)
    return describe


def check_placement(configs: Sequence[Any], cluster: Any, notes: list[str] | None) -> None:
    """The resource checks of `validate_file` over each distinct engine section of `configs`."""
    from rayfl.resources import check_cluster, local_note

    seen: list[Any] = []
    for cfg in configs:
        if cfg.engine in seen:
            continue
        seen.append(cfg.engine)
        if cluster is not None:
            check_cluster(cfg.engine, cluster)
        elif notes is not None and (note := local_note(cfg.engine)) and note not in notes:
            notes.append(note)


def cmd_ls(args: argparse.Namespace) -> int:
    from rayfl.algorithms import ALGORITHMS
    from rayfl.data import DATASETS, PARTITIONERS
    from rayfl.models import FAMILIES, MODELS

    if args.name == "partitioners":
        print(_partitioners_text())
        return 0
    if args.name is not None:
        from rayfl.describe import describe

        print(describe(args.name))
        return 0

    print("algorithms:")
    for name, algo in ALGORITHMS.items():
        print(f"  {name:12s} {algo.summary}")
    print("models:      " + ", ".join(MODELS.names()))
    print("families:")
    for name, fam in FAMILIES.items():
        print(f"  {name:14s} {', '.join(fam.architectures)}")
    print("datasets:    " + ", ".join(DATASETS.names()))
    print("partitioners: " + ", ".join(PARTITIONERS.names()))
    print("feature shift: data.domains (`rayfl ls partitioners` lists its transformations)")
    print("`rayfl ls NAME` shows an algorithm's keys (or a section's: engine, train, data, ...)")
    return 0


def _partitioners_text() -> str:
    """`rayfl ls partitioners`: label partitioners and the feature-shift options, one line each."""
    import inspect

    from rayfl.data import PARTITIONERS, transforms

    lines = ["label partitioners (data.partition.name):"]
    for name, fn in PARTITIONERS.items():
        lines.append(f"  {name:14s} {(inspect.getdoc(fn) or '').splitlines()[0]}")
    lines += [
        "feature shift (data.domains; composes with any label partitioner):",
        "  noise: X           NIID-Bench feature skew: client i gets Gaussian noise, std X*i/N",
        "  held_out: RECIPE   that domain's clients are only evaluated (domain generalization)",
        "  clients_per_domain, proportions: how many clients each domain gets (default: equal)",
        "domains (data.domains.transforms: one domain per recipe; `folder` datasets bring theirs):",
        *transforms.describe(),
    ]
    return "\n".join(lines)


def cmd_compare(args: argparse.Namespace) -> int:
    from rayfl.compare import SuiteInterrupted, run_suite

    try:
        table = run_suite(
            args.suite, args.overrides, out=args.out, keep_checkpoints=args.keep_checkpoints
        )
    except SuiteInterrupted as exc:
        again = ["rayfl", "compare", args.suite, *args.overrides, "--out", str(exc.out_dir)]
        if args.keep_checkpoints:
            again.append("--keep-checkpoints")
        raise Interrupted(
            f"finished runs and checkpoints are kept in {exc.out_dir}; resume with: "
            f"{shlex.join(again)}"
        ) from None
    print(table)
    return 0


def cmd_report(args: argparse.Namespace) -> int:
    from rayfl.report import write_report

    print(f"report: {write_report(args.dir, args.out, untrusted=args.untrusted)}")
    return 0


def cmd_tune(args: argparse.Namespace) -> int:
    from rayfl.tune import run_sweep

    print(run_sweep(args.sweep, args.overrides, out=args.out))
    return 0


EXAMPLES = {
    "run": """examples:
  rayfl run experiments/pfedes_fmnist.yaml
  rayfl run experiments/pfedes_fmnist.yaml seed=1 engine.rounds=5 algorithm.alpha=0.3 --out runs/x
  rayfl run experiments/pfedes_fmnist.yaml algorithm.name=local eval.local_baseline=false
  rayfl run --resume runs/x
  rayfl run docs/examples/moon_digits.yaml algorithm.mu=5.0 --plugin docs/examples/my_algorithm.py""",
    "validate": """examples:
  rayfl validate experiments/pfedes_fmnist.yaml
  rayfl validate experiments/pfedes_fmnist.yaml engine.rounds=5 algorithm.beta=0
  rayfl validate experiments/suites/*.yaml experiments/sweeps/*.yaml
  rayfl validate experiments/paper/pfedes_cifar10.yaml --cluster cluster.yaml""",
    "ls-runs": """examples:
  rayfl ls-runs                    # every run directory under runs/
  rayfl ls-runs /data/sweeps/x     # another folder; a killed run still marked RUNNING becomes KILLED
""",
    "ls": """examples:
  rayfl ls            # algorithms, models, families, datasets, partitioners
  rayfl ls pfedes     # pFedES's keys with defaults and one line of help each
  rayfl ls engine     # a config section's keys""",
    "compare": """examples:
  rayfl compare experiments/suites/pfedes_paper_fmnist.yaml --out runs/suite
  rayfl compare experiments/suites/pfedes_paper_fmnist.yaml engine.rounds=2 --out runs/suite
  rayfl compare experiments/suites/pfedes_paper_fmnist.yaml --out runs/suite   # again: resumes
  rayfl compare experiments/suites/pfedes_paper_fmnist.yaml parallel=2 --out runs/suite""",
    "tune": """examples:
  rayfl tune experiments/sweeps/pfedes_T_alpha.yaml --out runs/sweep
  rayfl tune experiments/sweeps/pfedes_T_alpha.yaml engine.rounds=2""",
    "report": """examples:
  rayfl report runs/x                 # one run directory -> runs/x/report.html
  rayfl report runs/suite --out suite.html""",
}

OVERRIDES_HELP = "dotted key=value overrides parsed as YAML, e.g. engine.rounds=5"


def _plugin_option(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--plugin",
        action="append",
        default=[],
        metavar="FILE_OR_MODULE",
        help="a .py file or module that registers algorithms, models or datasets (repeatable; "
        "see docs/your_algorithm.md)",
    )


class UsageError(UserError):
    """A command line argparse cannot parse (an unknown option, a missing argument)."""


class Parser(argparse.ArgumentParser):
    """argparse that raises `UsageError` (one line, exit 2 in `main`) instead of printing the
    usage block and exiting."""

    def error(self, message: str) -> NoReturn:
        raise UsageError(f"{self.prog}: {message}; see {self.prog} --help")


def parse(argv: Sequence[str]) -> argparse.Namespace:
    """The command line -> its arguments, with options and positional arguments in any order:
    `rayfl run CONFIG --out DIR engine.rounds=2` as `rayfl run CONFIG engine.rounds=2 --out DIR`.

    argparse fills a command's positional lists from the first run of positional arguments only;
    those after an option come back unrecognized and are appended here, in their order, to the
    command's list (`overrides`, or `validate`'s files and overrides).

    Raises:
        UsageError: an unknown option, a missing argument, or extra arguments to a command that
            takes none.
    """
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    target = "configs" if args.command == "validate" else "overrides"
    unknown = [a for a in extra if a.startswith("-") or not hasattr(args, target)]
    if unknown:
        raise UsageError(
            f"rayfl {args.command}: unrecognized arguments: {' '.join(unknown)}; "
            f"see rayfl {args.command} --help"
        )
    if extra:
        vars(args)[target] = [*vars(args)[target], *extra]
    return args


def _sub(sub: Any, name: str, help: str) -> argparse.ArgumentParser:
    return sub.add_parser(
        name,
        help=help,
        description=help,
        epilog=EXAMPLES[name],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(
        prog="rayfl",
        description=__doc__,
        epilog="examples:\n"
        + "\n".join(e.splitlines()[1] for e in EXAMPLES.values())
        + "\n\n`rayfl COMMAND --help` shows each command's options and more examples.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="log at INFO level")
    sub = parser.add_subparsers(dest="command", required=True)

    p = _sub(sub, "run", "run one simulation")
    p.add_argument("config", nargs="?", help="experiment YAML")
    p.add_argument("overrides", nargs="*", help=OVERRIDES_HELP)
    p.add_argument("--out", help="run directory (default runs/<name>-<algorithm>-s<seed>-<time>)")
    p.add_argument("--resume", metavar="RUN_DIR", help="continue a run from its last checkpoint")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument(
        "--force", action="store_true", help="--out holds a run: move it aside, then run"
    )
    _plugin_option(p)
    p.set_defaults(fn=cmd_run)

    p = _sub(
        sub, "validate", "check experiment, suite, sweep or Ray cluster files without running them"
    )
    p.add_argument(
        "configs", nargs="+", metavar="FILE_OR_OVERRIDE", help="files, then " + OVERRIDES_HELP
    )
    p.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        help="key=value override (same as positional)",
    )
    p.add_argument(
        "--cluster",
        metavar="CLUSTER_YAML",
        help="a Ray cluster launcher file (e.g. cluster.yaml): refuse runs whose worker or "
        "server no node type can hold, or whose engine.num_workers do not fit the cluster at "
        "its maximum size (without it: a local run this machine cannot place is a warning)",
    )
    _plugin_option(p)
    p.set_defaults(fn=cmd_validate)

    p = _sub(sub, "ls", "list algorithms, models, families, datasets, partitioners")
    p.add_argument("name", nargs="?", help="an algorithm or config section to describe")
    _plugin_option(p)
    p.set_defaults(fn=cmd_ls)

    p = _sub(
        sub, "ls-runs", "list run directories with status, rounds and metric (marks killed runs)"
    )
    p.add_argument("dir", nargs="?", default="runs", help="folder of run directories")
    p.add_argument(
        "--untrusted",
        action="store_true",
        help="read a folder your rayfl did not write (a colleague's): bounded, changes nothing",
    )
    p.set_defaults(fn=cmd_ls_runs)

    p = _sub(sub, "compare", "run a comparison suite (algorithms x seeds on one partition)")
    p.add_argument("suite")
    p.add_argument("overrides", nargs="*", help=OVERRIDES_HELP)
    p.add_argument("--out", help="output directory (the same one again resumes the suite)")
    p.add_argument(
        "--keep-checkpoints",
        action="store_true",
        help="keep each finished run's checkpoint (default: removed once the run finished)",
    )
    _plugin_option(p)
    p.set_defaults(fn=cmd_compare)

    p = _sub(sub, "tune", "a Ray Tune sweep logged to MLflow")
    p.add_argument("sweep")
    p.add_argument("overrides", nargs="*", help=OVERRIDES_HELP)
    p.add_argument("--out", help="output directory")
    _plugin_option(p)
    p.set_defaults(fn=cmd_tune)

    p = _sub(sub, "report", "one self-contained HTML page for a run, a suite or a sweep folder")
    p.add_argument(
        "dir", help="a run directory, or a folder written by rayfl compare or rayfl tune"
    )
    p.add_argument("--out", help="the HTML file (default DIR/report.html)")
    p.add_argument(
        "--untrusted",
        action="store_true",
        help="read a folder your rayfl did not write (a colleague's): bounded, changes nothing",
    )
    p.set_defaults(fn=cmd_report)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        args = parse(argv)
    except UserError as exc:
        print(f"rayfl: error: {one_line(exc)}", file=sys.stderr)
        return 2
    # MLflow's source tag; Ray workers and Tune trials inherit it
    os.environ[COMMAND_ENV] = shlex.join(["rayfl", *argv])
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING,
        format="%(levelname)s %(name)s: %(message)s",
    )
    os.environ.setdefault("RAY_DEDUP_LOGS", "1")
    previous = signal.getsignal(signal.SIGTERM)
    signal.signal(signal.SIGTERM, _terminate)
    try:
        from rayfl import plugins

        plugins.add(getattr(args, "plugin", None))
        return int(args.fn(args) or 0)
    except UserError as exc:
        print(f"rayfl: error: {one_line(exc)}", file=sys.stderr)
        return 2
    except OSError as exc:
        if exc.errno not in ENVIRONMENT:
            raise
        print(f"rayfl: error: {environment_error(exc)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as exc:
        hint = (
            exc.resume_hint if isinstance(exc, Interrupted) else "the run keeps its last checkpoint"
        )
        print(f"rayfl: interrupted; {hint}", file=sys.stderr)
        return 130
    finally:
        signal.signal(signal.SIGTERM, previous)


def entry() -> NoReturn:
    """The `rayfl` command. A reader that closes the pipe early (`rayfl ls | head`) ends it
    quietly, as a Unix filter ends: stdout goes to /dev/null so that the exit's flush is silent."""
    try:
        code = main()
        sys.stdout.flush()
    except BrokenPipeError:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        code = 1
    sys.exit(code)


def _terminate(signum: int, frame: Any) -> None:
    """SIGTERM ends a run like Ctrl-C: the checkpoint stays intact and the resume hint is printed."""
    raise KeyboardInterrupt


# what the machine refused, not what rayfl got wrong: a full disk, a quota, a read-only or
# forbidden folder
ENVIRONMENT = {errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM}


def environment_error(exc: OSError) -> str:
    """One line for an `ENVIRONMENT` error: what failed, and where."""
    where = f" writing {exc.filename}" if exc.filename else ""
    return f"{exc.strerror or exc}{where}"


def one_line(exc: BaseException) -> str:
    """The user's message of an error, also when Ray wrapped it (an error raised in an actor)."""
    cause = getattr(exc, "cause", None)
    if isinstance(cause, UserError):
        exc = cause
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


if __name__ == "__main__":
    entry()
