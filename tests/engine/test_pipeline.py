"""Server evaluation pipelined beside the next round's clients: same rows, same order, same
checkpoints as evaluating in place."""

from __future__ import annotations

import pytest

from rayfl.config import build_config
from rayfl.engine.callbacks import Callback
from rayfl.engine.loop import Simulation


def comparable(row):
    return {k: v for k, v in row.items() if not k.startswith("time/")}


class Record(Callback):
    """What the callbacks see: rounds in order, the row complete, the states of that round."""

    def __init__(self):
        self.rounds, self.rows, self.server_states = [], [], []

    def on_round_state(self, cfg, round_idx, participants, executor, history):
        self.server_states.append(executor.server_state())

    def on_round_end(self, sim, round_idx, metrics):
        self.rounds.append(round_idx)
        self.rows.append(comparable(metrics))


def run(raw, overrides, run_dir):
    rec = Record()
    sim = Simulation(build_config(raw, overrides), run_dir, [rec])
    return sim.run().history, rec


def same_state(a, b):
    if isinstance(a, dict):
        return set(a) == set(b) and all(same_state(a[k], b[k]) for k in a)
    return (a == b).all() if hasattr(a, "all") else a == b


def check(raw, base, run_dir):
    off, rec_off = run(raw, [*base, "engine.pipeline_eval=false"], run_dir)
    on, rec_on = run(raw, [*base, "engine.pipeline_eval=true"], run_dir)
    assert "proxy/acc" in off[0] and "proxy/acc" in on[0]  # every round is scored
    assert [comparable(r) for r in off] == [comparable(r) for r in on]
    assert rec_on.rounds == rec_off.rounds == [1, 2, 3]
    assert rec_on.rows == rec_off.rows  # callbacks see complete rows
    # the checkpoint of round r holds round r's server state, not the next round's
    assert all(same_state(a, b) for a, b in zip(rec_off.server_states, rec_on.server_states))
    assert not same_state(rec_on.server_states[0], rec_on.server_states[1])
    assert all("time/eval_wait_s" in r for r in on)  # the last round's too


def test_pipelined_evaluation_gives_the_same_rows_serial(synthetic_raw, tmp_path):
    check(synthetic_raw, ["engine.rounds=3", "engine.executor=serial"], tmp_path)


@pytest.mark.slow
def test_scoring_in_place_leaves_a_server_trained_conv_model_as_it_was(synthetic_raw, tmp_path):
    # FedFD distils into its global model every round; scoring placed it channels-last when it
    # was scored in place (pipeline_eval=false), and the next rounds' sums ran in another order.
    synthetic_raw["data"]["options"] = {"num_samples": 400, "num_test": 200, "shape": [1, 16, 16]}
    synthetic_raw["data"]["public_fraction"] = 0.2
    synthetic_raw["model"] = {"architectures": ["resnet18_w1", "resnet18_w2"]}
    synthetic_raw["algorithm"] = {"name": "fedfd", "global_arch": "resnet18_w2", "steps": 3}
    base = ["engine.rounds=3", "engine.executor=serial"]
    off, _ = run(synthetic_raw, [*base, "engine.pipeline_eval=false"], tmp_path)
    on, _ = run(synthetic_raw, [*base, "engine.pipeline_eval=true"], tmp_path)
    assert all("global/acc" in r for r in off)
    assert [comparable(r) for r in off] == [comparable(r) for r in on]


@pytest.mark.ray
@pytest.mark.parametrize("server_in", ["driver", "actor"])
def test_pipelined_evaluation_gives_the_same_rows_ray(
    ray_local, synthetic_raw, server_in, tmp_path
):
    base = ["engine.rounds=3", "engine.executor=ray", "engine.num_workers=2"]
    check(synthetic_raw, [*base, f"engine.server_in={server_in}"], tmp_path)


@pytest.mark.ray
@pytest.mark.parametrize("server_in", ["driver", "actor"])
def test_the_last_round_is_scored_by_the_server_without_an_evaluation_actor(
    ray_local, synthetic_raw, server_in, tmp_path
):
    """Evaluation only after the last round: the server, idle then, scores its models while
    the clients evaluate; no evaluation actor is started for it."""
    base = ["engine.rounds=2", "engine.eval_every=2", "engine.executor=ray", "engine.num_workers=2"]
    base.append(f"engine.server_in={server_in}")
    off, _ = run(synthetic_raw, [*base, "engine.pipeline_eval=false"], tmp_path)
    sim = Simulation(build_config(synthetic_raw, [*base, "engine.pipeline_eval=true"]), tmp_path)
    on = sim.run().history
    assert [comparable(r) for r in off] == [comparable(r) for r in on]
    assert "proxy/acc" in on[-1] and "time/eval_wait_s" in on[-1]
    assert sim.executor.evaluator is None


