"""`rayfl run` on a joined cluster waits for the autoscaler instead of failing at once: a node
with a GPU joins a running `ray.cluster_utils.Cluster` while the run is waiting for it.

Starts its own cluster, so (like test_multinode.py) it must not overlap the session's local Ray:
tests/conftest.py orders tests whose id contains "multinode" last."""

from __future__ import annotations

import logging
import threading
import time

import pytest

from rayfl.config import build_config
from rayfl.engine.pool import plan_workers
from rayfl.errors import UserError


@pytest.mark.ray
def test_plan_workers_waits_for_a_node_that_joins_later(synthetic_raw, caplog) -> None:
    import ray
    from ray.cluster_utils import Cluster

    if ray.is_initialized():
        ray.shutdown()  # a cluster of our own; the session's local Ray must not be connected
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1})
    try:
        ray.init(address=cluster.address, include_dashboard=False, configure_logging=False)
        gpu_workers = [
            "engine.executor=ray",
            f"engine.address={cluster.address}",
            "engine.worker_resources.num_gpus=0.5",
            "engine.worker_resources.num_cpus=0.5",
        ]
        # nothing comes: one line naming the setting, after the timeout
        quick = build_config(synthetic_raw, [*gpu_workers, "engine.wait_for_resources_s=1"])
        with pytest.raises(UserError, match="engine.wait_for_resources_s=1"):
            plan_workers(quick.engine, per_round=6)

        cfg = build_config(synthetic_raw, [*gpu_workers, "engine.wait_for_resources_s=60"])
        result: dict[str, object] = {}

        def plan() -> None:
            try:
                result["workers"] = plan_workers(cfg.engine, per_round=6)
            except Exception as exc:  # surfaced by the assertion below
                result["error"] = exc

        with caplog.at_level(logging.WARNING, logger="rayfl.engine.executor"):
            waiter = threading.Thread(target=plan)
            waiter.start()
            time.sleep(2.0)
            assert waiter.is_alive(), result  # still waiting: no GPU yet
            cluster.add_node(num_cpus=1, num_gpus=1)  # what the autoscaler would do
            waiter.join(timeout=60)
        assert not waiter.is_alive()
        assert result.get("workers") == 2, result  # 1 GPU / 0.5 per worker
        text = caplog.text
        assert "asked the autoscaler" in text and "engine.wait_for_resources_s" in text
        assert "resources arrived" in text
    finally:
        if ray.is_initialized():
            ray.shutdown()
        cluster.shutdown()
