"""The results plan: every table of docs/results.md as a declared suite, split into parts that
finish, each part's small result file committed so that rerunning the plan runs only what is
missing.

    python3 experiments/results_plan.py status                  # parts done, cost left, unverified
    python3 experiments/results_plan.py run --hours 2           # the missing parts that fit
    python3 experiments/results_plan.py run fedfd_cpu --jobs 2  # one table's missing parts
    python3 experiments/results_plan.py verify                  # older parts against this code
    python3 experiments/make_results.py                         # docs/results.md from the files

The tables are declared in `experiments/results_plan.yaml`. A part is one setting and one seed
of a table (and one group of its methods, where the table declares `groups:` to keep a part near
an hour of one core): the suite's methods on the same partition, run by `rayfl compare` with the
serial executor (the Ray executor's numbers, by the determinism contract) with one torch thread
for the server step as for the clients, `--jobs` parts at a time (one core each; two jobs use
both cores of a 2-core machine; two threads each would oversubscribe the cores, and a small
server step then runs tens of times slower while its threads wait on each other). A part's runs checkpoint
every round into `runs/plan/<table>/<part>/`, so a part that was stopped continues where it
was. When every run of a part finished, its result file `docs/results/plan/<table>/<part>.json`
holds each run's final metrics, its per-round history of the table's metric, the final round's
per-client table, the commits each run's pieces ran at and the plan's own commit; checkpoints
and models stay out of it. Parts run under `rayfl.seeding.PORTABLE_CPU_ENV`, so a part rerun
on another x86-64 machine gives its numbers.

`verify` says whether parts made at older commits hold for the current code: for each commit a
table's runs ran at, it runs one part of each setting and method group (the command its file
records) at that commit, in a temporary git worktree (given the files of experiments/ it lacks,
as they are now), and the same part at the current code, both under `PORTABLE_CPU_ENV` and cut
to the table's `check:` size (`CHECK` by default), and compares the final metrics, per-client
accuracies and resolved configs of the methods whose runs ran at that commit exactly (the
determinism contract: the same config and seed give the same numbers). A commit whose package
and suites equal the current ones, with the same commands, needs no run, nor does one the
table's last `verify` ran against the same code and plan. The verdicts go to
`docs/results/plan/<table>/code.json`, which the page cites beside each table's commits.

A part's cost is estimated from the table's measured seconds per round (one core) per method:
`sum over the part's methods of round_s x rounds`. `run --hours H` starts a part only while the estimate
of everything started so far fits in `H x jobs` core-hours.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from rayfl.seeding import PORTABLE_CPU_ENV

ROOT = Path(__file__).resolve().parents[1]
PLAN = ROOT / "experiments" / "results_plan.yaml"
RESULTS = ROOT / "docs" / "results" / "plan"
RUNS = ROOT / "runs" / "plan"
SERIAL = [
    "engine.executor=serial",
    "engine.server_threads=1",  # parts run side by side: one torch thread each
    "engine.checkpoint_every=1",
    "tracking.backend=none",
]
# `verify`'s default size (a table's `check:` replaces it): it compares code, not results, and
# two rounds on a thousand images take every step a method has (local training, the server's
# step, the next round's download, evaluation)
CHECK = ["engine.rounds=2", "data.train_samples=1000"]
# what a part's numbers depend on: the package, the suites and configs, and the plan (which
# reaches a part only through its command)
CODE_PATHS = ["rayfl", "experiments/suites", ":(glob)experiments/*.yaml"]
NOT_PLAN = ":(exclude)experiments/results_plan.yaml"
CLIENT_KEYS = ("client", "arch", "domain", "num_train", "num_test", "acc")


@dataclass(frozen=True)
class Table:
    name: str
    spec: Mapping[str, Any]

    @property
    def suite(self) -> Path:
        return ROOT / self.spec["suite"]

    @property
    def overrides(self) -> list[str]:
        return list(self.spec.get("overrides", []))

    @property
    def rounds(self) -> int:
        return int(self.spec["rounds"])

    def settings(self) -> list[str]:
        return list(self.spec.get("settings") or [""])

    def seeds(self) -> list[int]:
        return list(self.spec["seeds"])

    def groups(self) -> dict[str, list[str]]:
        """The method groups a setting and seed splits into (`groups:`), each its own part so
        that a part stays near an hour of one core; one unnamed group of every method without."""
        return {
            str(k): list(v) for k, v in (self.spec.get("groups") or {"": self.methods()}).items()
        }

    def parts(self) -> list[str]:
        """`<setting>-s<seed>[-<group>]`, seed-major: every setting's seed 0 before any seed 1."""
        return [
            part_name(x, s, g) for s in self.seeds() for x in self.settings() for g in self.groups()
        ]

    def methods(self) -> list[str]:
        return list(self.spec["round_s"])

    def part_methods(self, part: str) -> list[str]:
        return self.groups()[split_part(part)[2]]

    def part_cost_s(self, part: str) -> float:
        """One part's estimated core-seconds: its methods' measured round times x rounds."""
        return sum(float(self.spec["round_s"][m]) for m in self.part_methods(part)) * self.rounds

    def max_part_cost_s(self) -> float:
        return max(self.part_cost_s(p) for p in self.parts())

    def missing(self) -> list[str]:
        """The parts without a result file yet."""
        return [p for p in self.parts() if not self.result(p).is_file()]

    def result(self, part: str) -> Path:
        return RESULTS / self.name / f"{part}.json"

    @property
    def check(self) -> list[str]:
        """The overrides that cut a part to `verify`'s size."""
        return list(self.spec.get("check", CHECK))

    def code_file(self) -> Path:
        """`verify`'s verdicts on the commits the table's parts ran at."""
        return RESULTS / self.name / "code.json"

    def command(self, part: str) -> list[str]:
        setting, seed, group = split_part(part)
        select = [f"seeds=[{seed}]"] + ([f"settings=[{setting}]"] if setting else [])
        if group:
            select.append(f"algorithms=[{','.join(self.part_methods(part))}]")
        return [
            sys.executable,
            "-m",
            "rayfl.cli",
            "compare",
            str(self.suite.relative_to(ROOT) if self.suite.is_relative_to(ROOT) else self.suite),
            *select,
            f"engine.rounds={self.rounds}",
            *self.overrides,
            *SERIAL,
            "--out",
            str((RUNS / self.name / part).relative_to(ROOT)),
        ]


