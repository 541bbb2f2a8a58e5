"""Client sampling schemes (`engine.sampling`): seeded, the right law, used by the round loop."""

from __future__ import annotations

import numpy as np
import pytest

from rayfl.config import build_config
from rayfl.engine.loop import Simulation
from rayfl.errors import ConfigError
from rayfl.sampling import sample_clients


def test_uniform_draws_exactly_k_distinct_clients():
    draws = [sample_clients(0, r, 50, 10, "uniform") for r in range(1, 30)]
    assert all(len(d) == len(set(d)) == 10 and d == sorted(d) for d in draws)
    assert draws[0] == sample_clients(0, 1, 50, 10)  # uniform is the default


def test_poisson_includes_each_client_independently_at_rate_q():
    draws = [sample_clients(3, r, 40, 10, "poisson") for r in range(1, 2001)]
    assert draws[5] == sample_clients(3, 6, 40, 10, "poisson")  # seeded by (seed, round)
    sizes = np.array([len(d) for d in draws])
    assert len(set(sizes.tolist())) > 5  # the number of participants varies
    assert sizes.mean() == pytest.approx(10.0, abs=0.3)  # q * N on average
    assert sizes.var() == pytest.approx(40 * 0.25 * 0.75, rel=0.15)  # binomial, not fixed
    per_client = np.bincount(np.concatenate(draws), minlength=40) / len(draws)
    assert np.abs(per_client - 0.25).max() < 0.05
    assert all(d == sorted(set(d)) and d for d in draws)


def test_an_empty_poisson_draw_is_redrawn():
    draws = [sample_clients(0, r, 3, 1, "poisson") for r in range(1, 200)]
    assert all(draws)  # (2/3)^3 of draws are empty before the redraw


def test_full_participation_is_everyone_under_both_schemes():
    assert sample_clients(0, 1, 5, 5, "poisson") == sample_clients(0, 1, 5, 5) == list(range(5))


def test_the_loop_samples_by_the_configured_scheme(synthetic_raw, tmp_path):
    raw = dict(synthetic_raw)
    raw["data"] = {**raw["data"], "num_clients": 12}
    cfg = build_config(
        raw, ["engine.sampling=poisson", "engine.clients_per_round=6", "engine.rounds=4"]
    )
    history = Simulation(cfg, tmp_path).run().history
    expected = [len(sample_clients(0, r, 12, 6, "poisson")) for r in range(1, 5)]
    assert [row["clients"] for row in history] == expected
    assert len(set(expected)) > 1


def test_dp_with_poisson_refuses_a_likely_empty_round(synthetic_raw):
    from rayfl.privacy.hook import check_accounting

    cfg = build_config(
        synthetic_raw,
        ["engine.sampling=poisson", "engine.clients_per_round=2", "privacy.dp.enabled=true"],
    )
    with pytest.raises(ConfigError, match="engine.sampling=poisson draws no client"):
        check_accounting(cfg)


def test_pld_cannot_account_fixed_size_sampling(synthetic_raw):
    from rayfl.privacy.hook import check_accounting

    overrides = [
        "engine.clients_per_round=2",
        "privacy.dp.enabled=true",
        "privacy.dp.accountant=pld",
    ]
    with pytest.raises(ConfigError, match="accountant=pld has no event"):
        check_accounting(build_config(synthetic_raw, overrides))
    check_accounting(
        build_config(
            synthetic_raw, [*overrides[:2], "engine.sampling=poisson", "privacy.dp.delta=0.5"]
        )
    )
