"""Comparison suites: several algorithms x seeds (x settings) side by side, on the same partitions,
run `parallel` at a time as a Ray Tune grid under one MLflow parent run, resumed by rerunning the
same command. The suite file, its selectors and outputs: docs/engine.md, Suites.
"""

from rayfl.compare.execute import SuiteInterrupted, run_suite
from rayfl.compare.suite import load_suite

__all__ = ["SuiteInterrupted", "load_suite", "run_suite"]