def part_name(setting: str, seed: int, group: str = "") -> str:
    name = f"{setting}-s{seed}" if setting else f"s{seed}"
    return f"{name}-{group}" if group else name


PART = re.compile(r"^(?:(?P<setting>.+)-)?s(?P<seed>\d+)(?:-(?P<group>[a-z_]+))?$")


def split_part(part: str) -> tuple[str, int, str]:
    """(setting, seed, group) of a part's name; the inverse of `part_name`."""
    m = PART.match(part)
    if m is None:
        raise ValueError(f"not a part name: {part!r} (expected [<setting>-]s<seed>[-<group>])")
    return m["setting"] or "", int(m["seed"]), m["group"] or ""


def matches(key: str, patterns: Sequence[str]) -> bool:
    """`key` is one of `patterns`, or starts with one ending in `*`."""
    return any(key == p or (p.endswith("*") and key.startswith(p[:-1])) for p in patterns)


def load_plan(path: Path = PLAN) -> list[Table]:
    raw = yaml.safe_load(path.read_text())
    return [Table(name, spec) for name, spec in raw["tables"].items()]


def git(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True)


def commit() -> str:
    head = git("rev-parse", "--short", "HEAD").stdout.strip()
    dirty = git("status", "--porcelain", "--untracked-files=no", "rayfl").stdout.strip()
    return head + ("+dirty" if dirty else "")


def commonest_share(run_dir: Path) -> dict[int, float]:
    """Each client's share of its commonest test class (what a model that predicts one class
    scores at best), from the run's `class_counts.parquet`."""
    import pyarrow.parquet as pq

    path = run_dir / "class_counts.parquet"
    if not path.is_file():
        return {}
    counts: dict[int, list[int]] = {}
    for r in pq.read_table(path).to_pylist():
        if r["split"] == "test":
            counts.setdefault(int(r["client"]), []).append(int(r["count"]))
    return {c: max(v) / sum(v) for c, v in counts.items() if sum(v)}


def final_clients(run_dir: Path) -> list[dict[str, Any]]:
    """The last round's per-client rows, each with its `commonest` test-class share."""
    import pyarrow.parquet as pq

    path = run_dir / "clients.parquet"
    if not path.is_file():
        return []
    rows = pq.read_table(path).to_pylist()
    last = max(r["round"] for r in rows)
    share = commonest_share(run_dir)
    return [
        {**{k: r.get(k) for k in CLIENT_KEYS}, "commonest": share.get(int(r["client"]))}
        for r in rows
        if r["round"] == last
    ]


