"""Checkpoints in the run directory, so nothing a user started is lost on a crash.

Layout: `checkpoint/meta.json` (last finished round, metric history), `checkpoint/server.pkl`,
`checkpoint/clients/<id>.npz` (one file per client, rewritten only when that client trained, so a
round costs the writes of its participants, streamed one state at a time).
"""

from __future__ import annotations

import json
import logging
import pickle
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from rayfl.engine.callbacks import Callback
from rayfl.errors import UserError

if TYPE_CHECKING:
    from rayfl.engine.loop import Simulation

log = logging.getLogger(__name__)


def _atomic_write(path: Path, data: bytes) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(data)
    tmp.replace(path)


class Checkpoint(Callback):
    """Saves every `every` rounds; with `resume=True`, restores the last checkpoint before round one."""

    def __init__(self, run_dir: str | Path, every: int, resume: bool = False) -> None:
        self.dir = Path(run_dir) / "checkpoint"
        self.every = every
        self.resume = resume
        self._dirty: set[int] = set()

    def on_run_start(self, sim: Simulation) -> None:
        if self.resume:
            restore(sim, self.dir)

    def on_round_end(self, sim: Simulation, round_idx: int, metrics: dict[str, float]) -> None:
        self._dirty.update(sim.last_clients)
        if self.every and (round_idx % self.every == 0 or round_idx == sim.cfg.engine.rounds):
            self.save(sim, round_idx)

    def save(self, sim: Simulation, round_idx: int) -> None:
        assert sim.executor is not None
        clients_dir = self.dir / "clients"
        clients_dir.mkdir(parents=True, exist_ok=True)
        for cid, state in sim.executor.client_states(sorted(self._dirty)):
            tmp = clients_dir / f"{cid}.tmp.npz"
            np.savez(tmp, **state)  # type: ignore[arg-type]
            tmp.replace(clients_dir / f"{cid}.npz")
        self._dirty.clear()
        _atomic_write(
            self.dir / "server.pkl", pickle.dumps(sim.executor.server_state(), protocol=5)
        )
        meta = {"round": round_idx, "history": sim.result.history}
        _atomic_write(self.dir / "meta.json", json.dumps(meta).encode())
        log.debug("checkpoint after round %d in %s", round_idx, self.dir)


def restore(sim: Simulation, ckpt_dir: Path) -> None:
    """Load server and client states and the history; the loop continues after the saved round."""
    meta_path = ckpt_dir / "meta.json"
    if not meta_path.exists():
        raise UserError(
            f"no checkpoint in {ckpt_dir}: --resume needs a run directory written by `rayfl run --out`"
        )
    meta = json.loads(meta_path.read_text())
    assert sim.executor is not None
    sim.executor.load_server_state(pickle.loads((ckpt_dir / "server.pkl").read_bytes()))
    for path in sorted((ckpt_dir / "clients").glob("*.npz")):
        if ".tmp" in path.name:
            continue
        with np.load(path) as data:
            sim.executor.load_client_state(int(path.stem), {k: data[k] for k in data.files})
    sim.result.history = list(meta["history"])
    sim.start_round = int(meta["round"]) + 1
    log.info("resumed from %s after round %d", ckpt_dir, meta["round"])
