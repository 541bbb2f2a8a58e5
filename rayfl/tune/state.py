"""Tune's own state in a sweep folder (`<out>/tune`), restored only from what this user's rayfl
sealed: Ray Tune unpickles it on a restore, so a file nobody vouches for is never handed to it.

Two seals, both written through the gate (so its authenticated manifest vouches for them):
- `tune_state.json`: the sha256 of every file under `<out>/tune` when the sweep ended (or
  stopped); a restore needs the folder to match it exactly.
- `tune_snapshot.json`: while the sweep runs, a copy of Tune's state taken each time Tune saves
  it after a trial finished (`Snapshots`). A sweep killed at any moment (SIGKILL, power loss)
  resumes from it: `<out>/tune/<sweep>` is rebuilt from the copy, never read as it was left.
"""

from __future__ import annotations

import base64
import hashlib
import json
import logging
from pathlib import Path
from typing import Any

from rayfl import gate
from rayfl.errors import UserError

log = logging.getLogger(__name__)

SEAL = "tune_state.json"  # the sha256 of every file Tune wrote under <out>/tune
SNAPSHOT = "tune_snapshot.json"  # Tune's state after the last finished trial, file by file
MAX_FILES = 100_000


def read_tree(top: gate.Folder) -> dict[str, bytes]:
    """``relative path -> bytes`` of every file below ``top`` (at most `MAX_FILES`, each read
    bounded); a link, FIFO or device is refused."""
    out: dict[str, bytes] = {}

    def walk(folder: gate.Folder, prefix: str) -> None:
        for name in folder.names():
            kind = folder.kind(name)
            if kind == "dir":
                with folder.sub(name) as child:
                    walk(child, f"{prefix}{name}/")
            elif kind == "file" and len(out) < MAX_FILES:
                out[prefix + name] = folder.read_raw(name, gate.TABLE_LIMIT)
            elif kind is not None:  # (a file Tune removed meanwhile is skipped)
                raise gate.refuse(folder.path / name, f"is {kind}, not a plain file")

    walk(top, "")
    return out


def tree_hashes(top: gate.Folder) -> dict[str, str]:
    """``relative path -> sha256`` of every file below ``top``."""
    return {k: hashlib.sha256(v).hexdigest() for k, v in read_tree(top).items()}


def seal_tune_state(out: Path) -> None:
    """Record the hash of every file Tune wrote under `<out>/tune`: a restore unpickles them."""
    with gate.Folder(out) as folder, folder.sub("tune") as tune_dir:
        hashes = tree_hashes(tune_dir)
        folder.write(SEAL, json.dumps(hashes, sort_keys=True).encode())
        folder.remove(SNAPSHOT)  # the sealed end supersedes the last snapshot


def check_tune_state(out: Path, name: str) -> None:
    """Before Tune restores `<out>/tune/<name>`: the folder must match what this user's rayfl
    sealed when the sweep ended; else, when the sweep was killed, it is rebuilt from the last
    snapshot; else the restore is refused in one line, before Tune unpickles any of it."""
    with gate.Folder(out) as folder:
        try:
            snapshot = json.loads(folder.read(SNAPSHOT, gate.TABLE_LIMIT))
        except FileNotFoundError:
            snapshot = None
        try:
            sealed = json.loads(folder.read(SEAL, gate.JSON_LIMIT))
        except FileNotFoundError:
            sealed = None
        with folder.sub("tune") as tune_dir:
            if sealed is not None and tree_hashes(tune_dir) == sealed:
                return
            if snapshot is not None:
                log.info("restoring Tune's state of %s from its last snapshot", out)
                tune_dir.remove(name)
                with tune_dir.sub(name, create=True) as exp:
                    _unpack(exp, snapshot)
                return
    if sealed is None:
        raise UserError(
            f"{out / 'tune'}: its Tune state was never sealed (the sweep was killed before a "
            "trial finished, or not written by your rayfl), so it is not restored; start the "
            "sweep with another --out"
        )
    raise UserError(
        f"{out / 'tune'}: Tune's state differs from what your rayfl sealed (changed or "
        "planted files), so it is not restored; start the sweep with another --out"
    )


def _unpack(top: gate.Folder, snapshot: dict[str, str]) -> None:
    for rel, data in snapshot.items():
        head, _, base = rel.rpartition("/")
        if head:
            with top.sub(head, create=True) as sub:
                sub.write(base, base64.b64decode(data), record=False)
        else:
            top.write(base, base64.b64decode(data), record=False)


def snapshots(out: Path) -> Any:
    """A Tune callback that copies Tune's state into `<out>/tune_snapshot.json` each time Tune
    saves it after a trial finished. Tune saves (calls `get_state`) right after writing its
    experiment state to the driver's staging folder, so the copy is consistent: the staging
    folder (fresh) over the experiment folder in `<out>/tune` (which Tune syncs from it now and
    then, and which holds the `tuner.pkl` Tune wrote at the start)."""
    from ray.tune import Callback

    class Snapshots(Callback):  # type: ignore[misc]
        trial: Any = None  # a finished trial, not yet in a snapshot

        def on_trial_complete(self, iteration: int, trials: Any, trial: Any, **info: Any) -> None:
            self.trial = trial

        def on_trial_error(self, iteration: int, trials: Any, trial: Any, **info: Any) -> None:
            self.trial = trial

        def get_state(self) -> dict[str, Any] | None:
            if self.trial is not None:
                storage, self.trial = self.trial.storage, None
                try:
                    snapshot(
                        out, storage.experiment_fs_path, storage.experiment_driver_staging_path
                    )
                except (OSError, UserError) as exc:  # the sweep goes on; a resume uses an older one
                    log.warning("Tune's state was not snapshotted in %s: %s", out, exc)
            return None  # nothing of ours in Tune's own callback state

    return Snapshots()


def snapshot(out: Path, experiment: str, staging: str) -> None:
    """Write `<out>/tune_snapshot.json`: every file of `staging` over those of `experiment`."""
    with gate.Folder(experiment) as exp, gate.Folder(staging) as fresh:
        files = {**read_tree(exp), **read_tree(fresh)}
    data = {k: base64.b64encode(v).decode() for k, v in sorted(files.items())}
    gate.write(out / SNAPSHOT, json.dumps(data).encode())