def collect_part(table: Table, part: str, code: str) -> dict[str, Any] | None:
    """The part's result file's content, or None while a run of it is unfinished. Its `wall_s`
    sums its runs' own wall times (each over its resumed pieces)."""
    import pyarrow.parquet as pq

    out = RUNS / table.name / part
    if not (out / "runs.parquet").is_file():
        return None
    rows = pq.read_table(out / "runs.parquet").to_pylist()
    if len(rows) < len(table.part_methods(part)) or any(r["status"] != "FINISHED" for r in rows):
        return None
    wanted = [table.spec["metric"], "time/round_s", *table.spec.get("history", [])]
    runs = []
    for row in rows:
        run_dir = Path(row["run_dir"])
        history = pq.read_table(run_dir / "metrics.parquet").to_pylist()
        summary = json.loads((run_dir / "summary.json").read_text())
        final = {
            k: v
            for k, v in summary.get("final", {}).items()
            if isinstance(v, (int, float)) and not k.startswith("time/startup")
        }
        runs.append(
            {
                "label": row["label"],
                "algorithm": row["algorithm"],
                "seed": int(row["seed"]),
                "setting": row["setting"] or "",
                "rounds": int(row["rounds"]),
                "final": final,
                "history": [
                    {k: v for k, v in h.items() if v is not None and matches(k, ["round", *wanted])}
                    for h in history
                ],
                "clients": final_clients(run_dir),
                "commits": [c[:7] for c in summary.get("commits", [])],
                # summary.json writes NaN and inf as null: a client's training diverged
                "nonfinite": sorted(k for k, v in summary.get("final", {}).items() if v is None),
            }
        )
    setting, seed, group = split_part(part)
    return {
        "table": table.name,
        "part": part,
        "setting": setting,
        "seed": seed,
        "group": group,
        "commit": code,
        "command": " ".join(table.command(part)[2:]).replace("rayfl.cli", "rayfl", 1),
        "wall_s": round(sum(r["final"].get("time/wall_s", 0.0) for r in runs)),
        "runs": runs,
    }


def commits_of(part: Mapping[str, Any], run: Mapping[str, Any]) -> list[str]:
    """The commits one run of a part ran at; the plan's recorded one for a run that lists none."""
    return run.get("commits") or [part["commit"]]


def run_commits(part: Mapping[str, Any]) -> list[str]:
    """The commits a part's runs ran at."""
    return sorted({c for r in part["runs"] for c in commits_of(part, r)})


def part_commits(parts: Iterable[Mapping[str, Any]]) -> list[str]:
    """The commits the parts' runs ran at (each piece of each run), and the one the plan recorded
    at collection for a part with runs that list none (made before runs recorded theirs)."""
    return sorted({c for part in parts for c in run_commits(part)})


def ran_at(part: Mapping[str, Any], c: str) -> set[str]:
    """The labels of a part's runs that ran (some of their rounds) at commit `c`."""
    return {r["label"] for r in part["runs"] if c in commits_of(part, r)}


def final_numbers(out: Path) -> dict[str, Any]:
    """`label/metric` for each finished run of a `rayfl compare` folder's final metrics (timings
    left out), `label/client<k>/acc` for its last round's client accuracies and
    `label/config/<key>` for its resolved config (tracking names left out): a setting that
    differs is a difference even where it does not bind at a check's size."""
    import pyarrow.parquet as pq

    numbers: dict[str, Any] = {}
    for row in pq.read_table(out / "runs.parquet").to_pylist():
        run_dir = Path(row["run_dir"])
        final = json.loads((run_dir / "summary.json").read_text()).get("final", {})
        label = row["label"]
        numbers |= {f"{label}/{k}": v for k, v in final.items() if not k.startswith("time/")}
        numbers |= {f"{label}/client{c['client']}/acc": c["acc"] for c in final_clients(run_dir)}
        config = yaml.safe_load((run_dir / "config.yaml").read_text())
        numbers |= {
            f"{label}/config/{k}": v
            for k, v in flat(config).items()
            if not k.startswith("tracking.")
        }
    return numbers


