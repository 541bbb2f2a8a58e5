"""The same run on a three-node Ray cluster (head + 2 nodes, 1 CPU each, one machine).

Workers must land on distinct nodes, receive the data through the object store and produce the
serial executor's history exactly. This test starts and stops its own cluster, so it must not
overlap the session's shared local Ray (tests/conftest.py orders it last and it shuts that down).
"""

from __future__ import annotations

import copy
from typing import Any

import pytest

from rayfl.config import build_config
from rayfl.engine.callbacks import Callback
from rayfl.engine.loop import Simulation


class _WorkerInfo(Callback):
    """Records where the Ray executor's workers run (before the loop closes the executor)."""

    def __init__(self) -> None:
        self.info: list[dict[str, Any]] = []

    def on_round_end(self, sim: Simulation, round_idx: int, metrics: dict[str, float]) -> None:
        self.info = sim.executor.worker_info()  # type: ignore[union-attr]


def _comparable(history: list[dict[str, float]]) -> list[dict[str, float]]:
    return [{k: v for k, v in row.items() if not k.startswith("time/")} for row in history]


@pytest.mark.ray
def test_workers_spread_over_nodes_and_match_the_serial_history(tmp_path, synthetic_raw) -> None:
    import ray
    from ray.cluster_utils import Cluster

    raw = copy.deepcopy(synthetic_raw)  # synthetic 8x8 data, family tiny2, 6 clients, 2 rounds
    serial = Simulation(build_config(raw), tmp_path / "serial").run()

    if ray.is_initialized():
        ray.shutdown()  # a cluster of our own; the session's local Ray must not be connected
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1})
    try:
        for _ in range(2):
            cluster.add_node(num_cpus=1)
        cluster.wait_for_nodes()
        cfg = build_config(
            raw,
            [
                "engine.executor=ray",
                f"engine.address={cluster.address}",
                "engine.num_workers=2",
                "engine.clients_per_call=3",  # 6 clients: one batch per worker each round
                "engine.worker_resources.num_cpus=1",
            ],
        )
        probe = _WorkerInfo()
        distributed = Simulation(cfg, tmp_path / "cluster", callbacks=[probe]).run()
        assert not ray.is_initialized()  # the executor disconnects the Ray it joined
    finally:
        if ray.is_initialized():
            ray.shutdown()
        cluster.shutdown()

    nodes = {w["node_id"] for w in probe.info}
    assert len(probe.info) == 2 and len(nodes) == 2
    assert distributed.status == serial.status == "FINISHED"
    assert len(distributed.history) == 2
    assert _comparable(distributed.history) == _comparable(serial.history)
    assert distributed.final["personal/acc"] == serial.final["personal/acc"]
