"""Checkpoints in the run directory: nothing a user started is lost on a crash, and nothing in a
run directory can run code when it is resumed.

Layout::

    <run_dir>/checkpoint -> checkpoint.r00003-<pid>-<hex>    a symlink: the current checkpoint
    <run_dir>/checkpoint.r00003-<pid>-<hex>/
        manifest.json      format, round, run-config hash, every file's size and sha256
        history.json       the metric rows of rounds 1..round
        server.npz         the server half's state
        clients/<id>.npz   one file per client that has trained so far

A checkpoint is written into a new folder; it becomes current by one atomic rename (a new
symlink renamed over ``checkpoint``), so a crash at any moment leaves either the previous
checkpoint or the new one, never a mix. Client files of clients that did not train since the last
checkpoint are hard-linked from it (copied where links are not possible), so a round costs the
writes of its participants only. Nothing is read with pickle: states are ``.npz`` files loaded with
``allow_pickle=False``; nested dicts, lists, None and scalars are described by a JSON tree stored
in the same file (see :func:`encode_state`). ``--resume`` checks the manifest (round, file list,
sizes, checksums, config hash) and refuses a torn, foreign or truncated checkpoint in one line.

The manifest itself is read through :mod:`rayfl.gate`, which authenticates it (the user's key)
before it is parsed; the manifest's checksums then vouch for every state file.
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import math
import os
import re
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

import numpy as np

from rayfl import gate
from rayfl.engine.hooks import Callback
from rayfl.errors import UserError
from rayfl.schema import RunConfig, to_dict

if TYPE_CHECKING:
    from rayfl.engine.executor import Executor

log = logging.getLogger(__name__)

FORMAT = "rayfl-checkpoint/1"
LINK = "checkpoint"
_FOLDER = re.compile(r"^checkpoint\.r\d{5,}-[0-9]+-[0-9a-f]+$")
_TREE = "__tree__"
# engine settings that change where and how fast a run goes, never its numbers: a resume may
# change them (and tracking, name); everything else must match the checkpoint's config hash.
_RESULT_ENGINE_KEYS = ("fraction", "clients_per_round", "sampling", "eval_every", "min_replies")


def result_settings(config: dict[str, Any]) -> dict[str, Any]:
    """Of a config as `to_dict` gives it, the settings that determine a run's numbers
    (everything but engine placement, engine.rounds, checkpointing, tracking and the name), as
    JSON reads them back."""
    d = {k: v for k, v in config.items() if k not in ("engine", "tracking", "name")}
    engine = config.get("engine", {})
    d["engine"] = {k: engine[k] for k in _RESULT_ENGINE_KEYS if k in engine}
    return dict(json.loads(json.dumps(d, sort_keys=True, default=str)))


def config_hash(cfg: RunConfig) -> str:
    """sha256 of `result_settings` of `cfg`."""
    text = json.dumps(result_settings(to_dict(cfg)), sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()


# ------------------------------------------------------------------- states without pickle


def encode_state(obj: Any) -> tuple[Any, dict[str, np.ndarray]]:
    """Split a nested state into a JSON-able tree and its arrays (named ``a0``, ``a1``, ...).

    Supported: numpy arrays and scalars, dicts with str/int keys, lists, tuples, None, bool,
    int, float (exact, NaN and inf included) and str.

    Raises:
        TypeError: a value of another type (the message names its path in the state).
    """
    arrays: dict[str, np.ndarray] = {}

    def enc(x: Any, path: str) -> Any:
        if isinstance(x, np.ndarray | np.generic):
            arr = np.asarray(x)
            if arr.dtype.hasobject:
                raise TypeError(f"state {path}: object arrays cannot be checkpointed")
            name = f"a{len(arrays)}"
            arrays[name] = arr
            return {"a": name}
        if x is None or isinstance(x, bool | str):
            return {"v": x}
        if isinstance(x, int):
            return {"i": str(x)}
        if isinstance(x, float):
            return {"f": x.hex()}
        if isinstance(x, dict):
            items = []
            for k, v in x.items():
                if isinstance(k, bool) or not isinstance(k, str | int | np.integer):
                    raise TypeError(f"state {path}: key {k!r} is not a str or int")
                key: Any = k if isinstance(k, str) else int(k)
                items.append([key, enc(v, f"{path}.{k}")])
            return {"d": items}
        if isinstance(x, list | tuple):
            kind = "l" if isinstance(x, list) else "t"
            return {kind: [enc(v, f"{path}[{i}]") for i, v in enumerate(x)]}
        raise TypeError(f"state {path}: {type(x).__name__} cannot be checkpointed")

    return enc(obj, "state"), arrays


def decode_state(tree: Any, arrays: dict[str, np.ndarray]) -> Any:
    """Inverse of :func:`encode_state`."""
    if not isinstance(tree, dict) or len(tree) != 1:
        raise ValueError(f"malformed state tree node {tree!r}")
    ((kind, v),) = tree.items()
    if kind == "a":
        if not isinstance(v, str) or v not in arrays:
            raise ValueError(f"state tree names a missing array {v!r}")
        return arrays[v]
    if kind == "v":
        return v
    if kind == "i":
        if not isinstance(v, str) or len(v) > 40:
            raise ValueError("malformed integer in the state tree")
        return int(v)
    if kind == "f":
        return float.fromhex(v)
    if kind == "d":
        if not isinstance(v, list) or not all(isinstance(p, list) and len(p) == 2 for p in v):
            raise ValueError("malformed dict in the state tree")
        return {k: decode_state(x, arrays) for k, x in v}
    if kind in ("l", "t") and not isinstance(v, list):
        raise ValueError("malformed list in the state tree")
    if kind == "l":
        return [decode_state(x, arrays) for x in v]
    if kind == "t":
        return tuple(decode_state(x, arrays) for x in v)
    raise ValueError(f"unknown state tree node {kind!r}")


def write_file(path: Path, data: bytes) -> None:
    """Write and fsync one new checkpoint file (a separate function so tests can interrupt it)."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    with os.fdopen(os.open(path, flags, 0o644), "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def state_bytes(state: Any) -> bytes:
    """A state as the bytes of an ``.npz`` file (arrays plus the JSON tree as uint8)."""
    tree, arrays = encode_state(state)
    buf = io.BytesIO()
    meta = np.frombuffer(json.dumps(tree, allow_nan=False).encode(), dtype=np.uint8)
    np.savez(buf, **{_TREE: meta}, **arrays)  # type: ignore[arg-type]
    return buf.getvalue()


