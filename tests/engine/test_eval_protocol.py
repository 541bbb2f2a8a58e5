"""The evaluation phase (`eval.protocol`): deployed models of every client vs after-fit scores."""

import numpy as np
import pytest

from rayfl.config import build_config
from rayfl.engine.loop import Simulation, summarize_clients
from rayfl.errors import ConfigError


def simulate(raw, overrides=()):
    sim = Simulation(build_config(raw, list(overrides)), "/tmp/unused")
    result = sim.run()
    return sim, result.history


def test_deployed_scores_every_client_including_non_participants(synthetic_raw):
    # 2 of 6 clients per round: most clients are scored without having trained this round,
    # and some (never sampled yet in round 1) with their initial weights.
    sim, history = simulate(synthetic_raw, ["engine.clients_per_round=2"])
    assert [row["clients"] for row in history] == [2.0, 2.0]
    assert [row["eval/clients"] for row in history] == [6.0, 6.0]
    for row in history:
        assert 0.0 <= row["personal/acc"] <= 1.0
        assert "pfedes/kl_local_proxy" in row and "pfedes/proxy_acc" in row


def test_after_fit_scores_the_participants_only(synthetic_raw):
    _, history = simulate(synthetic_raw, ["engine.clients_per_round=2", "eval.protocol=after_fit"])
    assert all("eval/clients" not in row for row in history)
    assert all(0.0 <= row["personal/acc"] <= 1.0 for row in history)


def test_evaluation_changes_no_state(synthetic_raw):
    # Whatever the protocol, training follows the same trajectory: the server's proxy scores
    # and the training losses are bit for bit the same; only what is scored differs.
    overrides = ["engine.clients_per_round=3", "engine.rounds=3"]
    _, deployed = simulate(synthetic_raw, overrides)
    _, after_fit = simulate(synthetic_raw, [*overrides, "eval.protocol=after_fit"])
    for a, b in zip(deployed, after_fit):
        assert a["proxy/acc"] == b["proxy/acc"]
        assert a["train/loss"] == b["train/loss"]
    assert [r["personal/acc"] for r in deployed] != [r["personal/acc"] for r in after_fit]


def test_deployed_lg_fedavg_scores_the_received_head(synthetic_raw):
    # Full participation, deployed: every client's head is the new global head, so two clients'
    # deployed models agree on the head's parameters; after_fit scores the locally trained head.
    synthetic_raw["algorithm"] = {"name": "lg_fedavg"}
    synthetic_raw["model"] = {"family": "tiny2"}
    sim, history = simulate(synthetic_raw, ["engine.rounds=1"])
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


def _recording(monkeypatch, fresh_digests: bool):
    """Record which clients each deployed evaluation scores; `fresh_digests`: every payload
    looks new, so every client is scored again (what the loop did before it kept scores)."""
    import itertools

    from rayfl.engine.executor import SerialExecutor

    scored: list[list[int]] = []
    evaluate = SerialExecutor.evaluate

    def recording(self, round_idx, client_ids, payloads):
        scored.append(list(client_ids))
        return evaluate(self, round_idx, client_ids, payloads)

    monkeypatch.setattr(SerialExecutor, "evaluate", recording)
    if fresh_digests:
        counter = itertools.count()
        monkeypatch.setattr(
            SerialExecutor, "payload_digests", lambda self, p: {a: str(next(counter)) for a in p}
        )
    return scored


def test_clients_that_did_not_change_keep_their_score_with_the_same_numbers(
    synthetic_raw, monkeypatch
):
    # `local` broadcasts nothing: a client that did not train since its last score deploys the
    # same model, and is not scored again. The rows are those of scoring everyone every round.
    overrides = ["algorithm.name=local", "engine.clients_per_round=2", "engine.rounds=4"]
    scored = _recording(monkeypatch, fresh_digests=True)
    _, everyone = simulate(synthetic_raw, overrides)
    assert all(sorted(s) == list(range(6)) for s in scored)
    monkeypatch.undo()
    scored = _recording(monkeypatch, fresh_digests=False)
    sim, kept = simulate(synthetic_raw, overrides)
    comparable = [{k: v for k, v in r.items() if not k.startswith("time/")} for r in everyone]
    assert [{k: v for k, v in r.items() if not k.startswith("time/")} for r in kept] == comparable
    assert sorted(scored[0]) == list(range(6))  # round 1: nothing scored yet
    from rayfl.engine.sampling import sample_clients

    for rnd, clients in enumerate(scored[1:], start=2):
        # only this round's participants are scored again
        assert sorted(clients) == sample_clients(sim.cfg.seed, rnd, 6, 2)
    assert all(row["eval/clients"] == 6.0 for row in kept)


def test_a_changed_payload_scores_every_client_again(synthetic_raw, monkeypatch):
    # pFedES broadcasts its proxy, which the round's step changed: every deployed model changed
    scored = _recording(monkeypatch, fresh_digests=False)
    simulate(synthetic_raw, ["engine.clients_per_round=2", "engine.rounds=3"])
    assert [sorted(s) for s in scored] == [list(range(6))] * 3
