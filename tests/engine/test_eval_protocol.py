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