def load_state(path: Path | IO[bytes]) -> Any:
    """Read a state written by :func:`state_bytes` (a path or a binary file); never unpickles."""
    if isinstance(path, Path | str):
        return state_from_bytes(Path(path).read_bytes())
    return state_from_bytes(path.read())


def state_from_bytes(data: bytes) -> Any:
    """A state from the bytes of its ``.npz`` file, loaded with ``allow_pickle=False``."""
    with np.load(io.BytesIO(data), allow_pickle=False) as z:
        if _TREE not in z.files:
            raise ValueError("no state tree")
        tree = json.loads(bytes(z[_TREE]))
        arrays = {k: z[k] for k in z.files if k != _TREE}
    return decode_state(tree, arrays)


def _history_json(history: list[dict[str, float]]) -> bytes:
    # Strict JSON: non-finite values as strings ("nan", "inf", "-inf") that float() reads back.
    rows = [
        {k: (v if not isinstance(v, float) or math.isfinite(v) else repr(v)) for k, v in r.items()}
        for r in history
    ]
    return json.dumps(rows, allow_nan=False).encode()


def _read_history(data: bytes) -> list[dict[str, float]]:
    return [{str(k): float(v) for k, v in r.items()} for r in json.loads(data)]


# ------------------------------------------------------------------------- restore


@dataclass
class Restored:
    """A verified checkpoint: what the simulation applies to continue after ``round``."""

    round: int
    history: list[dict[str, float]]
    server_state: Any
    folder: Path
    files: dict[str, dict[str, Any]] = field(default_factory=dict)

    def client_ids(self) -> list[int]:
        return sorted(
            int(n[len("clients/") : -len(".npz")]) for n in self.files if n.startswith("clients/")
        )

    def client_states(self) -> Iterator[tuple[int, Any]]:
        """Yield ``(client id, state)`` one at a time, each read again and its checksum checked
        (the folder may have changed since :func:`verify`).

        Raises:
            UserError: a changed file, in one line.
        """
        with gate.Folder(self.folder) as folder:
            for cid in self.client_ids():
                name = f"clients/{cid}.npz"
                yield cid, state_from_bytes(_verified(folder, name, self.files[name]))


def _refuse(ckpt: Path, problem: str) -> UserError:
    return UserError(
        f"cannot resume from {ckpt}: {problem}; the run directory was changed or written by "
        "something else. Start a new run (rayfl run CONFIG --out NEW_DIR)"
    )


def _verified(folder: gate.Folder, name: str, info: dict[str, Any]) -> bytes:
    """The bytes of ``name``, which the authenticated manifest gives as ``info``."""
    try:
        data = folder.read_raw(name, int(info["bytes"]))
    except FileNotFoundError:
        raise _refuse(folder.path / name, "it is missing") from None
    if hashlib.sha256(data).hexdigest() != info.get("sha256"):
        raise _refuse(folder.path / name, "it is truncated or changed (checksum mismatch)")
    return data


def has_checkpoint(run_dir: Path) -> bool:
    """Whether ``run_dir`` has a current checkpoint to resume from (not yet verified)."""
    return (Path(run_dir) / LINK).is_symlink()


