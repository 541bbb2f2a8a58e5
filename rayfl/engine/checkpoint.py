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

A run directory is untrusted (docs/security.md): the link must name a real checkpoint folder
of the run directory, every file is read through :mod:`rayfl.safefile` (no symlink followed,
sizes bounded before reading, JSON depth bounded, ``.npz`` headers checked against their bytes),
and the loaded states are checked against the freshly built model before any is used
(:meth:`Restored.check_server`, :meth:`Restored.client_states`).
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import re
import shutil
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

import numpy as np

from rayfl.engine.hooks import Callback
from rayfl.errors import UserError
from rayfl.safefile import (
    JSON_LIMIT,
    STATE_LIMIT,
    UnsafeFile,
    check_npz,
    loads_json,
    open_npz,
    read_bytes,
    real_dir,
    unique_suffix,
)
from rayfl.schema import RunConfig, to_dict

if TYPE_CHECKING:
    from rayfl.engine.executor import Executor
    from rayfl.engine.spec import RunSpec

log = logging.getLogger(__name__)

FORMAT = "rayfl-checkpoint/1"
LINK = "checkpoint"
_FOLDER = re.compile(r"^checkpoint\.r\d{5,}-[0-9]+-[0-9a-f]+$")
_FILE = re.compile(r"^(server\.npz|history\.json|clients/[0-9]+\.npz)$")
_TREE = "__tree__"
# engine settings that change where and how fast a run goes, never its numbers: a resume may
# change them (and tracking, name); everything else must match the checkpoint's config hash.
_RESULT_ENGINE_KEYS = ("fraction", "clients_per_round", "sampling", "eval_every", "min_replies")


def config_hash(cfg: RunConfig) -> str:
    """sha256 of the settings that determine a run's numbers (everything but engine placement,
    engine.rounds, checkpointing, tracking and the name)."""
    d = to_dict(cfg)
    engine = d.pop("engine")
    for key in ("tracking", "name"):
        d.pop(key, None)
    d["engine"] = {k: engine[k] for k in _RESULT_ENGINE_KEYS if k in engine}
    text = json.dumps(d, sort_keys=True, default=str)
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
    """Write and fsync one checkpoint file (a separate function so tests can interrupt it)."""
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def state_bytes(state: Any) -> bytes:
    """A state as the bytes of an ``.npz`` file (arrays plus the JSON tree as uint8)."""
    import io

    tree, arrays = encode_state(state)
    buf = io.BytesIO()
    meta = np.frombuffer(json.dumps(tree, allow_nan=False).encode(), dtype=np.uint8)
    np.savez(buf, **{_TREE: meta}, **arrays)  # type: ignore[arg-type]
    return buf.getvalue()


def load_state(path: Path | IO[bytes]) -> Any:
    """Read a state written by :func:`state_bytes` (a path or a binary file); never unpickles."""
    if isinstance(path, Path | str):
        return state_from_bytes(read_bytes(Path(path), STATE_LIMIT), Path(path))
    return state_from_bytes(path.read(), Path("<state>"))


def state_from_bytes(data: bytes, path: Path) -> Any:
    """A state from the bytes of its ``.npz`` file (see :func:`rayfl.safefile.open_npz`)."""
    with open_npz(data, path) as z:
        if _TREE not in z.files:
            raise ValueError("no state tree")
        tree = loads_json(bytes(z[_TREE]), path)
        arrays = {k: z[k] for k in z.files if k != _TREE}
    return decode_state(tree, arrays)


def _history_json(history: list[dict[str, float]]) -> bytes:
    # Strict JSON: non-finite values as strings ("nan", "inf", "-inf") that float() reads back.
    rows = [
        {k: (v if not isinstance(v, float) or math.isfinite(v) else repr(v)) for k, v in r.items()}
        for r in history
    ]
    return json.dumps(rows, allow_nan=False).encode()


def _read_history(data: bytes, path: Path) -> list[dict[str, float]]:
    rows = loads_json(data, path, depth=2)
    return [{str(k): float(v) for k, v in r.items()} for r in rows]


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


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

    def client_states(
        self, template: Callable[[int], Any] | None = None
    ) -> Iterator[tuple[int, Any]]:
        """Yield ``(client id, state)`` one at a time, each read again and its checksum checked
        (the folder may have changed since :func:`verify`); with ``template`` (client id -> the
        state of that client's fresh model, see :func:`client_templates`) each is checked
        against it first (:func:`state_mismatch`).

        Raises:
            UserError: a changed file or a state unlike its template, in one line.
        """
        for cid in self.client_ids():
            path = self.folder / "clients" / f"{cid}.npz"
            state = _load_verified(path, self.files[f"clients/{cid}.npz"])
            if template is not None:
                expected = template(cid)
                self._check(
                    f"client {cid} is not a client of this run"
                    if expected is None
                    else state_mismatch(state, expected, f"client {cid}")
                )
            yield cid, state

    def check_server(self, template: Any) -> None:
        """Check the server state against ``template``, the state of the server this run built
        fresh from the user's config (same keys, array shapes and dtypes), before it is used.

        Raises:
            UserError: the first mismatch, in one line.
        """
        self._check(state_mismatch(self.server_state, template, "server"))

    def _check(self, problem: str) -> None:
        if problem:
            raise _refuse(
                self.folder, f"{problem}, unlike the model this config builds (not this run's)"
            )


