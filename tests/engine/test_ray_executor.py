"""Ray executor: same numbers as the serial one, fractional GPU placement, worker faults."""

import pytest
import ray

from rayfl.config import build_config
from rayfl.engine.executor import RayExecutor
from rayfl.engine.loop import Simulation, make_spec, prepare_federation
from rayfl.errors import UserError
from rayfl.models.families import family_from_config

pytestmark = pytest.mark.ray


def comparable(row):
    return {k: v for k, v in row.items() if not k.startswith("time/")}


def history(raw, overrides):
    return Simulation(build_config(raw, overrides), "/tmp/unused").run().history


def test_ray_equals_serial_whatever_the_worker_count(ray_local, synthetic_raw):
    serial = history(synthetic_raw, ["engine.executor=serial"])
    one = history(
        synthetic_raw, ["engine.executor=ray", "engine.num_workers=1", "engine.clients_per_call=4"]
    )
    two = history(
        synthetic_raw, ["engine.executor=ray", "engine.num_workers=2", "engine.clients_per_call=1"]
    )
    assert "pfedes/kl_local_proxy" in serial[-1] and "personal/acc_mean" in serial[-1]
    assert (
        [comparable(r) for r in serial]
        == [comparable(r) for r in one]
        == [comparable(r) for r in two]
    )


@pytest.mark.parametrize("protocol", ["deployed", "after_fit"])
def test_each_protocol_gives_ray_the_serial_numbers_with_partial_participation(
    ray_local, synthetic_raw, protocol
):
    # 3 of 6 clients a round: `deployed` also scores the three that did not train (one of them
    # never trained yet in round 1), on the workers, batched per call.
    common = ["engine.clients_per_round=3", f"eval.protocol={protocol}"]
    serial = history(synthetic_raw, [*common, "engine.executor=serial"])
    one = history(
        synthetic_raw,
        [*common, "engine.executor=ray", "engine.num_workers=1", "engine.clients_per_call=4"],
    )
    two = history(
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


def test_a_dead_worker_is_replaced_and_its_clients_rerun(ray_local, synthetic_raw):
    expected = history(synthetic_raw, ["engine.executor=serial", "engine.rounds=1"])
    ex, archs = executor(
        synthetic_raw, ["engine.executor=ray", "engine.num_workers=2", "engine.rounds=1"]
    )
    try:
        ray.kill(ex.workers[0])
        clients = list(range(6))
        sizes, payloads = ex.broadcast(1, sorted(set(archs)))
        rows, replies = ex.fit(1, clients, payloads, evaluate=True)
        assert sorted(r["client"] for r in rows) == clients
        by_client = {r["client"]: r for r in rows}
        server = ex.server_step(1, replies, evaluate=True)
        assert server["proxy/acc"] == expected[0]["proxy/acc"]
        assert len(by_client) == 6
    finally:
        ex.close()


FEDFD = {  # the server distils into its global model (threads beside the driver's training)
    "data": {"options": {"num_samples": 400, "num_test": 200, "shape": [1, 16, 16]}},
    "model": {"architectures": ["resnet18_w1", "resnet18_w2"]},
    "algorithm": {"name": "fedfd", "global_arch": "resnet18_w2", "steps": 3},
}


@pytest.mark.parametrize("algorithm", ["pfedes", "fedfd"])
def test_the_driver_training_beside_the_actors_gives_the_serial_numbers(
    ray_local, synthetic_raw, algorithm
):
    # engine.driver_trains: the driver's own worker takes clients from the queue the actors
    # take their batches from (one client per call, so both train every round); pipelined scoring of the
    # server's models (a driver thread) runs beside the driver's training in every round.
    if algorithm == "fedfd":
        synthetic_raw["data"].update(FEDFD["data"], public_fraction=0.2)
        synthetic_raw["model"] = FEDFD["model"]
        synthetic_raw["algorithm"] = FEDFD["algorithm"]
    common = ["engine.eval_every=1", "engine.rounds=3", "engine.clients_per_call=1"]
    serial = history(synthetic_raw, [*common, "engine.executor=serial"])
    forced = [*common, "engine.executor=ray", "engine.driver_trains=true"]
    two = history(synthetic_raw, [*forced, "engine.num_workers=2"])
    # the driver takes single clients out of the actors' batches of 3
    split = history(synthetic_raw, [*forced, "engine.num_workers=2", "engine.clients_per_call=3"])
    alone = history(synthetic_raw, [*forced, "engine.num_workers=1"])  # no actor at all
    off = history(
        synthetic_raw,
        [*common, "engine.executor=ray", "engine.num_workers=2", "engine.driver_trains=false"],
    )
    assert (
        [comparable(r) for r in serial]
        == [comparable(r) for r in two]
        == [comparable(r) for r in split]
        == [comparable(r) for r in alone]
        == [comparable(r) for r in off]
    )


def test_a_driver_that_trains_starts_one_actor_fewer_and_reruns_a_dead_ones_clients(
    ray_local, synthetic_raw
):
    expected = history(synthetic_raw, ["engine.executor=serial", "engine.rounds=1"])
    ex, archs = executor(
        synthetic_raw,
        [
            "engine.executor=ray",
            "engine.num_workers=3",
            "engine.worker_resources.num_cpus=0.5",  # the session's Ray has 2 CPUs
            "engine.driver_trains=true",
            "engine.clients_per_call=1",
            "engine.rounds=1",
        ],
    )
    try:
        assert ex.num_workers == 3 and len(ex.workers) == 2 and ex.driver is not None
        ray.kill(ex.workers[0])  # dies before the first round: its clients go to a new actor
        clients = list(range(6))
        sizes, payloads = ex.broadcast(1, sorted(set(archs)))
        rows, replies = ex.fit(1, clients, payloads, evaluate=True)
        assert sorted(r["client"] for r in rows) == clients
        server = ex.server_step(1, replies, evaluate=True)
        assert server["proxy/acc"] == expected[0]["proxy/acc"]
        evaluated = ex.evaluate(1, clients, ex.broadcast(1, sorted(set(archs)))[1])
        assert sorted(r["client"] for r in evaluated) == clients
    finally:
        ex.close()


def test_an_actors_failure_ends_the_round_while_the_driver_trains(ray_local, synthetic_raw):
    # The actors' lane runs in a thread beside the driver's training: its error reaches the caller.
    ex, archs = executor(
        synthetic_raw,
        [
            "engine.executor=ray",
            "engine.num_workers=2",
            "engine.driver_trains=true",
            "engine.clients_per_call=1",
            "engine.max_retries=0",
        ],
    )
    try:
        ex.worker_info()  # the actor has started: it dies in its first call
        ray.kill(ex.workers[0])
        sizes, payloads = ex.broadcast(1, sorted(set(archs)))
        with pytest.raises(UserError, match=r"failed 1 times \(worker died\)"):
            ex.fit(1, list(range(6)), payloads, evaluate=False)
    finally:
        ex.close()


def test_the_round_queue_gives_the_driver_single_clients_and_the_actors_what_is_left():
    from rayfl.engine.executor import _Queue

    queue = _Queue([[5, 3], [4, 1], [2]])
    assert queue.take(1) == [5]
    assert queue.take() == [3]  # an actor's call: the rest of the front batch
    assert queue.take(1) == [4]
    queue.put_back([7, 8])  # a dead actor's batch runs next
    assert queue.take() == [7, 8]
    assert queue.take(None) == [1]
    assert queue.take(1) == [2]
    assert queue.take() is None and queue.take(1) is None