def verify(run_dir: Path, cfg: RunConfig) -> Restored:
    """Check the current checkpoint of ``run_dir`` against its manifest and ``cfg`` and load it.

    Raises:
        UserError: no checkpoint, an old (pickle) checkpoint, a torn, foreign or mismatched
            one; one line each.
    """
    with gate.Folder(run_dir) as top:
        target = top.target(LINK)
        if target is None:
            if top.kind(LINK) == "dir":
                raise UserError(
                    f"cannot resume from {run_dir / LINK}: it was written by an older rayfl "
                    "that stored the server with pickle, which rayfl no longer loads; start a new run"
                )
            raise UserError(
                f"no checkpoint in {run_dir}: --resume needs a run directory written by "
                "`rayfl run --out` with engine.checkpoint_every > 0 that finished at least one round"
            )
        if not _FOLDER.match(target):
            raise _refuse(run_dir / LINK, f"it points outside the run directory ({target!r})")
        folder = top.sub(target)
    with folder:
        try:
            manifest = json.loads(folder.read("manifest.json", gate.JSON_LIMIT))
        except FileNotFoundError:
            raise _refuse(folder.path, "manifest.json is missing") from None
        if manifest.get("config_hash") != config_hash(cfg):
            raise UserError(
                f"cannot resume from {folder.path}: the checkpoint was written with other "
                "settings (seed, data, model, algorithm, train or sampling differ from this "
                "run's config); resume with the run directory's own config.yaml, or start a new run"
            )
        rnd, files = manifest["round"], manifest["files"]
        for name, info in files.items():  # every state's checksum, before Ray or any model
            _verified(folder, name, info)
        history = _read_history(_verified(folder, "history.json", files["history.json"]))
        server = state_from_bytes(_verified(folder, "server.npz", files["server.npz"]))
    return Restored(rnd, history, server, folder.path, files)


# ---------------------------------------------------------------------------- save


class Checkpoint(Callback):
    """Saves every ``every`` rounds (and after the last one); with ``resume=True``, hands the
    loop the verified last checkpoint (see :meth:`resume_state`)."""

    def __init__(
        self, run_dir: str | Path, every: int, resume: bool = False, cfg: RunConfig | None = None
    ) -> None:
        self.run_dir = Path(run_dir)
        self.every = every
        self.resume = resume
        self.cfg = cfg
        self._dirty: set[int] = set()
        self._restored: Restored | None = None
        # the checkpoint this run wrote or resumed from: its folder and manifest files
        self._current: tuple[Path, dict[str, dict[str, Any]]] | None = None

    def verify(self, cfg: RunConfig) -> Restored:
        """Verify and load the checkpoint to resume from (cached; call it before heavy work)."""
        self.cfg = cfg
        if self._restored is None:
            self._restored = verify(self.run_dir, cfg)
            self._current = (self._restored.folder, self._restored.files)
        return self._restored

    def resume_state(self, cfg: RunConfig) -> Restored | None:
        if not self.resume:
            return None
        restored = self.verify(cfg)
        log.info("resuming from %s after round %d", restored.folder, restored.round)
        return restored

    def on_round_state(
        self,
        cfg: RunConfig,
        round_idx: int,
        participants: Sequence[int],
        executor: Executor,
        history: list[dict[str, float]],
    ) -> None:
        self.cfg = cfg
        self._dirty.update(participants)
        if self.every and (round_idx % self.every == 0 or round_idx == cfg.engine.rounds):
            self.save(round_idx, executor, history)

    def save(self, round_idx: int, executor: Executor, history: list[dict[str, float]]) -> None:
        assert self.cfg is not None, "Checkpoint.save needs the run config"
        name = f"checkpoint.r{round_idx:05d}-{os.getpid()}-{uuid.uuid4().hex[:12]}"
        with gate.Folder(self.run_dir, create=True) as top, top.sub(name, create=True) as ckpt:
            ckpt.sub("clients", create=True).close()
            folder = ckpt.path
            files: dict[str, dict[str, Any]] = {}

            def put(name: str, data: bytes) -> None:
                write_file(folder / name, data)
                files[name] = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}

            for cid, state in executor.client_states(sorted(self._dirty)):
                put(f"clients/{cid}.npz", state_bytes(state))
            if self._current is not None:
                prev_folder, prev_files = self._current
                for name, info in prev_files.items():
                    if name.startswith("clients/") and name not in files:
                        _link_or_copy(prev_folder / name, folder / name)
                        files[name] = info
            put("server.npz", state_bytes(executor.server_state()))
            put("history.json", _history_json(history))
            manifest = {
                "format": FORMAT,
                "round": round_idx,
                "config_hash": config_hash(self.cfg),
                "files": dict(sorted(files.items())),
            }
            data = json.dumps(manifest, indent=1).encode()
            write_file(folder / "manifest.json", data)
            ckpt.record("manifest.json", data)  # authenticated: what verify trusts
            os.fsync(ckpt.fd)
            # current by one atomic rename; then the folders it replaces go
            top.point(LINK, ckpt.path.name)
            for old in top.names():
                if old != ckpt.path.name and _FOLDER.match(old) or old.startswith(f".{LINK}.link-"):
                    top.remove(old)
        self._current = (folder, files)
        self._dirty.clear()
        log.debug("checkpoint after round %d in %s", round_idx, folder)


def _link_or_copy(src: Path, dst: Path) -> None:
    try:
        os.link(src, dst, follow_symlinks=False)
    except OSError:
        write_file(dst, src.read_bytes())
