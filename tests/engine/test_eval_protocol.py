"""The evaluation phase (`eval.protocol`): deployed models of every client vs after-fit scores."""

import numpy as np
import pytest

from rayfl.config import build_config
from rayfl.engine.loop import Simulation, summarize_clients
from rayfl.errors import ConfigError


def simulate(run_dir, raw, overrides=()):
    sim = Simulation(build_config(raw, list(overrides)), run_dir)
    result = sim.run()
    return sim, result.history


def test_deployed_scores_every_client_including_non_participants(synthetic_raw, tmp_path):
    # 2 of 6 clients per round: most clients are scored without having trained this round,
    # and some (never sampled yet in round 1) with their initial weights.
    sim, history = simulate(tmp_path, synthetic_raw, ["engine.clients_per_round=2"])
    assert [row["clients"] for row in history] == [2.0, 2.0]
    assert [row["eval/clients"] for row in history] == [6.0, 6.0]
    for row in history:
        assert 0.0 <= row["personal/acc"] <= 1.0
        assert "pfedes/kl_local_proxy" in row and "pfedes/proxy_acc" in row


def test_after_fit_scores_the_participants_only(synthetic_raw, tmp_path):
    _, history = simulate(
        tmp_path, synthetic_raw, ["engine.clients_per_round=2", "eval.protocol=after_fit"]
    )
    assert all("eval/clients" not in row for row in history)
    assert all(0.0 <= row["personal/acc"] <= 1.0 for row in history)


def test_evaluation_changes_no_state(synthetic_raw, tmp_path):
    # Whatever the protocol, training follows the same trajectory: the server's proxy scores
    # and the training losses are bit for bit the same; only what is scored differs.
    overrides = ["engine.clients_per_round=3", "engine.rounds=3"]
    _, deployed = simulate(tmp_path, synthetic_raw, overrides)
    _, after_fit = simulate(tmp_path, synthetic_raw, [*overrides, "eval.protocol=after_fit"])
    for a, b in zip(deployed, after_fit):
        assert a["proxy/acc"] == b["proxy/acc"]
        assert a["train/loss"] == b["train/loss"]
    assert [r["personal/acc"] for r in deployed] != [r["personal/acc"] for r in after_fit]


def test_deployed_lg_fedavg_scores_the_received_head(synthetic_raw, tmp_path):
    # Full participation, deployed: every client's head is the new global head, so two clients'
    # deployed models agree on the head's parameters; after_fit scores the locally trained head.
    synthetic_raw["algorithm"] = {"name": "lg_fedavg"}
    synthetic_raw["model"] = {"family": "tiny2"}
    sim, history = simulate(tmp_path, synthetic_raw, ["engine.rounds=1"])
    assert history[-1]["eval/clients"] == 6.0
    runner = sim.executor.runner  # serial executor: the in-process runner
    rnd = sim.spec.round_context(1)
    payload = sim.executor.server.server.broadcast("tiny_a", rnd)
    client = runner.client_for(0, sim.executor.states[0])
    model = client.deployed_model(payload, rnd)
    for key, value in payload.items():
        np.testing.assert_array_equal(model.head.state_dict()[key.removeprefix("head.")], value)


def test_eval_protocol_is_validated(synthetic_raw):
    with pytest.raises(ConfigError, match="eval.protocol"):
        build_config(synthetic_raw, ["eval.protocol=after_server"])


def test_summarize_scores_only_the_evaluated_rows():
    fit = [{"client": 0, "arch": "a", "num_train": 10, "train_s": 1.0, "train/loss": 2.0}]
    evaluated = [
        {"client": 1, "arch": "a", "acc": 0.5, "num_test": 10.0},
        {"client": 0, "arch": "b", "acc": 1.0, "num_test": 30.0},
    ]
    out = summarize_clients(fit, evaluated)
    assert out["personal/acc"] == pytest.approx(0.875)
    assert out["personal/acc_mean"] == pytest.approx(0.75)
    assert out["eval/clients"] == 2.0 and out["train/loss"] == 2.0


def _recording(monkeypatch, rescore_all: bool):
    """Record which clients each deployed evaluation scores; `rescore_all`: forget every kept
    score first, so every client is scored again (what the loop did before it kept scores)."""
    from rayfl.engine.executor import SerialExecutor

    scored: list[list[int]] = []
    evaluate = SerialExecutor.evaluate

    def recording(self, round_idx, client_ids, payloads):
        scored.append(list(client_ids))
        return evaluate(self, round_idx, client_ids, payloads)

    monkeypatch.setattr(SerialExecutor, "evaluate", recording)
    if rescore_all:
        deployed = Simulation._evaluate_deployed

        def forgetting(self, *args):
            self._scores.clear()
            return deployed(self, *args)

        monkeypatch.setattr(Simulation, "_evaluate_deployed", forgetting)
    return scored


