"""DP-FedAvg pieces: clipping and noise (golden numbers) and the dp-accounting accountant checked
against the library's own published values (dp_accounting 0.6.0's rdp_privacy_accountant_test)."""

from __future__ import annotations

import math

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
    acc.compose(dp.round_event(2.5, 0.01), 50)
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
    eps = dp.epsilon(4.530877117, 1.0, rounds=1, delta=1e-6, orders=orders)
    assert eps == pytest.approx(1.0, abs=1e-6)


def test_epsilon_grows_with_rounds_and_shrinks_with_noise():
    e1 = dp.epsilon(1.0, 0.1, 10, 1e-5)
    assert 0 < e1 < dp.epsilon(1.0, 0.1, 20, 1e-5)
    assert dp.epsilon(2.0, 0.1, 10, 1e-5) < e1
    assert dp.epsilon(1.0, 0.1, 10, 1e-5, accountant="pld") < e1  # PLD is tighter than RDP
    assert dp.epsilon(0.0, 0.1, 10, 1e-5) == math.inf
    assert dp.epsilon(1.0, 0.1, 0, 1e-5) == 0.0