def client_templates(spec: RunSpec) -> Callable[[int], Any]:
    """Client id -> the state of a fresh client of its architecture built from ``spec`` (the
    user's config), with the local-only shadow's part under ``baseline/`` and the no-federation
    control's under ``control/`` when the run keeps them: what :meth:`Restored.client_states` compares each restored client state with. One model is
    built per architecture, on the CPU."""
    import torch

    from rayfl.algorithms import ALGORITHMS
    from rayfl.engine.worker import BASELINE, CONTROL, CONTROL_ACC

    cache: dict[str, Any] = {}

    def template(cid: int) -> Any:
        arch = spec.archs[cid] if 0 <= cid < len(spec.archs) else None
        if arch is None:
            return None  # a client this run does not have: refused as a mismatch
        if arch not in cache:
            ctx = spec.client_context(arch, torch.device("cpu"))
            state = dict(spec.algo.client(ctx, spec.params).state_dict())
            if spec.local_baseline:
                local = ALGORITHMS.get("local")
                shadow = local.client(ctx, local.params()).state_dict()
                state.update({BASELINE + k: v for k, v in shadow.items()})
            if spec.federation_control:
                control = spec.algo.client(ctx, spec.params).state_dict()
                state.update({CONTROL + k: v for k, v in control.items()})
                state[CONTROL_ACC] = np.array(0.0, dtype=np.float64)
            cache[arch] = state
        return cache[arch]

    return template


def state_mismatch(state: Any, template: Any, where: str) -> str:
    """Where ``state`` differs from ``template`` in structure, array shape or dtype ('' if
    nowhere). Dict keys, list lengths and arrays must match; scalars need the same type; what
    the fresh model leaves empty (None, an empty dict) cannot be compared and is accepted."""
    if isinstance(template, np.ndarray | np.generic):
        if not isinstance(state, np.ndarray | np.generic):
            return f"{where} is not an array"
        if state.shape != template.shape or state.dtype != template.dtype:
            return (
                f"{where} is {state.dtype}{list(state.shape)}, the model's "
                f"{template.dtype}{list(template.shape)}"
            )
        return ""
    if isinstance(template, dict):
        if not template:  # filled as the run goes (a prototype table): nothing to compare yet
            return "" if isinstance(state, dict) else f"{where} is not a mapping"
        if not isinstance(state, dict) or set(state) != set(template):
            return f"{where} has other keys"
        for key, value in template.items():
            problem = state_mismatch(state[key], value, f"{where}.{key}")
            if problem:
                return problem
        return ""
    if isinstance(template, list | tuple):
        if not isinstance(state, list | tuple) or len(state) != len(template):
            return f"{where} has another length"
        for i, (a, b) in enumerate(zip(state, template)):
            problem = state_mismatch(a, b, f"{where}[{i}]")
            if problem:
                return problem
        return ""
    if template is not None and state is not None and type(state) is not type(template):
        return f"{where} is a {type(state).__name__}, not a {type(template).__name__}"
    return ""


def _refuse(ckpt: Path, problem: str) -> UserError:
    return UserError(
        f"cannot resume from {ckpt}: {problem}; the run directory was changed or written by "
        "something else. Start a new run (rayfl run CONFIG --out NEW_DIR)"
    )


def _load_verified(path: Path, info: dict[str, Any]) -> Any:
    try:
        data = read_bytes(path, int(info["bytes"]))
    except FileNotFoundError:
        raise _refuse(path, "it is missing") from None
    if hashlib.sha256(data).hexdigest() != info.get("sha256"):
        raise _refuse(path, "it is truncated or changed (checksum mismatch)")
    try:
        return state_from_bytes(data, path)
    except UnsafeFile:
        raise
    except (ValueError, TypeError, KeyError, OverflowError, RecursionError) as exc:
        # a file that passed its checksum but does not parse
        raise _refuse(path, f"unreadable state file ({type(exc).__name__})") from None


def has_checkpoint(run_dir: Path) -> bool:
    """Whether ``run_dir`` has a current checkpoint to resume from (not yet verified)."""
    return (Path(run_dir) / LINK).is_symlink()


