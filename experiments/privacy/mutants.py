"""Mutation check of tests/privacy: applies each mutant of the privacy layer in turn, runs the
privacy tests, restores the file, and prints which tests failed (every mutant must fail one).

    PYTHONPATH=$PWD python3 experiments/privacy/mutants.py

Run it on a clean checkout only: it rewrites the mutated files in place and restores them.
"""

import os
import subprocess
import sys

M = {
 "M1_dropout_never_applied": ("rayfl/privacy/hook.py",
   "if sa.dropout > 0 and rng.random() < sa.dropout:", "if False and sa.dropout > 0 and rng.random() < sa.dropout:"),
 "M2_no_noise_on_class_stats": ("rayfl/privacy/hook.py",
   "total = total + self.noise(total.size, round_idx)", "total = total + (self.noise(total.size, round_idx) if self.form == 'weighted_mean' else 0.0)"),
 "M3_stats_client_ignores_table": ("rayfl/algorithms/pfedes_stats.py",
   "self.table, self.counts = protos.stats_tensors(payload, self.ctx.device)", "pass"),
 "M4_noise_std_z": ("rayfl/privacy/hook.py",
   "return dp.gaussian_noise(size, d.noise_multiplier * d.clip,", "return dp.gaussian_noise(size, d.noise_multiplier,"),
 "M5_clip_payload": ("rayfl/privacy/hook.py",
   "clipped, norm = dp.l2_clip(x - layout.flatten(received), self.cfg.dp.clip)\n                return clipped, norm",
   "clipped, norm = dp.l2_clip(x, self.cfg.dp.clip)\n                return clipped - layout.flatten(received), norm"),
}
for name, (path, old, new) in M.items():
    src = open(path).read()
    assert src.count(old) == 1, (name, src.count(old))
    open(path, "w").write(src.replace(old, new))
    try:
        r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/privacy/test_properties.py", "tests/privacy/test_hook.py", "tests/privacy/test_dp.py", "-m", "not ray", "-q"], capture_output=True, text=True, env={**os.environ, "PYTHONPATH": os.getcwd()})
        failed = [l for l in r.stdout.splitlines() if l.startswith("FAILED")]
        print(name, "->", r.stdout.strip().splitlines()[-1])
        for l in failed: print("   ", l[:150])
    finally:
        open(path, "w").write(src)
print(subprocess.run(["git", "status", "--short"], capture_output=True, text=True).stdout)
