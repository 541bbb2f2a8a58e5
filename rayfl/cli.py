"""`rayfl run | validate | ls | ls-runs | compare | tune | report`.

Every error a user can cause ends in one line on stderr and exit code 2, never a traceback.
"""

from __future__ import annotations

import argparse
import logging
import os
import shlex
import signal
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NoReturn

from rayfl import plugins
from rayfl.clusterconfig import cluster_size, validate_cluster_config
from rayfl.config import load_config
from rayfl.errors import ENVIRONMENT, UserError, environment_error, one_line
from rayfl.launch import default_run_dir, final_table, rejected_replies, simulate
from rayfl.tracking.provenance import COMMAND_ENV
from rayfl.validate import refuse_other_kinds, split_overrides, validate_file

log = logging.getLogger("rayfl")


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
    again = shlex.join(["rayfl", "run", "--resume", str(run_dir)])
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
            f"the run directory keeps its last checkpoint; resume with: {again}"
        ) from None
    except OSError as exc:
        if exc.errno not in ENVIRONMENT:
            raise
        raise UserError(
            f"{environment_error(exc)} (the run directory keeps its last checkpoint); once "
            f"fixed, resume with: {again}"
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

    from rayfl.engine.rundir import list_runs, runs_table
    from rayfl.gate import untrusted

    with untrusted() if args.untrusted else contextlib.nullcontext():
        runs = list_runs(Path(args.dir))
    print(runs_table(runs) if runs else f"no run directories in {args.dir}")
    return 0


def cmd_validate(args: argparse.Namespace) -> int:
    files, positional = split_overrides(args.configs)
    if not files:
        raise UserError(
            "rayfl validate needs at least one file (e.g. experiments/pfedes_fmnist.yaml)"
        )
    overrides = [*positional, *args.overrides]
    cluster = None
    if args.cluster:
        cluster = cluster_size(validate_cluster_config(args.cluster), args.cluster)
    for path in files:
        notes: list[str] = []
        describe = validate_file(path, overrides, cluster=cluster, notes=notes)
        fits = f"; fits {args.cluster} at its maximum size" if cluster else ""
        print(f"{path}: ok ({describe}{fits})")
        for note in notes:
            print(f"{path}: warning: {note}")
    return 0


def cmd_ls(args: argparse.Namespace) -> int:
    from rayfl.describe import listing

    print(listing(args.name))
    return 0


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
UNTRUSTED_HELP = "read a folder your rayfl did not write (a colleague's): bounded, changes nothing"
PLUGIN_HELP = (
    "a .py file or module that registers algorithms, models or datasets (repeatable; "
    "see docs/your_algorithm.md)"
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
    argparse fills a command's positional lists from the first run of positional arguments only;
    those after an option come back unrecognized and are appended here, in their order, to the
    command's list (`overrides`, or `validate`'s files and overrides). A UsageError otherwise."""
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


def _sub(
    sub: Any, name: str, help: str, fn: Any, first: str | None = None, plugin: bool = True
) -> argparse.ArgumentParser:
    """A command's parser: its positional `first` argument, then its overrides (with `first`),
    and its `--plugin` option."""
    p = sub.add_parser(
        name,
        help=help,
        description=help,
        epilog=EXAMPLES[name],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.set_defaults(fn=fn)
    if first is not None:
        p.add_argument(first, nargs="?" if name == "run" else None, help=f"the {first} YAML")
        p.add_argument("overrides", nargs="*", help=OVERRIDES_HELP)
    if plugin:
        p.add_argument(
            "--plugin", action="append", default=[], metavar="FILE_OR_MODULE", help=PLUGIN_HELP
        )
    return p


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

    p = _sub(sub, "run", "run one simulation", cmd_run, first="config")
    p.add_argument("--out", help="run directory (default runs/<name>-<algorithm>-s<seed>-<time>)")
    p.add_argument("--resume", metavar="RUN_DIR", help="continue a run from its last checkpoint")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument(
        "--force", action="store_true", help="--out holds a run: move it aside, then run"
    )

    what = "check experiment, suite, sweep or Ray cluster files without running them"
    p = _sub(sub, "validate", what, cmd_validate)
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

    p = _sub(sub, "ls", "list algorithms, models, families, datasets, partitioners", cmd_ls)
    p.add_argument(
        "name",
        nargs="?",
        help="an algorithm, a config section, or one of datasets, models, families, algorithms, partitioners",
    )

    what = "list run directories with status, rounds and metric (marks killed runs)"
    p = _sub(sub, "ls-runs", what, cmd_ls_runs, plugin=False)
    p.add_argument("dir", nargs="?", default="runs", help="folder of run directories")
    p.add_argument("--untrusted", action="store_true", help=UNTRUSTED_HELP)

    what = "run a comparison suite (algorithms x seeds on one partition)"
    p = _sub(sub, "compare", what, cmd_compare, first="suite")
    p.add_argument("--out", help="output directory (the same one again resumes the suite)")
    p.add_argument(
        "--keep-checkpoints",
        action="store_true",
        help="keep each finished run's checkpoint (default: removed once the run finished)",
    )

    p = _sub(sub, "tune", "a Ray Tune sweep logged to MLflow", cmd_tune, first="sweep")
    p.add_argument("--out", help="output directory")

    what = "one self-contained HTML page for a run, a suite or a sweep folder"
    p = _sub(sub, "report", what, cmd_report, plugin=False)
    p.add_argument(
        "dir", help="a run directory, or a folder written by rayfl compare or rayfl tune"
    )
    p.add_argument("--out", help="the HTML file (default DIR/report.html)")
    p.add_argument("--untrusted", action="store_true", help=UNTRUSTED_HELP)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    previous = signal.getsignal(signal.SIGTERM)
    signal.signal(signal.SIGTERM, _terminate)
    try:
        args = parse(argv)
        # MLflow's source tag; Ray workers and Tune trials inherit it
        os.environ[COMMAND_ENV] = shlex.join(["rayfl", *argv])
        logging.basicConfig(
            level=logging.INFO if args.verbose else logging.WARNING,
            format="%(levelname)s %(name)s: %(message)s",
        )
        os.environ.setdefault("RAY_DEDUP_LOGS", "1")
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
        hint = "the run keeps its last checkpoint"
        hint = exc.resume_hint if isinstance(exc, Interrupted) else hint
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


if __name__ == "__main__":
    entry()
