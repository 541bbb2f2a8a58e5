"""Mutation check of tests/privacy: applies each mutant of the privacy layer in turn, runs the
privacy tests, restores the file, and prints which tests failed (every mutant must fail one).

    PYTHONPATH=$PWD python3 experiments/privacy/mutants.py

It rewrites the mutated source files in place (and restores them): run it on a checkout where
nothing else (a study, a test run) imports rayfl meanwhile.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

HOOK = "rayfl/privacy/hook.py"
# name -> (file, original text, mutated text)
MUTANTS = {
    "secagg dropout never applied": (
        HOOK,
        "if sa.dropout > 0 and rng.random() < sa.dropout:",
        "if False and sa.dropout > 0 and rng.random() < sa.dropout:",
    ),
    "no noise on class statistics": (
        HOOK,
        "total = total + self.noise(total.size, round_idx)",
        "total = total + (self.noise(total.size, round_idx) "
        "if self.form == 'weighted_mean' else 0.0)",
    ),
    "stats client ignores the returned table": (
        "rayfl/algorithms/pfedes_stats.py",
        "self.table, self.counts = protos.stats_tensors(payload, self.ctx.device)",
        "pass",
    ),
    "noise std z instead of z * clip": (
        HOOK,
        "size, d.noise_multiplier * d.clip, [*key,",
        "size, d.noise_multiplier, [*key,",
    ),
    "clipping the payload instead of the update": (
        HOOK,
        "clipped, norm = dp.l2_clip(x - layout.flatten(received), self.cfg.dp.clip)\n"
        "                return clipped, norm",
        "clipped, norm = dp.l2_clip(x, self.cfg.dp.clip)\n"
        "                return clipped - layout.flatten(received), norm",
    ),
}
TESTS = [
    "tests/privacy/test_properties.py",
    "tests/privacy/test_hook.py",
    "tests/privacy/test_dp.py",
]


def main() -> int:
    survivors = 0
    for name, (file, old, new) in MUTANTS.items():
        path = Path(file)
        src = path.read_text()
        if src.count(old) != 1:
            print(f"{name}: the original text is not in {file} once; update this script")
            return 2
        path.write_text(src.replace(old, new))
        try:
            cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *TESTS]
            env = {**os.environ, "PYTHONPATH": os.getcwd()}
            out = subprocess.run(cmd + ["-m", "not ray"], capture_output=True, text=True, env=env)
        finally:
            path.write_text(src)
        failed = [
            line.split(" - ")[0] for line in out.stdout.splitlines() if line.startswith("FAILED")
        ]
        survivors += not failed
        print(f"{name}: {'KILLED' if failed else 'SURVIVED'} ({len(failed)} failing tests)")
        for line in failed:
            print(f"    {line}")
    return 1 if survivors else 0


if __name__ == "__main__":
    raise SystemExit(main())
