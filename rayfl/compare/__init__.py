"""Comparison suites: several algorithms x seeds (x settings) side by side, on the same partitions.

    rayfl compare experiments/suites/pfedes_paper_fmnist.yaml
    rayfl compare experiments/suites/seed3_fmnist.yaml seeds=[0] algorithms=[local,fedproto] engine.rounds=2
    rayfl compare experiments/suites/pfedes_paper_fmnist.yaml parallel=2 --out runs/suite

A suite file:

    suite: my_suite                    # name: MLflow parent run, output folder
    base: {data: ..., model: ..., train: ..., engine: ..., tracking: ...}   # a full run config
    # or: base_file: ../pfedes_fmnist.yaml  (next to this file, the working directory, or the repository root)
    algorithms:                        # one entry per compared method
      - name: local
      - name: pfedes
        label: pfedes_input            # unique label (default: the name)
        overrides: {algorithm.variant: input}       # dotted keys; or ["algorithm.variant=input"]
    seeds: [0, 1, 2]
    settings:                          # optional: named override sets that multiply the runs
      - name: dir0.5
        overrides: {data.partition.alpha: 0.5}

Every algorithm of a setting runs on the same partition for a given seed: the partition derives
from the `data` section and the seed only, so an algorithm's overrides may not touch `data.*` or
`seed` (put such changes in `base` or a setting). Command-line overrides apply to every run,
except the suite-level `seeds=[...]`, `algorithms=[labels]` and `settings=[names]`, which select.

    parallel: 2                        # optional: runs at a time (default 1: one after another)

Runs execute `parallel` at a time as a Ray Tune grid (the machinery of `rayfl tune`), one trial
per run, each in a placement group sized like a sweep's trial (`rayfl.tune.grid`) that also holds
the run's worker and server actors, so runs on a cluster never hold half of what they need; a
run trains in its trial's process (`engine.executor=serial`) or on its own workers (`ray`). Each
run is an MLflow child run under one parent run. Rerunning the same command with the same
`--out` resumes: finished runs are skipped, unfinished ones continue from their checkpoints (and
their own MLflow runs), all under the same parent run (its id is kept in
`<out>/mlflow_run.json`); a failed run is recorded (status FAILED and its error) and the others
go on. Checkpoints are removed once a run finished, unless `--keep-checkpoints`. The output
folder holds every run's directory, `runs.csv|parquet` (one row per run), `results.csv|parquet`
(`<metric> [mean]` and `<metric> [std]` over seeds of every final metric), learning-curve plots
and `table.txt` (what `run_suite` returns).

The package: `suite` loads a suite file, `execute` runs it, `results` aggregates and tables it.
"""

from rayfl.compare.execute import SuiteInterrupted, run_dir_of, run_suite
from rayfl.compare.results import (
    ARCH_PREFIX,
    DOMAIN_PREFIX,
    PERSONAL,
    aggregate,
    arch_rows,
    curves_and_spread,
    format_results,
    mean_col,
    mean_curves,
    std_col,
    table_rows,
)
from rayfl.compare.suite import load_suite

__all__ = [
    "ARCH_PREFIX",
    "DOMAIN_PREFIX",
    "PERSONAL",
    "SuiteInterrupted",
    "aggregate",
    "arch_rows",
    "curves_and_spread",
    "format_results",
    "load_suite",
    "mean_col",
    "mean_curves",
    "run_dir_of",
    "run_suite",
    "std_col",
    "table_rows",
]
