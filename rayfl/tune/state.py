"""Tune's own state in a sweep folder (`<out>/tune`), restored only from what this user's rayfl
sealed: Ray Tune unpickles it on a restore, so a file nobody vouches for is never handed to it.

The seal, `tune_state.json`, is a copy of every file of Tune's state written through the gate,
after each finished trial (`snapshots`) and when the sweep ends (`seal_tune_state`). A killed
sweep resumes from the last copy (`<out>/tune/<sweep>` is rebuilt from it); after a sweep that
ended, the folder must match the copy: a changed or planted file is refused.
"""

from __future__ import annotations

import base64
import json
import logging
from pathlib import Path
from typing import Any

from rayfl import gate
from rayfl.errors import UserError

log = logging.getLogger(__name__)

SEAL = "tune_state.json"  # {"ended": bool, "files": {relative path: base64}}
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


def _seal(out: Path, files: dict[str, bytes], ended: bool) -> None:
    data = {k: base64.b64encode(v).decode() for k, v in sorted(files.items())}
    gate.write(out / SEAL, json.dumps({"ended": ended, "files": data}).encode())


def seal_tune_state(out: Path) -> None:
    """Seal every file Tune wrote under `<out>/tune` when the sweep ends."""
    with gate.Folder(out) as folder, folder.sub("tune") as tune_dir:
        _seal(out, read_tree(tune_dir), ended=True)


def check_tune_state(out: Path, name: str) -> None:
    """Before Tune restores `<out>/tune/<name>`: rebuild it from the seal, refusing in one line
    (before Tune unpickles any of it) when there is none or a sweep that ended left files that
    differ from it."""
    with gate.Folder(out) as folder:
        try:
            sealed = json.loads(folder.read(SEAL, gate.TABLE_LIMIT))
        except FileNotFoundError:
            raise UserError(
                f"{out / 'tune'}: its Tune state was never sealed (the sweep was killed before "
                "a trial finished, or not written by your rayfl), so it is not restored; start "
                "the sweep with another --out"
            ) from None
        if not isinstance(sealed, dict) or not isinstance(sealed.get("files"), dict):
            raise UserError(
                f"{out / SEAL}: not a seal of this rayfl (an older format), so Tune's state is "
                "not restored; start the sweep with another --out"
            )
        files = {k: base64.b64decode(v) for k, v in sealed["files"].items()}
        with folder.sub("tune") as tune_dir:
            if sealed["ended"]:
                if read_tree(tune_dir) != files:
                    raise UserError(
                        f"{out / 'tune'}: Tune's state differs from what your rayfl sealed "
                        "(changed or planted files), so it is not restored; start the sweep "
                        "with another --out"
                    )
                return
            log.info("restoring Tune's state of %s from its last seal", out)
            tune_dir.remove(name)
            for rel, data in files.items():
                head, _, base = rel.rpartition("/")
                with tune_dir.sub(head, create=True) as sub:
                    sub.write(base, data, record=False)


def snapshots() -> Any:
    """A Tune callback that seals Tune's state each time Tune saves it after a trial finished.
    Tune calls `get_state` right after writing its experiment state to the driver's staging
    folder, so the copy (staging over `<out>/tune/<sweep>`, which holds `tuner.pkl`) is
    consistent. Tune pickles the callback into `tuner.pkl`, so it holds no path."""
    from ray.tune import Callback

    class Snapshots(Callback):  # type: ignore[misc]
        trial: Any = None  # a finished trial, not yet sealed

        def on_trial_complete(self, iteration: int, trials: Any, trial: Any, **info: Any) -> None:
            self.trial = trial

        def on_trial_error(self, iteration: int, trials: Any, trial: Any, **info: Any) -> None:
            self.trial = trial

        def get_state(self) -> dict[str, Any] | None:
            if self.trial is not None:
                storage, self.trial = self.trial.storage, None
                try:
                    snapshot(storage.experiment_fs_path, storage.experiment_driver_staging_path)
                except (OSError, UserError) as exc:  # the sweep goes on; a resume uses an older one
                    log.warning("Tune's state was not sealed: %s", exc)
            return None  # nothing of ours in Tune's own callback state

    return Snapshots()


def snapshot(experiment: str, staging: str) -> None:
    """Seal (not ended) every file of `staging` over those of `experiment` (`<out>/tune/<sweep>`)."""
    with gate.Folder(experiment) as exp, gate.Folder(staging) as fresh:
        files = {**read_tree(exp), **read_tree(fresh)}
    name, out = Path(experiment).name, Path(experiment).parents[1]
    _seal(out, {f"{name}/{k}": v for k, v in files.items()}, ended=False)
