"""`rayfl tune`: a sweep file becomes a Ray Tune `Tuner`; each trial is one simulation in its own
placement group, reporting every round (so ASHA can stop it early) and logging an MLflow child run
under the sweep's parent run.

    rayfl tune experiments/sweeps/pfedes_T_alpha.yaml tune.num_samples=4 tune.scheduler=asha

A sweep file::

    sweep: pfedes_T_alpha                  # name: Tune experiment, MLflow parent run
    base: experiments/pfedes_fmnist.yaml   # relative to the sweep file, the cwd or the repository
    overrides: [engine.rounds=3, data.val_fraction=0.1]  # applied to the base experiment
    space:                                 # dotted config key -> one distribution
      algorithm.T: {grid: [2.0, 4.0]}      # every value (a grid multiplies the trials)
      algorithm.alpha: {loguniform: [0.01, 1.0]}
      algorithm.embed_dim: {choice: [64, 128]}
      #   also {uniform: [lo, hi]} and {randint: [lo, hi]} (both ends included)
    tune: {metric: personal/val_acc, mode: max, num_samples: 1, scheduler: null, max_concurrent: 2}

Trials are ranked on validation data: `tune.metric` defaults to `personal/val_acc`, which needs
`data.val_fraction` > 0 (refused in one line otherwise); a test metric named explicitly ranks on
test data, with a warning. The results table reports each trial's test `personal/acc` beside it.

Command-line overrides: `tune.<key>=...` sets the `tune:` section, `space.<dotted key>={grid: [..]}`
adds or replaces one space entry, and every other `key=value` goes to the base experiment after the
file's own `overrides` (e.g. `engine.rounds=5`).

Outputs under `--out` (default `runs/sweeps/<sweep>-<time>`): `tune/` (Tune's own state;
`tune.resume=true` continues it, also after a kill), `trials/<trial>/` (each trial's run
directory), `results.parquet` (one row per trial), `best_config.yaml` (the best trial's
experiment, ready for `rayfl run`) and `metric_vs_params.png`.
"""

from rayfl.tune.report import SweepResult, write_results
from rayfl.tune.run import run_sweep, sweep_and_report
from rayfl.tune.sweep import load_sweep, num_trials, search_space, split_overrides
from rayfl.tune.trial import TrialJob, TuneReport, trial_bundles, trial_config

__all__ = [
    "SweepResult",
    "TrialJob",
    "TuneReport",
    "load_sweep",
    "num_trials",
    "run_sweep",
    "search_space",
    "split_overrides",
    "sweep_and_report",
    "trial_bundles",
    "trial_config",
    "write_results",
]