def flat(tree: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """A nested mapping's leaves by dotted key."""
    out: dict[str, Any] = {}
    for k, v in tree.items():
        if isinstance(v, Mapping) and v:
            out |= flat(v, f"{prefix}{k}.")
        else:
            out[f"{prefix}{k}"] = v
    return out


def compare_numbers(old: Mapping[str, Any], new: Mapping[str, Any]) -> dict[str, Any]:
    """Equal when every number both report has the same value (a float's every bit); metrics
    one of them no longer or not yet reports are listed, not counted against it."""
    differ = sorted(k for k in old.keys() & new.keys() if old[k] != new[k])
    only_old, only_new = sorted(old.keys() - new.keys()), sorted(new.keys() - old.keys())
    equal = bool(old.keys() & new.keys()) and not differ
    return {
        "equal": equal,
        "numbers": len(old.keys() & new.keys()),
        "differ": differ,
        "only_old": only_old,
        "only_new": only_new,
    }


def check_run(code: Path, args: Sequence[str], out: Path, parts: Parts) -> dict[str, Any]:
    """Runs `rayfl <args>` with the package in `code`; its final numbers."""
    env = {**PORTABLE_CPU_ENV, **os.environ, "PYTHONPATH": str(code)}
    cmd = [sys.executable, "-m", "rayfl.cli", *args, "--out", str(out)]
    out.parent.mkdir(parents=True, exist_ok=True)
    log = out.parent / f"{out.name}.log"
    with log.open("w") as f:
        proc = parts.start(cmd, f, cwd=code, env=env)
        rc = parts.wait(proc) if proc is not None else None
    if rc != 0:
        tail = log.read_text()[-2000:]
        raise RuntimeError(f"check run failed (exit {rc}) in {code}: {shlex.join(cmd)}\n{tail}")
    return final_numbers(out)


def part_args(command: str) -> list[str]:
    """A recorded part command's arguments after `rayfl`, without its `--out`."""
    args = shlex.split(command)[1:]
    if "--out" in args:
        i = args.index("--out")
        del args[i : i + 2]
    return args


def missing_files(tree: Path) -> None:
    """Copies into an older worktree the files of experiments/ it lacks (suites, configs,
    plugins): a part started while its suite was not yet committed ran the files as they were
    later committed."""
    for name in git("ls-files", "experiments").stdout.split():
        target = tree / name
        if not target.exists():
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes((ROOT / name).read_bytes())


def verify(table: Table, log: Any, jobs: int = 1) -> dict[str, Any]:
    """Each commit the table's parts ran at, checked against the current code (see the module's
    docstring), `jobs` check runs at a time; writes and returns the table's `code.json`."""
    files = part_files(table)
    by_commit: dict[str, list[str]] = {}  # commit -> one part per (setting, group)
    for part, data in files.items():
        setting, _, group = split_part(part)
        for c in run_commits(data):
            chosen = by_commit.setdefault(c, [])
            if all(split_part(p)[::2] != (setting, group) for p in chosen):
                chosen.append(part)
    checks: dict[str, Any] = {}
    code = commit()
    kept = still_valid(table)
    with tempfile.TemporaryDirectory(prefix="rayfl-verify-") as tmp:
        trees: dict[str, Path] = {}  # the commits that need check runs, each in a worktree
        for c, parts in sorted(by_commit.items()):
            if c in kept and {r["part"] for r in kept[c]["parts"]} >= set(parts):
                checks[c] = kept[c]
                log(f"{table.name} {c}: checked before against the same code")
            elif (
                all(part_args(files[p]["command"]) == now_args(table, p) for p in parts)
                and git("diff", "--quiet", c, "--", *CODE_PATHS, NOT_PLAN).returncode == 0
            ):
                checks[c] = {"equal": True, "identical": True, "parts": []}
                log(f"{table.name} {c}: the same package, suites and commands")
            elif git("worktree", "add", "--detach", str(Path(tmp) / c), c).returncode != 0:
                checks[c] = {"equal": False, "error": f"no commit {c} in this clone"}
            else:
                trees[c] = Path(tmp) / c
                missing_files(trees[c])
        # (commit, part) at that commit, ("", part) at the current code: (package, arguments)
        runs = {("", p): (ROOT, now_args(table, p)) for c in trees for p in by_commit[c]}
        for c in trees:
            runs |= {(c, p): (trees[c], part_args(files[p]["command"])) for p in by_commit[c]}

        def one(key: tuple[str, str]) -> tuple[tuple[str, str], Any]:
            code_dir, args = runs[key]
            out = Path(tmp) / "out" / (key[0] or "now") / key[1]
            try:
                numbers: Any = check_run(code_dir, [*args, *table.check], out, procs)
            except RuntimeError as exc:
                numbers = str(exc)
            log(f"{table.name} {key[1]} ran at {key[0] or 'the current code'}")
            return key, numbers

        procs = Parts()
        try:
            numbers = dict(each(one, list(runs), jobs, procs))
        finally:  # also when stopped: the worktrees go
            for tree in trees.values():
                git("worktree", "remove", "--force", str(tree))
    for c in trees:
        results = []
        for part in by_commit[c]:
            old, now = numbers[(c, part)], numbers[("", part)]
            if isinstance(old, str) or isinstance(now, str):  # a check run failed
                results.append(
                    {"part": part, "equal": False, "error": old if isinstance(old, str) else now}
                )
            else:  # only the part's methods whose runs ran at c (a run may be newer)
                ran = ran_at(files[part], c)
                old, now = (
                    {k: v for k, v in d.items() if k.split("/")[0] in ran} for d in (old, now)
                )
                results.append({"part": part, "methods": sorted(ran), **compare_numbers(old, now)})
            log(f"{table.name} {c} {part}: {'equal' if results[-1]['equal'] else 'DIFFER'}")
        checks[c] = {"equal": all(r["equal"] for r in results), "parts": results}
    data = {"code": code, "check": table.check, "commits": dict(sorted(checks.items()))}
    table.code_file().write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
    return data


def part_files(table: Table) -> dict[str, Any]:
    """The table's finished parts' result files, by part."""
    return {
        p: json.loads(table.result(p).read_text())
        for p in table.parts()
        if table.result(p).is_file()
    }


def last_verify(table: Table) -> dict[str, Any] | None:
    """The table's last `verify` (its `code.json`) when the package, suites and plan it checked
    against are the current ones; None when there is none or they changed since."""
    if not table.code_file().is_file():
        return None
    last = json.loads(table.code_file().read_text())
    code = str(last.get("code", ""))
    if not code or code.endswith("+dirty"):
        return None
    if git("diff", "--quiet", code, "--", *CODE_PATHS).returncode != 0:
        return None
    return last


def unverified(table: Table) -> list[str]:
    """The commits the table's finished runs ran at that its last `verify` did not find to give
    the current code's numbers: every one when the package, a suite or the plan changed since."""
    commits = part_commits(part_files(table).values())
    last = last_verify(table)
    if last is None:
        return commits
    return [c for c in commits if not last["commits"].get(c, {}).get("equal")]


def still_valid(table: Table) -> dict[str, Any]:
    """The verdicts of the table's last `verify` that need no new runs: those it ran (not those
    it found identical, which depend on the commands) when the code and plan it checked against
    equal the current ones and the check's size is the same."""
    last = last_verify(table)
    if last is None or last.get("check") != table.check:
        return {}
    return {c: v for c, v in last["commits"].items() if v.get("parts")}


def now_args(table: Table, part: str) -> list[str]:
    """The part's `rayfl` arguments in the current plan, without its `--out`."""
    return table.command(part)[3:-2]


class Parts:
    """The plan's processes (its parts, or `verify`'s check runs): each in its own session, so
    that a Ctrl-C or `kill` reaches the plan only, which then stops each running process once (as
    `rayfl compare` stops on Ctrl-C, with its checkpoints) and starts no other."""

    def __init__(self) -> None:
        self.lock, self.stopped = threading.Lock(), False
        self.running: set[subprocess.Popen] = set()

    def start(
        self, cmd: list[str], out: Any, cwd: Path = ROOT, env: Mapping[str, str] | None = None
    ) -> subprocess.Popen | None:
        if env is None:  # the same numbers on any x86-64 machine
            env = {**PORTABLE_CPU_ENV, **os.environ}
        with self.lock:
            if self.stopped:
                return None
            proc = subprocess.Popen(
                cmd, cwd=cwd, env=env, stdout=out, stderr=out, start_new_session=True
            )
            self.running.add(proc)
            return proc

    def wait(self, proc: subprocess.Popen) -> int:
        rc = proc.wait()
        with self.lock:
            self.running.discard(proc)
        return rc

    def stop(self) -> None:
        with self.lock:
            self.stopped = True
            for proc in self.running:
                proc.send_signal(signal.SIGINT)


def run_part(table: Table, part: str, code: str, log: Any, parts: Parts) -> bool:
    """Runs (or resumes) one part and writes its result file; False when it did not finish."""
    if table.result(part).is_file():  # another `run` finished it meanwhile
        return True
    with (RUNS / table.name / f"{part}.log").open("a") as out:
        proc = parts.start(table.command(part), out)
        if proc is None:
            return False
        rc = parts.wait(proc)
    data = collect_part(table, part, code)
    if rc != 0 or data is None:
        log(f"{table.name}/{part}: not finished (exit {rc}); rerun to resume")
        return False
    table.result(part).parent.mkdir(parents=True, exist_ok=True)
    table.result(part).write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
    log(f"{table.name}/{part}: done in {data['wall_s']} s -> {table.result(part)}")
    return True


def status(tables: Sequence[Table], jobs: int) -> list[str]:
    lines, left = [], 0.0
    for t in tables:
        missing = t.missing()
        left += sum(t.part_cost_s(p) for p in missing)
        lines.append(
            f"{t.name}: {len(t.parts()) - len(missing)}/{len(t.parts())} parts done; a part up to"
            f" ~{t.max_part_cost_s() / 3600:.2f} core-hours ({len(t.methods())} methods in "
            f"{len(t.groups())} group(s) x {t.rounds} rounds); missing: {', '.join(missing) or '-'}"
            f"; commits not verified against this code: {', '.join(unverified(t)) or '-'}"
        )
    lines.append(f"left: ~{left / 3600:.1f} core-hours, ~{left / 3600 / jobs:.1f} h at {jobs} jobs")
    return lines


def each(fn: Callable[[Any], Any], items: Sequence[Any], jobs: int, procs: Parts) -> list[Any]:
    """`fn` over `items`, `jobs` at a time. On Ctrl-C (or `kill`, which main() turns into one)
    it stops the processes `procs` started, starts no other and waits for its threads."""
    pool = ThreadPoolExecutor(max_workers=jobs)
    try:
        return list(pool.map(fn, items))
    except KeyboardInterrupt:
        procs.stop()
        raise
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


SAY = threading.Lock()


def say(msg: str) -> None:
    """A progress line with its time, whole although parts finish side by side."""
    with SAY:
        print(time.strftime("%H:%M:%S"), msg, flush=True)


def run(tables: Sequence[Table], jobs: int, hours: float, only: Sequence[str] = ()) -> int:
    todo = [(t, p) for t in tables for p in t.missing() if not only or p in only]
    budget, code = hours * 3600 * jobs, commit()
    chosen, spent = [], 0.0
    for t, p in todo:
        if spent + t.part_cost_s(p) <= budget:
            chosen.append((t, p))
            spent += t.part_cost_s(p)
    if not chosen:
        say("nothing to run within the budget" if todo else "every part is done")
        return 0
    for t, _ in chosen:
        (RUNS / t.name).mkdir(parents=True, exist_ok=True)
    say(f"{len(chosen)} parts, ~{spent / 3600:.1f} core-hours at code {code}")
    parts = Parts()
    try:
        ok = each(lambda tp: run_part(tp[0], tp[1], code, say, parts), chosen, jobs, parts)
    except KeyboardInterrupt:
        say("stopped; `run` again resumes the unfinished parts from their checkpoints")
        return 130
    return 0 if all(ok) else 1


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="run the results plan's missing parts")
    ap.add_argument("action", choices=["status", "run", "verify"])
    ap.add_argument("tables", nargs="*", help="table names, run in this order (default: all)")
    ap.add_argument(
        "--jobs",
        type=int,
        default=2,
        help="parts (or verify's check runs) at a time, one core each",
    )
    ap.add_argument("--hours", type=float, default=2.0, help="wall-clock budget for `run`")
    ap.add_argument("--parts", nargs="+", help="only these parts (e.g. dir0.1-s2) of the tables")
    args = ap.parse_args(argv)
    tables = load_plan()
    unknown = set(args.tables) - {t.name for t in tables}
    if unknown:
        ap.error(f"unknown table(s) {sorted(unknown)}; the plan has {[t.name for t in tables]}")
    by_name = {t.name: t for t in tables}
    chosen = [by_name[n] for n in args.tables] if args.tables else tables
    if args.action == "status":
        print("\n".join(status(chosen, args.jobs)))
        return 0
    # `kill` stops `run` and `verify` as Ctrl-C does: their processes stopped, worktrees removed
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    if args.action == "verify":
        try:
            for table in chosen:
                verify(table, say, args.jobs)
        except KeyboardInterrupt:
            print("verify stopped; the tables verified before keep their code.json")
            return 130
        return 0
    return run(chosen, args.jobs, args.hours, args.parts or ())


if __name__ == "__main__":
    sys.exit(main())
