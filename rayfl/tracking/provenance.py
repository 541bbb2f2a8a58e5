"""Where a tracked run came from: user, command line, git commit, rayfl version, a descriptive
name, and which config keys are experiment parameters (not bookkeeping).

Pure Python (no MLflow import): the MLflow tracker turns these into MLflow's reserved tags
(`mlflow.user`, `mlflow.source.name`, `mlflow.source.type`, `mlflow.source.git.commit`).
"""

from __future__ import annotations

import dataclasses
import functools
import getpass
import os
import shlex
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from rayfl.version import __version__

COMMAND_ENV = "RAYFL_COMMAND"  # the CLI's command line, inherited by Ray workers and Tune trials

# Config keys that say how a run is recorded, not what it is: never logged as params.
BOOKKEEPING_SECTIONS = ("tracking",)
BOOKKEEPING_KEYS = ("name",)


def command_line() -> str:
    """The command that started this process (the CLI's, when a Ray worker runs on its behalf)."""
    if os.environ.get(COMMAND_ENV):
        return os.environ[COMMAND_ENV]
    argv = list(sys.argv)
    if argv and argv[0].endswith(("rayfl/cli.py", "/rayfl")):
        argv[0] = "rayfl"
    return shlex.join(argv) if argv else "python"


@functools.cache
def git_commit(path: str | Path | None = None) -> str | None:
    """HEAD of the git repository holding `path` (default: the rayfl package), or None. Read once
    per process: the commit of the code it imported, even if a later commit moves HEAD (a Tune
    trial process is reused for run after run), and one `git` call, not one per run."""
    where = Path(path) if path else Path(__file__).resolve().parent
    try:
        out = subprocess.run(
            ["git", "-C", str(where), "rev-parse", "HEAD"],
            capture_output=True,
            text=True,
            timeout=5,
            check=False,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    commit = out.stdout.strip()
    return commit if out.returncode == 0 and len(commit) == 40 else None


def _user() -> str:
    try:
        return getpass.getuser()
    except Exception:  # no passwd entry in some containers
        return os.environ.get("USER", "unknown")


def provenance_tags() -> dict[str, str]:
    """MLflow's reserved provenance tags plus rayfl's version (git commit only inside a repo)."""
    command = command_line()
    tags = {
        "mlflow.user": _user(),
        "mlflow.source.name": command,
        "mlflow.source.type": "LOCAL",
        "rayfl.version": __version__,
        "rayfl.command": command,
    }
    commit = git_commit()
    if commit:
        tags["mlflow.source.git.commit"] = commit
    return tags


def _abbrev(key: str) -> str:
    """`T` -> `T`, `alpha` -> `a`, `embed_dim` -> `ed`."""
    return key if len(key) <= 2 else "".join(part[0] for part in key.split("_") if part)


def run_name_for(cfg: Any, leading: int = 3) -> str:
    """A descriptive run name of `RunConfig` `cfg`: the algorithm, its `leading` first-declared
    parameters, any other changed from its default, and the seed (`pfedes-kd-T4-a0.1-b0.5-s0`)."""
    params = cfg.algorithm.params
    parts = [cfg.algorithm.name]
    for i, f in enumerate(dataclasses.fields(params)):
        value = getattr(params, f.name)
        changed = f.default is not dataclasses.MISSING and value != f.default
        if value is None or isinstance(value, dict | list | tuple) or i >= leading and not changed:
            continue
        if isinstance(value, bool):
            if value:
                parts.append(f.name)
        elif isinstance(value, str):
            parts.append(value)
        else:
            parts.append(f"{_abbrev(f.name)}{f'{value:g}' if isinstance(value, float) else value}")
    parts.append(f"s{cfg.seed}")
    return "-".join(parts)


def tracked_params(flat: Mapping[str, Any]) -> dict[str, Any]:
    """The flattened config without bookkeeping keys (tracking.*, the run's name)."""
    return {
        k: v
        for k, v in flat.items()
        if k not in BOOKKEEPING_KEYS and k.split(".", 1)[0] not in BOOKKEEPING_SECTIONS
    }
