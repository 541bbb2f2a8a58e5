"""A test plugin that injects faults into the runs of a suite, in whichever process runs them
(a Ray Tune trial imports the driver's plugins as it starts). Driven by environment variables,
so a `rayfl compare` subprocess started with them carries the faults to its trials:

- `SUITE_FAULTS_FAIL=name,...`: those runs (`tracking.run_name`, e.g. `proto-s0`) raise
  `RuntimeError: worker ran out of memory` before they start;
- `SUITE_FAULTS_SIGINT=name:round`: at the end of that round of that run, send SIGINT to the
  driver (a Ctrl-C) and wait there until Tune stops the trial (the driver is the first process
  that imports this plugin: it records its pid for the workers it starts);
- `SUITE_FAULTS_CALLS=path`: every run started appends its name to that file.
"""

from __future__ import annotations

import os
import signal
import time

import rayfl.launch
from rayfl.engine.callbacks import Callback

_simulate = rayfl.launch.simulate
DRIVER = int(os.environ.setdefault("SUITE_FAULTS_DRIVER", str(os.getpid())))


class CtrlCAfterRound(Callback):
    """SIGINT to `pid` at the end of round `at`, then wait (the trial is stopped meanwhile)."""

    def __init__(self, at: int, pid: int) -> None:
        self.at, self.pid = at, pid

    def on_round_end(self, sim, round_idx, metrics):
        if round_idx == self.at:
            os.kill(self.pid, signal.SIGINT)
            time.sleep(120)


def simulate(cfg, run_dir, **kw):
    name = cfg.tracking.run_name
    calls = os.environ.get("SUITE_FAULTS_CALLS")
    if calls:
        with open(calls, "a") as f:
            f.write(name + "\n")
    if name in os.environ.get("SUITE_FAULTS_FAIL", "").split(","):
        raise RuntimeError("worker ran out of memory")
    target, _, rest = os.environ.get("SUITE_FAULTS_SIGINT", "").partition(":")
    if target == name:
        kw["extra_callbacks"] = [*kw.get("extra_callbacks", ()), CtrlCAfterRound(int(rest), DRIVER)]
    return _simulate(cfg, run_dir, **kw)


rayfl.launch.simulate = simulate
