"""`rayfl validate`: every check of a run, suite, sweep, benchmark or Ray cluster launcher file
that needs no Ray, so that `rayfl run` does not stop on one after starting Ray.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rayfl.checks import check_family
from rayfl.clusterconfig import (
    ClusterSize,
    describe_cluster,
    is_cluster_file,
    validate_cluster_config,
)
from rayfl.config import build_config, read_yaml
from rayfl.errors import UserError
from rayfl.resources import check_cluster, local_note

# the file kinds that are not one run, by their top-level key: (what it is, the command to use)
OTHER_KINDS = {
    "suite": ("a comparison suite (algorithms x seeds)", "rayfl compare"),
    "sweep": ("a hyperparameter sweep", "rayfl tune"),
    "bench": ("a benchmark", "python3 experiments/benchmarks/bench.py"),
}


def refuse_other_kinds(path: Path) -> None:
    """`rayfl run` on a suite, sweep or benchmark file: one line naming the command to use."""
    raw = read_yaml(path)
    for key, (what, command) in OTHER_KINDS.items():
        if key in raw:
            raise UserError(f"{path} is {what}, not one run; run it with: {command} {path}")
    if is_cluster_file(raw):
        raise UserError(
            f"{path} is a Ray cluster launcher file, not a run; start the cluster with "
            f"ray up {path}, then run experiments with engine.address=auto"
        )


def split_overrides(args: Sequence[str]) -> tuple[list[str], list[str]]:
    """Positional arguments -> (files, key=value overrides): an argument with `=` that is not an
    existing file is an override."""
    files = [a for a in args if "=" not in a or Path(a).exists()]
    return files, [a for a in args if a not in files]


def validate_file(
    path: str | Path,
    overrides: Sequence[str] = (),
    cluster: ClusterSize | None = None,
    notes: list[str] | None = None,
) -> str:
    """Validate a file; return a one-line description, or raise a UserError (one line). With
    `cluster` (`--cluster FILE`) the runs must fit that cluster at its maximum size; without
    it, a local run this machine cannot place adds a warning to `notes`."""
    raw = read_yaml(path)
    if is_cluster_file(raw):
        return describe_cluster(validate_cluster_config(path))
    configs: list[Any]
    if "suite" in raw:
        from rayfl.compare import load_suite

        suite = load_suite(path, overrides)
        configs, describe = [r.config for r in suite.runs], f"suite of {len(suite.runs)} runs"
    elif "sweep" in raw:
        from rayfl.tune import load_sweep

        sweep = load_sweep(path, overrides)
        configs, describe = [sweep.config], f"sweep over {', '.join(sweep.space)}"
    else:
        # a benchmark's base is one run (its variants: experiments/benchmarks/bench.py)
        bench = raw.pop("bench", None) is not None
        cfg = build_config(raw, overrides)
        archs = check_family(cfg)
        configs = [cfg]
        describe = (
            f"{'benchmark: ' if bench else ''}{cfg.algorithm.name} on {cfg.data.dataset}, "
            f"{cfg.data.num_clients} clients, {len(set(archs))} architectures"
        )
    found: list[str] = []
    engines: list[Any] = []  # each distinct engine section once (not hashable: a list)
    for e in (cfg.engine for cfg in configs):
        if e not in engines:
            engines.append(e)
            if cluster is not None:
                check_cluster(e, cluster)
            else:
                found.append(local_note(e))
    for cfg in configs:  # valid settings an algorithm knows to be pointless (`Params.notes`)
        found += getattr(cfg.algorithm.params, "notes", list)()
    if notes is not None:
        notes += [n for n in dict.fromkeys(found) if n and n not in notes]
    return describe
