"""The engine's privacy hook: what the server half receives, exact decoding, DP golden numbers,
and composition with every registered algorithm (or a clear refusal)."""

from __future__ import annotations

import copy

import numpy as np
import pytest

from rayfl.algorithms import ALGORITHMS
from rayfl.algorithms.base import Reply
from rayfl.config import DPConfig, PrivacyConfig, SecAggConfig, build_config
from rayfl.engine.loop import Simulation
from rayfl.engine.server import ServerRunner
from rayfl.errors import ConfigError
from rayfl.privacy.hook import MASKED, PrivacyHook, check_fits, sum_form
from tests.algorithms.test_contract import FALLBACK_ARCHS, contract_raw

SECAGG = PrivacyConfig(secagg=SecAggConfig(enabled=True))


def hook(cfg: PrivacyConfig, form: str, n: int = 4) -> PrivacyHook:
    return PrivacyHook(cfg, form, seed=0, num_clients=n, per_round=n)


def replies(h: PrivacyHook, uploads, sent, weights, drop=()):
    out = []
    for cid, (up, w) in enumerate(zip(uploads, weights)):
        payload = {} if cid in drop else h.protect(up, sent, 1, cid, w)
        out.append(Reply(cid, "a", w, payload))
    return out


def test_secagg_weighted_mean_decodes_to_the_weighted_average_with_a_dropout():
    sent = {"w": np.zeros((2, 3), np.float32), "steps": np.array(7)}
    rng = np.random.default_rng(0)
    uploads = [
        {"w": rng.normal(size=(2, 3)).astype(np.float32), "steps": np.array(9)} for _ in range(4)
    ]
    weights = [10, 20, 30, 40]
    h = hook(SECAGG, "weighted_mean")
    sent_replies = replies(h, uploads, sent, weights, drop={2})
    for r in sent_replies:  # what reaches the server: masked ring words or nothing
        assert set(r.payload) <= {MASKED}
    (combined,), metrics = h.combine(sent_replies, 1, {"a": sent})
    keep = [0, 1, 3]
    expected = sum(weights[i] * uploads[i]["w"].astype(np.float64) for i in keep) / 70
    np.testing.assert_allclose(combined.payload["w"], expected, atol=1e-6)
    assert combined.num_samples == 70 and metrics["privacy/dropped"] == 1.0
    assert int(combined.payload["steps"]) == 7  # integer entries keep the server's value


def test_secagg_class_means_are_count_weighted():
    sent = {"means": np.zeros((2, 2), np.float32), "counts": np.zeros(2, np.float32)}
    ups = [
        {
            "means": np.array([[1.0, 0.0], [0.0, 0.0]], np.float32),
            "counts": np.array([3.0, 0.0], np.float32),
        },
        {
            "means": np.array([[0.0, 1.0], [2.0, 2.0]], np.float32),
            "counts": np.array([1.0, 4.0], np.float32),
        },
    ]
    h = hook(SECAGG, "class_means", n=2)
    (combined,), _ = h.combine(replies(h, ups, sent, [3, 5]), 1, {"a": sent})
    np.testing.assert_allclose(combined.payload["means"], [[0.75, 0.25], [2.0, 2.0]], atol=1e-6)
    np.testing.assert_allclose(combined.payload["counts"], [4.0, 4.0])


def test_dp_clips_each_update_and_averages_with_equal_weights():
    cfg = PrivacyConfig(dp=DPConfig(enabled=True, clip=1.0, noise_multiplier=0.0))
    sent = {"w": np.array([1.0, 1.0], np.float32)}
    ups = [{"w": np.array([4.0, 5.0], np.float32)}, {"w": np.array([1.0, 1.5], np.float32)}]
    h = hook(cfg, "weighted_mean", n=2)
    (combined,), metrics = h.combine(replies(h, ups, sent, [1, 99]), 1, {"a": sent})
    # updates (3, 4) -> (0.6, 0.8) and (0, 0.5) kept; mean (0.3, 0.65) added to the broadcast
    np.testing.assert_allclose(combined.payload["w"], [1.3, 1.65], atol=1e-6)
    assert metrics["privacy/epsilon"] == float("inf")  # no noise, no privacy


def test_dp_noise_is_seeded_and_has_the_configured_scale():
    cfg = PrivacyConfig(dp=DPConfig(enabled=True, clip=0.5, noise_multiplier=2.0))
    sent = {"w": np.zeros(20000, np.float32)}
    ups = [{"w": np.zeros(20000, np.float32)} for _ in range(4)]
    h = hook(cfg, "weighted_mean")
    (a,), metrics = h.combine(replies(h, ups, sent, [1] * 4), 1, {"a": sent})
    (b,), _ = h.combine(replies(h, ups, sent, [1] * 4), 1, {"a": sent})
    np.testing.assert_array_equal(a.payload["w"], b.payload["w"])
    # noise std 2.0 * 0.5 on the sum, divided by 4 contributions
    assert float(np.std(a.payload["w"])) == pytest.approx(0.25, rel=0.03)
    assert 0 < metrics["privacy/epsilon"] < float("inf")


