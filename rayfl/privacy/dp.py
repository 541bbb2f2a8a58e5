"""Client-level differential privacy: McMahan, Ramage, Talwar, Zhang, "Learning Differentially
Private Recurrent Language Models" (ICLR 2018), i.e. DP-FedAvg.

Each sampled client's contribution (its update, or its statistics payload) is clipped to L2 norm
`clip` on the client; the server adds Gaussian noise of std `noise_multiplier * clip` to the SUM of
the clipped contributions and divides by the number of contributions (equal weights, the paper's
fixed-denominator estimator with w_k = 1: sample counts would raise the sensitivity and leak).
One round is then a Gaussian mechanism of sensitivity `clip` on a client-sampled federation,
accounted as a Poisson-sampled Gaussian event at rate q = clients_per_round / num_clients
(the approximation McMahan et al. use; rayfl samples exactly that many without replacement).

The accountant is Google's maintained `dp-accounting` library (RDP or PLD); nothing is
hand-written here.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from typing import Any

import numpy as np


def l2_clip(vec: np.ndarray, clip: float) -> tuple[np.ndarray, float]:
    """`vec` scaled to L2 norm at most `clip`, and its norm before clipping."""
    norm = float(np.sqrt(np.sum(np.square(vec, dtype=np.float64))))
    scale = min(1.0, clip / norm) if norm > 0 else 1.0
    return np.asarray(vec, dtype=np.float64) * scale, norm


def gaussian_noise(size: int, std: float, seed: int) -> np.ndarray:
    """Seeded N(0, std^2) noise for the sum (float64)."""
    return np.random.default_rng(seed).normal(0.0, std, size) if std > 0 else np.zeros(size)


def round_event(noise_multiplier: float, sampling_rate: float) -> Any:
    """One round of DP-FedAvg as a `dp_accounting` event."""
    import dp_accounting

    gaussian = dp_accounting.GaussianDpEvent(noise_multiplier)
    if sampling_rate >= 1.0:
        return gaussian
    return dp_accounting.PoissonSampledDpEvent(sampling_rate, gaussian)


def make_accountant(kind: str = "rdp", orders: Sequence[float] | None = None) -> Any:
    """A fresh `dp_accounting` accountant (add/remove-one-client neighbouring)."""
    from dp_accounting import pld, rdp

    if kind == "pld":
        return pld.PLDAccountant()
    return rdp.RdpAccountant(orders=list(orders) if orders is not None else None)


def epsilon(
    noise_multiplier: float,
    sampling_rate: float,
    rounds: int,
    delta: float,
    accountant: str = "rdp",
    orders: Sequence[float] | None = None,
) -> float:
    """Cumulative epsilon after `rounds` rounds at `delta` (inf without noise, 0 before round one).

    Computed afresh from the round count, so a resumed run reports the same numbers.
    """
    if rounds <= 0:
        return 0.0
    if noise_multiplier <= 0:
        return math.inf
    # The RDP accountant warns (through absl) for every fractional order it skips; not our news.
    absl = logging.getLogger("absl")
    level = absl.level
    absl.setLevel(logging.ERROR)
    try:
        acc = make_accountant(accountant, orders)
        acc.compose(round_event(noise_multiplier, sampling_rate), rounds)
        return float(acc.get_epsilon(delta))
    finally:
        absl.setLevel(level)