def verify(run_dir: Path, cfg: RunConfig) -> Restored:
    """Check the current checkpoint of ``run_dir`` against its manifest and ``cfg`` and load it.

    Raises:
        UserError: no checkpoint, an old (pickle) checkpoint, a torn, truncated, foreign or
            mismatched one; one line each.
    """
    link = run_dir / LINK
    if not link.is_symlink():
        if link.is_dir() and (link / "server.pkl").exists():
            raise UserError(
                f"cannot resume from {link}: it was written by an older rayfl that stored the "
                "server with pickle, which rayfl no longer loads; start a new run"
            )
        if link.exists():
            raise _refuse(link, "it is not a checkpoint link")
        raise UserError(
            f"no checkpoint in {run_dir}: --resume needs a run directory written by "
            "`rayfl run --out` with engine.checkpoint_every > 0 that finished at least one round"
        )
    target = os.readlink(link)
    if not _FOLDER.match(target):
        raise _refuse(link, f"it points outside the run directory ({target!r})")
    folder = real_dir(run_dir / target, inside=run_dir)
    try:
        manifest = loads_json(
            read_bytes(folder / "manifest.json", JSON_LIMIT), folder / "manifest.json", depth=3
        )
    except FileNotFoundError:
        raise _refuse(folder, "manifest.json is missing") from None
    except UnsafeFile as exc:
        if "not valid JSON" not in str(exc):
            raise
        raise _refuse(folder, "manifest.json is unreadable or truncated") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise _refuse(folder, f"manifest.json is not a {FORMAT} manifest")
    rnd, files = manifest.get("round"), manifest.get("files")
    if isinstance(rnd, bool) or not isinstance(rnd, int) or not 1 <= rnd <= 10**7:
        raise _refuse(folder, f"manifest.json has no valid round ({rnd!r})")
    if not isinstance(files, dict):
        raise _refuse(folder, "manifest.json lacks the file list")
    if manifest.get("config_hash") != config_hash(cfg):
        raise UserError(
            f"cannot resume from {folder}: the checkpoint was written with other settings "
            "(seed, data, model, algorithm, train or sampling differ from this run's config); "
            "resume with the run directory's own config.yaml, or start a new run"
        )
    for name in ("server.npz", "history.json"):
        if name not in files:
            raise _refuse(folder, f"the manifest does not list {name}")
    if any(name.startswith("clients/") for name in files):
        real_dir(folder / "clients", inside=folder)
    for name, info in files.items():
        if not _FILE.match(name) or not isinstance(info, dict):
            raise _refuse(folder, f"the manifest lists an unexpected file {name!r}")
        size = info.get("bytes")
        if isinstance(size, bool) or not isinstance(size, int) or not 0 <= size <= STATE_LIMIT:
            raise _refuse(folder, f"the manifest gives {name} an invalid size ({size!r})")
        try:
            data = read_bytes(folder / name, size)
        except FileNotFoundError:
            raise _refuse(folder, f"{name} is missing") from None
        except UnsafeFile as exc:
            if "over the limit" not in str(exc):
                raise
            data = b""
        if len(data) != size or hashlib.sha256(data).hexdigest() != info.get("sha256"):
            raise _refuse(folder, f"{name} is truncated or changed (checksum mismatch)")
        if name.endswith(".npz"):
            check_npz(data, folder / name)  # every state's headers, before Ray or any model
    try:
        history = _read_history(
            read_bytes(folder / "history.json", files["history.json"]["bytes"]),
            folder / "history.json",
        )
    except (ValueError, TypeError, AttributeError, UnsafeFile):
        raise _refuse(folder, "history.json is malformed") from None
    if [r.get("round", -1) for r in history] != list(range(1, rnd + 1)):
        raise _refuse(folder, f"history.json does not hold rounds 1..{rnd}")
    server = _load_verified(folder / "server.npz", files["server.npz"])
    return Restored(round=rnd, history=history, server_state=server, folder=folder, files=files)


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
        self.run_dir.mkdir(parents=True, exist_ok=True)
        folder = self.run_dir / f"checkpoint.r{round_idx:05d}-{unique_suffix()}"
        (folder / "clients").mkdir(parents=True)
        files: dict[str, dict[str, Any]] = {}

        def put(name: str, data: bytes) -> None:
            write_file(folder / name, data)
            files[name] = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}

        written = set()
        for cid, state in executor.client_states(sorted(self._dirty)):
            put(f"clients/{cid}.npz", state_bytes(state))
            written.add(cid)
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
        write_file(folder / "manifest.json", json.dumps(manifest, indent=1).encode())
        _fsync_dir(folder / "clients")
        _fsync_dir(folder)
        self._swap(folder)
        self._current = (folder, files)
        self._dirty.clear()
        log.debug("checkpoint after round %d in %s", round_idx, folder)

    def _swap(self, folder: Path) -> None:
        """Make ``folder`` current by one atomic rename, then remove the folders it replaces."""
        link = self.run_dir / LINK
        if link.is_dir() and not link.is_symlink():
            # a checkpoint folder of an older rayfl: keep it aside rather than delete it
            link.rename(self.run_dir / f"checkpoint.legacy-{unique_suffix()}")
        tmp = self.run_dir / f".checkpoint.link-{unique_suffix()}"
        os.symlink(folder.name, tmp)
        os.replace(tmp, link)
        _fsync_dir(self.run_dir)
        for old in self.run_dir.glob("checkpoint.r*"):
            if old.name != folder.name and _FOLDER.match(old.name):
                shutil.rmtree(old, ignore_errors=True)
        for old in self.run_dir.glob(".checkpoint.link-*"):
            old.unlink(missing_ok=True)


def _link_or_copy(src: Path, dst: Path) -> None:
    try:
        os.link(src, dst, follow_symlinks=False)
    except OSError:
        shutil.copy2(src, dst, follow_symlinks=False)
