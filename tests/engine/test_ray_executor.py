"""Ray executor: same numbers as the serial one, fractional GPU placement, worker faults."""

import threading

import pytest
import ray

from rayfl.config import build_config
from rayfl.engine.loop import Simulation, make_spec, prepare_federation
from rayfl.engine.ray_executor import RayExecutor
from rayfl.errors import UserError
from rayfl.models.families import family_from_config

pytestmark = pytest.mark.ray


def comparable(row):
    return {k: v for k, v in row.items() if not k.startswith("time/")}


def history(run_dir, raw, overrides):
    return Simulation(build_config(raw, overrides), run_dir).run().history


def test_ray_equals_serial_whatever_the_worker_count(ray_local, synthetic_raw, tmp_path):
    serial = history(tmp_path, synthetic_raw, ["engine.executor=serial"])
    one = history(
        tmp_path,
        synthetic_raw,
        ["engine.executor=ray", "engine.num_workers=1", "engine.clients_per_call=4"],
    )
    two = history(
        tmp_path,
        synthetic_raw,
        ["engine.executor=ray", "engine.num_workers=2", "engine.clients_per_call=1"],
    )
    assert "pfedes/kl_local_proxy" in serial[-1] and "personal/acc_mean" in serial[-1]
    assert (
        [comparable(r) for r in serial]
        == [comparable(r) for r in one]
        == [comparable(r) for r in two]
    )


@pytest.mark.parametrize("protocol", ["deployed", "after_fit"])
def test_each_protocol_gives_ray_the_serial_numbers_with_partial_participation(
    ray_local, synthetic_raw, protocol, tmp_path
):
    # 3 of 6 clients a round: `deployed` also scores the three that did not train (one of them
    # never trained yet in round 1), on the workers, batched per call.
    common = ["engine.clients_per_round=3", f"eval.protocol={protocol}"]
    serial = history(tmp_path, synthetic_raw, [*common, "engine.executor=serial"])
    one = history(
        tmp_path,
        synthetic_raw,
        [*common, "engine.executor=ray", "engine.num_workers=1", "engine.clients_per_call=4"],
    )
    two = history(
        tmp_path,
        synthetic_raw,
        [*common, "engine.executor=ray", "engine.num_workers=2", "engine.clients_per_call=1"],
    )
    assert ("eval/clients" in serial[-1]) == (protocol == "deployed")
    assert (
        [comparable(r) for r in serial]
        == [comparable(r) for r in one]
        == [comparable(r) for r in two]
    )


def executor(raw, overrides):
    cfg = build_config(raw, overrides)
    fed = prepare_federation(cfg)
    archs = family_from_config(cfg.model.family).assign(cfg.data.num_clients)
    return RayExecutor(make_spec(cfg, archs, fed), fed), archs


def test_four_workers_share_one_gpu(ray_local, synthetic_raw):
    # The session's Ray has one *logical* GPU: placement is tested without touching CUDA.
    ex, _ = executor(
        synthetic_raw,
        [
            "engine.executor=ray",
            "engine.num_workers=4",
            "engine.worker_resources={num_cpus: 0.25, num_gpus: 0.25}",
        ],
    )
    try:
        infos = ex.worker_info()
        assert len(infos) == 4
        assert all(i["gpu_ids"] == ["0"] for i in infos)
        assert all(i["cuda_visible_devices"] == "0" for i in infos)
        assert len({i["pid"] for i in infos}) == 4
    finally:
        ex.close()


def test_impossible_resources_are_a_clear_error(ray_local, synthetic_raw):
    with pytest.raises(UserError, match="engine.worker_resources asks for 1.0 CPU / 2.0 GPU"):
        executor(
            synthetic_raw,
            ["engine.executor=ray", "engine.worker_resources={num_cpus: 1, num_gpus: 2}"],
        )


def test_a_worker_killed_during_the_round_is_restarted_by_ray_with_the_serial_numbers(
    ray_local, synthetic_raw, tmp_path
):
    # Ray restarts the worker (max_restarts) and re-runs its call (max_task_retries); the
    # restarted process sets itself up from the call's `setup` and gets the same client states.
    expected = history(tmp_path, synthetic_raw, ["engine.executor=serial", "engine.rounds=1"])
    ex, archs = executor(
        synthetic_raw,
        [
            "engine.executor=ray",
            "engine.num_workers=2",
            "engine.rounds=1",
            "engine.clients_per_call=3",
        ],
    )
    try:
        before = ex.worker_info()[0]["pid"]
        killer = threading.Timer(0.3, lambda: ray.kill(ex.workers[0], no_restart=False))
        killer.start()
        clients = list(range(6))
        sizes, payloads = ex.broadcast(1, sorted(set(archs)))
        rows, replies = ex.fit(1, clients, payloads, evaluate=True)
        killer.join()
        assert sorted(r["client"] for r in rows) == clients
        server = ex.server_step(1, replies, evaluate=True)
        assert server["proxy/acc"] == expected[0]["proxy/acc"]
        assert ex.worker_info()[0]["pid"] != before  # it really died and came back
    finally:
        ex.close()


def test_a_worker_that_dies_more_often_than_ray_reruns_a_call_is_one_line(ray_local, synthetic_raw):
    ex, archs = executor(
        synthetic_raw,
        ["engine.executor=ray", "engine.num_workers=1", "engine.max_retries=0"],
    )
    try:
        ex.worker_info()  # started; then dead for good
        ray.kill(ex.workers[0], no_restart=True)
        sizes, payloads = ex.broadcast(1, sorted(set(archs)))
        with pytest.raises(UserError, match=r"their worker died 1 times") as err:
            ex.fit(1, list(range(6)), payloads, evaluate=False)
        assert "\n" not in str(err.value) and "engine.max_retries" in str(err.value)
    finally:
        ex.close()