def test_server_half_never_receives_an_unmasked_payload(tmp_path, monkeypatch, synthetic_raw):
    seen_by_engine: list[dict] = []
    seen_by_algorithm: list[list[Reply]] = []
    original_step = ServerRunner._step

    def spy_step(self, round_idx, reply_lists, evaluate):
        seen_by_engine.extend(r.payload for batch in reply_lists for r in batch)
        return original_step(self, round_idx, reply_lists, evaluate)

    fedavg = ALGORITHMS.get("fedavg").server
    original_aggregate = fedavg.aggregate

    def spy_aggregate(self, rs, round_idx):
        seen_by_algorithm.append(list(rs))
        return original_aggregate(self, rs, round_idx)

    monkeypatch.setattr(ServerRunner, "_step", spy_step)
    monkeypatch.setattr(fedavg, "aggregate", spy_aggregate)
    raw = copy.deepcopy(synthetic_raw)
    raw["algorithm"] = {"name": "fedavg"}
    raw["model"] = {"architectures": ["tiny_a"]}
    plain = Simulation(build_config(raw), tmp_path / "plain").run().final
    seen_by_engine.clear()
    seen_by_algorithm.clear()
    masked = Simulation(build_config(raw, ["privacy.secagg.enabled=true"]), tmp_path / "sa").run()
    assert seen_by_engine and all(set(p) == {MASKED} for p in seen_by_engine)
    assert all(p[MASKED].dtype == np.uint64 for p in seen_by_engine)
    assert [len(rs) for rs in seen_by_algorithm] == [1, 1]  # one reply: the sum, per round
    assert all(rs[0].client_id == -1 for rs in seen_by_algorithm)
    # the same aggregate as without masking (to fixed-point precision): same accuracies
    assert masked.final["global/acc"] == pytest.approx(plain["global/acc"], abs=1e-9)
    assert masked.final["comm/bytes_up"] == pytest.approx(2 * plain["comm/bytes_up"] + 8 * 6)


@pytest.mark.parametrize("name", ALGORITHMS.names())
def test_protections_compose_or_refuse_clearly(name, tmp_path):
    overrides = ["privacy.secagg.enabled=true", "privacy.dp.enabled=true"]
    algo = ALGORITHMS.get(name)
    for archs in (None, FALLBACK_ARCHS):  # width-sliced algorithms refuse tiny models
        raw = contract_raw(name, archs)
        raw["engine"]["rounds"] = 1
        cfg = build_config(raw, overrides)
        if sum_form(algo, cfg.algorithm.params) is None:
            with pytest.raises(ConfigError) as info:
                check_fits(algo, cfg.privacy, cfg.algorithm.params)
            message = str(info.value)
            assert "\n" not in message and f"algorithm.name={name}" in message
            return
        try:
            sim = Simulation(cfg, tmp_path / str(archs))
        except ConfigError:
            if archs is not None:
                raise
            continue
        result = sim.run()
        assert result.status == "FINISHED"
        assert result.final["privacy/epsilon"] > 0
        return


def test_per_client_server_options_are_refused(synthetic_raw, tmp_path):
    with pytest.raises(ConfigError, match="algorithm.clip_update"):
        Simulation(
            build_config(synthetic_raw, ["privacy.dp.enabled=true", "algorithm.clip_update=5"]),
            "unused",
        )


def test_privacy_config_is_checked(synthetic_raw):
    with pytest.raises(ConfigError, match="privacy.dp.clip"):
        build_config(synthetic_raw, ["privacy.dp.clip=0"])
    with pytest.raises(ConfigError, match="privacy.secagg.dropout"):
        build_config(synthetic_raw, ["privacy.secagg.dropout=1.5"])


@pytest.mark.ray
def test_protected_runs_are_the_same_on_ray_and_serial(ray_local, synthetic_raw, tmp_path):
    protect = [
        "privacy.secagg.enabled=true",
        "privacy.dp.enabled=true",
        "privacy.secagg.dropout=0.2",
        "privacy.secagg.threshold=0.3",  # unmasks with 2 of 6: the seeded dropouts may take 3
        "privacy.dp.noise_seed=7",  # the same noise on both executors (unset: fresh per run)
    ]
    runs = []
    for executor in (
        ["engine.executor=serial"],
        ["engine.executor=ray", "engine.num_workers=2", "engine.clients_per_call=2"],
    ):
        cfg = build_config(synthetic_raw, protect + executor + ["algorithm.beta=0.5"])
        runs.append(Simulation(cfg, tmp_path / executor[0]).run().history)
    keys = ["personal/acc", "proxy/acc", "privacy/epsilon", "privacy/dropped"]
    assert [[row[k] for k in keys] for row in runs[0]] == [
        [row[k] for k in keys] for row in runs[1]
    ]


def test_secagg_and_dp_under_poisson_sampling_sum_the_drawn_clients(synthetic_raw, tmp_path):
    raw = copy.deepcopy(synthetic_raw)
    raw["data"]["num_clients"] = 12
    raw["algorithm"] = {"name": "fedavg"}
    raw["model"] = {"architectures": ["tiny_a"]}
    common = [
        "engine.sampling=poisson",
        "engine.clients_per_round=6",
        "privacy.dp.enabled=true",
        "privacy.dp.delta=0.01",
        "privacy.dp.noise_seed=1",
        "eval.protocol=after_fit",
    ]
    plain = Simulation(build_config(raw, common), tmp_path / "dp").run().history
    masked = Simulation(
        build_config(raw, [*common, "privacy.secagg.enabled=true"]), tmp_path / "sa"
    ).run()
    # the masks cancel over exactly the clients the loop drew: the same model as without SecAgg
    assert [r["clients"] for r in masked.history] == [r["clients"] for r in plain]
    for a, b in zip(masked.history, plain):
        assert a["global/acc"] == pytest.approx(b["global/acc"], abs=1e-9)
        assert a["privacy/dropped"] == 0.0
