"""`rayfl tune`: a sweep file becomes a Ray Tune `Tuner`; each trial is one simulation in its own
placement group, reporting every round (so ASHA can stop it early) and logging an MLflow child run
under the sweep's parent run. The sweep file, its overrides and outputs: docs/engine.md, Sweeps.
"""

from rayfl.tune.report import SweepResult
from rayfl.tune.run import run_sweep, sweep_and_report
from rayfl.tune.sweep import load_sweep

__all__ = ["SweepResult", "load_sweep", "run_sweep", "sweep_and_report"]
