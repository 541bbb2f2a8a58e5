"""The privacy-utility study: every setting below x 3 seeds on experiments/privacy/fmnist200.yaml,
each run's summary kept (small JSON) in docs/results/privacy/runs/, then rendered by render.py.

    PYTHONPATH=$PWD nice -n 19 python3 experiments/privacy/study.py --jobs 2
    PYTHONPATH=$PWD python3 experiments/privacy/render.py

Runs whose JSON already exists are skipped, so the same command resumes an interrupted study;
`--only LABEL` runs one setting. Run directories (plots, parquet) go to --work (not committed).
Order: seed-major, so a study cut short still has every setting at its first seeds.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
BASE = ROOT / "experiments" / "privacy" / "fmnist200.yaml"
OUT = ROOT / "docs" / "results" / "privacy" / "runs"
SEEDS = (0, 1, 2)
NOISE = (1.0, 2.0, 4.0)  # DP noise multipliers of the accuracy-vs-epsilon curve

DP = ["privacy.dp.enabled=true"]
# label -> overrides of the base; group and z are read back from each run's config by render.py
SETTINGS: dict[str, list[str]] = {
    "fedavg": ["eval.local_baseline=true"],  # no protection, and the local-only baseline
    **{f"fedavg_dp_z{z:g}": [*DP, f"privacy.dp.noise_multiplier={z}"] for z in NOISE},
    # the statistics channel alone, and under SecAgg with 30% simulated dropout (SecAgg without
    # dropout gives the plain sum to fixed-point precision: tests/privacy/test_hook.py)
    "stats": ["algorithm.name=pfedes", "algorithm.variant=stats", "algorithm.alpha=1.0"],
    "stats_secagg_drop0.3": [
        "algorithm.name=pfedes",
        "algorithm.variant=stats",
        "algorithm.alpha=1.0",
        "privacy.secagg.enabled=true",
        "privacy.secagg.dropout=0.3",
    ],
    # pFedES's proxy channel (variant kd with the return path: the local model distils from the
    # received proxy), without DP and under DP at the epsilon of the other z = 1 settings
    "proxy": ["algorithm.name=pfedes", "algorithm.variant=kd", "algorithm.beta=0.5"],
    "proxy_dp_z1": [
        "algorithm.name=pfedes",
        "algorithm.variant=kd",
        "algorithm.beta=0.5",
        *DP,
        "privacy.dp.noise_multiplier=1.0",
    ],
    # statistics-only upload vs the full model update, both under DP at the same epsilon
    "stats_dp_z1": [
        "algorithm.name=pfedes",
        "algorithm.variant=stats",
        "algorithm.alpha=1.0",
        *DP,
        "privacy.dp.noise_multiplier=1.0",
    ],
}


def run_one(label: str, seed: int, work: Path) -> str:
    name = f"{label}-s{seed}"
    out = OUT / f"{name}.json"
    if out.exists():
        return f"{name}: kept"
    run_dir = work / name
    if run_dir.exists():
        _wait_for(run_dir)  # a run this study started before it was restarted: adopt it
    if _status(run_dir) != "FINISHED":
        shutil.rmtree(run_dir, ignore_errors=True)
        _start(label, seed, run_dir, work / f"{name}.log")
    return _keep(label, name, run_dir, out)


def _status(run_dir: Path) -> str | None:
    """The run's status in its summary.json (written at the start as RUNNING), or None."""
    try:
        return str(json.loads((run_dir / "summary.json").read_text())["status"])
    except (OSError, ValueError, KeyError):
        return None


def _wait_for(run_dir: Path) -> None:
    """Wait while the process named in the run directory's lock file is alive."""
    try:
        pid = int((run_dir / ".lock").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return
    while _status(run_dir) in (None, "RUNNING") and Path(f"/proc/{pid}").exists():
        time.sleep(10)


def _start(label: str, seed: int, run_dir: Path, log: Path) -> None:
    cmd = [sys.executable, "-m", "rayfl.cli", "run", str(BASE), *SETTINGS[label], f"seed={seed}"]
    cmd += ["--out", str(run_dir), "--no-progress"]
    with log.open("w") as fh:
        subprocess.run(cmd, stdout=fh, stderr=subprocess.STDOUT, env=os.environ)


def _keep(label: str, name: str, run_dir: Path, out: Path) -> str:
    """The run's summary, trimmed, as docs/results/privacy/runs/<name>.json."""
    if _status(run_dir) != "FINISHED":
        return f"{name}: FAILED (see {run_dir.parent / (name + '.log')})"
    summary = json.loads((run_dir / "summary.json").read_text())
    keep = {k: summary[k] for k in ("name", "seed", "status", "rounds", "config", "final")}
    keep["label"] = label
    keep["final"] = {k: v for k, v in keep["final"].items() if not k.startswith("time/")}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(keep, indent=1, sort_keys=True) + "\n")
    return f"{name}: acc {keep['final'].get('personal/acc')}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=1)
    parser.add_argument("--work", type=Path, default=Path("/tmp/rayfl-privacy-study"))
    parser.add_argument("--only", action="append", help="a label of SETTINGS (repeatable)")
    parser.add_argument("--seeds", type=int, nargs="*", default=list(SEEDS))
    args = parser.parse_args()
    labels = args.only or list(SETTINGS)
    unknown = [x for x in labels if x not in SETTINGS]
    if unknown:
        parser.error(f"unknown setting {unknown[0]!r}; choose from {', '.join(SETTINGS)}")
    args.work.mkdir(parents=True, exist_ok=True)
    # the accuracy-vs-epsilon curve first (seed-major), then the other comparisons
    core = [x for x in labels if x.startswith("fedavg")]
    rest = [x for x in labels if x not in core]
    jobs = [(x, s) for group in (core, rest) for s in args.seeds for x in group]
    with ThreadPoolExecutor(max_workers=args.jobs) as pool:
        for line in pool.map(lambda j: run_one(j[0], j[1], args.work), jobs):
            print(line, flush=True)  # noqa: T201 (a command-line script)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