def _without_times(history):
    return [{k: v for k, v in r.items() if not k.startswith("time/")} for r in history]


def _kept_against_everyone(run_dir, synthetic_raw, monkeypatch, overrides):
    scored = _recording(monkeypatch, rescore_all=True)
    _, everyone = simulate(run_dir, synthetic_raw, overrides)
    assert all(sorted(s) == list(range(6)) for s in scored)
    monkeypatch.undo()
    scored = _recording(monkeypatch, rescore_all=False)
    sim, kept = simulate(run_dir, synthetic_raw, overrides)
    return sim, scored, everyone, kept


def test_clients_that_did_not_change_keep_their_score_with_the_same_numbers(
    synthetic_raw, monkeypatch, tmp_path
):
    # `local` broadcasts nothing: a client that did not train since its last score deploys the
    # same model, and is not scored again. The rows are those of scoring everyone every round.
    overrides = ["algorithm.name=local", "engine.clients_per_round=2", "engine.rounds=4"]
    sim, scored, everyone, kept = _kept_against_everyone(
        tmp_path, synthetic_raw, monkeypatch, overrides
    )
    assert _without_times(kept) == _without_times(everyone)
    assert sorted(scored[0]) == list(range(6))  # round 1: nothing scored yet
    from rayfl.sampling import sample_clients

    for rnd, clients in enumerate(scored[1:], start=2):
        # only this round's participants are scored again
        assert sorted(clients) == sample_clients(sim.cfg.seed, rnd, 6, 2)
    assert all(row["eval/clients"] == 6.0 for row in kept)


def test_pfedes_keeps_the_local_models_scores_while_its_proxy_changes(
    synthetic_raw, monkeypatch, tmp_path
):
    # pFedES deploys the local model: the proxy it broadcasts changes every round, yet a client
    # that did not train keeps its score. Every metric is that of scoring everyone every round:
    # the proxy's diagnostics (against this round's broadcast) average over the participants.
    overrides = ["engine.clients_per_round=2", "engine.rounds=3"]
    sim, scored, everyone, kept = _kept_against_everyone(
        tmp_path, synthetic_raw, monkeypatch, overrides
    )
    assert _without_times(kept) == _without_times(everyone)
    assert [len(s) for s in scored] == [6, 2, 2]
    assert all("pfedes/proxy_acc" in row for row in kept)


def test_pfedes_diagnostics_average_over_the_participants(synthetic_raw, tmp_path):
    sim, history = simulate(
        tmp_path, synthetic_raw, ["engine.clients_per_round=2", "engine.rounds=1"]
    )
    runner = sim.executor.runner  # serial executor: the in-process runner
    _, payloads = sim.executor.broadcast(1, sorted(set(sim.archs)))
    want = summarize_clients(
        [],
        runner.evaluate(
            1, sim.last_clients, payloads, [sim.executor.states.get(c) for c in sim.last_clients]
        ),
    )
    assert history[-1]["pfedes/proxy_acc"] == want["pfedes/proxy_acc"]
    assert history[-1]["pfedes/kl_local_proxy"] == want["pfedes/kl_local_proxy"]


def test_a_changed_payload_scores_every_client_again(synthetic_raw, monkeypatch, tmp_path):
    # FedAvg deploys the global model, which the round's step changed: every deployed model changed
    synthetic_raw["algorithm"] = {"name": "fedavg"}
    synthetic_raw["model"] = {"architectures": ["tiny_a"]}
    scored = _recording(monkeypatch, rescore_all=False)
    _, history = simulate(
        tmp_path, synthetic_raw, ["engine.clients_per_round=2", "engine.rounds=3"]
    )
    assert [sorted(s) for s in scored] == [list(range(6))] * 3


def test_fedproto_deploys_the_payload_only_when_it_predicts_by_prototype():
    from rayfl.algorithms.fedproto import FedProtoClient, FedProtoParams

    assert not FedProtoClient.deploys_payload(FedProtoParams(predict="head"))
    assert FedProtoClient.deploys_payload(FedProtoParams(predict="prototype"))
