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

Runs execute `parallel` at a time as a Ray Tune grid (`rayfl.tune.grid`), each an MLflow child
run under one parent run. Rerunning the same command with the same `--out` resumes (finished runs
skipped, unfinished ones continued from their checkpoints, under the same parent run); a failed
run is recorded and the others go on (docs/engine.md). The output folder holds every run's
directory, `runs.csv|parquet` (one row per run), `results.csv|parquet` (`<metric> [mean]` and
`<metric> [std]` over seeds), learning-curve plots and `table.txt`.
"""

from rayfl.compare.execute import SuiteInterrupted, run_suite
from rayfl.compare.results import (
    DOMAIN_PREFIX,
    aggregate,
    arch_rows,
    format_results,
    mean_col,
    mean_curves,
)
from rayfl.compare.suite import load_suite

__all__ = [
    "DOMAIN_PREFIX",
    "SuiteInterrupted",
    "aggregate",
    "arch_rows",
    "format_results",
    "load_suite",
    "mean_col",
    "mean_curves",
    "run_suite",
]
