"""DP-FedAvg pieces: clipping and noise (golden numbers) and the dp-accounting accountant checked
against the library's own published values (dp_accounting 0.6.0's rdp_privacy_accountant_test)
and against the library's own events for each sampling scheme rayfl runs."""

from __future__ import annotations

import logging
import math

import dp_accounting
import numpy as np
import pytest

from rayfl.privacy import dp


def test_l2_clip_golden():
    clipped, norm = dp.l2_clip(np.array([3.0, 4.0]), 1.0)
    assert norm == 5.0
    np.testing.assert_allclose(clipped, [0.6, 0.8])
    same, norm = dp.l2_clip(np.array([0.3, 0.4]), 1.0)  # inside the ball: untouched
    assert norm == pytest.approx(0.5)
    np.testing.assert_allclose(same, [0.3, 0.4])


def test_noise_is_seeded_and_scaled():
    a, b = dp.gaussian_noise(20000, 2.0, 7), dp.gaussian_noise(20000, 2.0, 7)
    np.testing.assert_array_equal(a, b)
    assert float(a.std()) == pytest.approx(2.0, rel=0.03)
    assert not dp.gaussian_noise(5, 0.0, 7).any()


def test_rdp_of_poisson_sampled_gaussian_matches_the_library_test():
    # dp_accounting/rdp/rdp_privacy_accountant_test.py::test_compute_rdp_poisson_sampled_gaussian
    orders = [1.5, 2.5, 5, 50, 100, np.inf]
    acc = dp.make_accountant("rdp", orders)
    acc.compose(dp.round_event(2.5, num_clients=100, per_round=1, sampling="poisson"), 50)
    expected = [
        6.70579741e-04,
        1.08548710e-03,
        2.18075656e-03,
        2.38460375e-02,
        1.67416308e02,
        np.inf,
    ]
    np.testing.assert_allclose(acc._rdp, expected, rtol=1e-6)


def test_epsilon_of_a_gaussian_matches_the_library_test():
    # dp_accounting/rdp/rdp_privacy_accountant_test.py::test_compute_epsilon_delta_gaussian:
    # noise multiplier 4.530877117 gives exactly (1, 1e-6)-DP for one unsampled release.
    orders = [0.001 * i for i in range(1000, 100000)]
    eps = dp.epsilon(4.530877117, 1, 1e-6, num_clients=5, per_round=5, orders=orders)
    assert eps == pytest.approx(1.0, abs=1e-6)


def test_epsilon_grows_with_rounds_and_shrinks_with_noise():
    def eps(z, rounds, **kw):
        return dp.epsilon(z, rounds, 1e-5, num_clients=100, per_round=10, **kw)

    e1 = eps(1.0, 10)
    assert 0 < e1 < eps(1.0, 20)
    assert eps(2.0, 10) < e1
    assert eps(1.0, 10, accountant="pld") < e1  # PLD is tighter than RDP
    assert eps(0.0, 10) == math.inf
    assert eps(1.0, 0) == 0.0


def _library_epsilon(event, rounds, delta, relation, kind="rdp"):
    """The expected value, computed with dp_accounting's own API only."""
    logging.getLogger("absl").setLevel(logging.ERROR)
    if kind == "pld":
        acc = dp_accounting.pld.PLDAccountant(neighboring_relation=relation)
    else:
        acc = dp_accounting.rdp.RdpAccountant(neighboring_relation=relation)
    acc.compose(event, rounds)
    return acc.get_epsilon(delta)


@pytest.mark.parametrize("kind", ["rdp", "pld"])
def test_poisson_sampling_is_accounted_as_the_librarys_poisson_sampled_gaussian(kind):
    # the audit's parameters: z = 1.5, q = 5/10, 4 rounds, delta 1e-3
    expected = _library_epsilon(
        dp_accounting.PoissonSampledDpEvent(0.5, dp_accounting.GaussianDpEvent(1.5)),
        4,
        1e-3,
        dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE,
        kind,
    )
    got = dp.epsilon(1.5, 4, 1e-3, num_clients=10, per_round=5, sampling="poisson", accountant=kind)
    assert got == pytest.approx(expected, rel=1e-9)
    if kind == "rdp":
        assert got == pytest.approx(2.889, abs=1e-3)  # the audit's figure


def test_fixed_size_sampling_is_accounted_without_replacement_under_replace_one():
    # K of N without replacement: the library's event, replace-one neighbouring, and the sum's
    # replace-one sensitivity 2 * clip (noise multiplier z / 2 relative to it)
    expected = _library_epsilon(
        dp_accounting.SampledWithoutReplacementDpEvent(10, 5, dp_accounting.GaussianDpEvent(0.75)),
        4,
        1e-3,
        dp_accounting.NeighboringRelation.REPLACE_ONE,
    )
    got = dp.epsilon(1.5, 4, 1e-3, num_clients=10, per_round=5, sampling="uniform")
    assert got == pytest.approx(expected, rel=1e-9)
    # larger than the Poisson figure the engine used to report for this sampling (2.89)
    assert got > dp.epsilon(1.5, 4, 1e-3, num_clients=10, per_round=5, sampling="poisson")


def test_full_participation_is_an_unsampled_gaussian_whatever_the_scheme():
    expected = _library_epsilon(
        dp_accounting.GaussianDpEvent(1.5),
        4,
        1e-3,
        dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE,
    )
    for sampling in ("uniform", "poisson"):
        got = dp.epsilon(1.5, 4, 1e-3, num_clients=10, per_round=10, sampling=sampling)
        assert got == pytest.approx(expected, rel=1e-9)