class _Calls:
    """Records the methods called on an actor handle, in submission order."""

    def __init__(self, handle, log):
        self._handle, self._log = handle, log

    def __getattr__(self, name):
        method, log = getattr(self._handle, name), self._log

        class Method:
            def options(self, **kw):
                return Method.wrap(method.options(**kw))

            def remote(self, *a, **kw):
                return Method.wrap(method).remote(*a, **kw)

            @staticmethod
            def wrap(m):
                class Bound:
                    def remote(self, *a, **kw):
                        log.append(name)
                        return m.remote(*a, **kw)

                return Bound()

        return Method()


def record_clients_evaluate(monkeypatch, calls):
    """Append "clients evaluate" to `calls` whenever the Ray executor's evaluation phase runs."""
    from rayfl.engine.ray_executor import RayExecutor

    evaluate = RayExecutor.evaluate

    def recording_evaluate(self, *a, **kw):
        calls.append("clients evaluate")
        return evaluate(self, *a, **kw)

    monkeypatch.setattr(RayExecutor, "evaluate", recording_evaluate)


@pytest.mark.ray
def test_the_last_scoring_waits_behind_the_broadcast_not_ahead_of_it(
    ray_local, synthetic_raw, monkeypatch, tmp_path
):
    """The server runs one call at a time: its last scoring is submitted after the broadcast
    that the clients' deployed evaluation needs, so the two evaluations run side by side."""
    from rayfl.engine.ray_executor import RayExecutor

    calls: list[str] = []
    init = RayExecutor.__init__

    def recording_init(self, *a, **kw):
        init(self, *a, **kw)
        self.server = _Calls(self.server, calls)

    monkeypatch.setattr(RayExecutor, "__init__", recording_init)
    record_clients_evaluate(monkeypatch, calls)
    base = ["engine.rounds=1", "engine.executor=ray", "engine.num_workers=2"]
    history, _ = run(
        synthetic_raw, [*base, "engine.pipeline_eval=true", "engine.server_in=actor"], tmp_path
    )
    assert "proxy/acc" in history[-1]
    assert calls == ["broadcast", "step_deferred", "broadcast", "score", "clients evaluate"]


@pytest.mark.ray
def test_a_server_in_the_driver_scores_its_models_in_a_thread_beside_the_clients(
    ray_local, synthetic_raw, monkeypatch, tmp_path
):
    """In the driver, the scoring of every round but the last starts with the step (it runs
    while the next round trains); the last one's starts after the deployed evaluation's
    broadcast and runs while the clients evaluate. Neither starts an actor."""
    from rayfl.engine import ray_executor as executor_mod

    calls: list[str] = []
    score_in_driver = executor_mod.RayExecutor._score_in_driver

    def recording(self, models):
        calls.append("rayfl-score")
        return score_in_driver(self, models)

    monkeypatch.setattr(executor_mod.RayExecutor, "_score_in_driver", recording)
    record_clients_evaluate(monkeypatch, calls)
    base = ["engine.rounds=2", "engine.executor=ray", "engine.num_workers=2"]
    sim = Simulation(build_config(synthetic_raw, [*base, "engine.server_in=driver"]), tmp_path)
    history = sim.run().history
    assert all("proxy/acc" in row for row in history)
    assert calls == ["rayfl-score", "clients evaluate", "rayfl-score", "clients evaluate"]
    assert sim.executor.server is None and sim.executor.evaluator is None


class StopAfterFirst(Callback):
    def on_round_end(self, sim, round_idx, metrics):
        self.should_stop = True


def test_a_stop_during_a_pipelined_round_drops_that_round(synthetic_raw, tmp_path):
    for pipeline in ("true", "false"):
        cfg = build_config(synthetic_raw, ["engine.rounds=3", f"engine.pipeline_eval={pipeline}"])
        history = Simulation(cfg, tmp_path, [StopAfterFirst()]).run().history
        assert [r["round"] for r in history] == [1.0]
