"""Client-level differential privacy: McMahan, Ramage, Talwar, Zhang, "Learning Differentially
Private Recurrent Language Models" (ICLR 2018), i.e. DP-FedAvg.

Each sampled client's contribution (its update, or its statistics payload) is clipped to L2 norm
`clip` on the client; the server adds Gaussian noise of std `noise_multiplier * clip` to the SUM of
the clipped contributions and divides it by a FIXED denominator, the expected number of
participants q * N (the paper's fixed-denominator estimator with w_k = 1), whatever number of
uploads arrived: dividing by the arrivals would make the denominator data-dependent.

The accountant is Google's maintained `dp-accounting` library (RDP or PLD); nothing is
hand-written here. Each round is accounted as the sampling that actually ran (`engine.sampling`;
the table of events and neighbouring relations is in docs/privacy.md): `uniform` with K < N is
the sampling-without-replacement event of Wang, Balle and Kasiviswanathan (2019), defined under
replace-one-client neighbouring, where the sum moves by up to 2 * clip (multiplier z / 2).
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


def gaussian_noise(size: int, std: float, seed: int | Sequence[int]) -> np.ndarray:
    """N(0, std^2) noise for the sum (float64) from the stream `seed` (an int or int words)."""
    return np.random.default_rng(seed).normal(0.0, std, size) if std > 0 else np.zeros(size)


def replace_one(sampling: str, num_clients: int, per_round: int) -> bool:
    """Whether the round is accounted under replace-one neighbouring (fixed-size sampling)."""
    return sampling == "uniform" and per_round < num_clients


def round_event(
    noise_multiplier: float, num_clients: int, per_round: int, sampling: str = "poisson"
) -> Any:
    """One round of DP-FedAvg, as it was sampled, as a `dp_accounting` event."""
    import dp_accounting

    if per_round >= num_clients:
        return dp_accounting.GaussianDpEvent(noise_multiplier)
    if sampling == "poisson":
        return dp_accounting.PoissonSampledDpEvent(
            per_round / num_clients, dp_accounting.GaussianDpEvent(noise_multiplier)
        )
    if sampling != "uniform":
        raise ValueError(f"unknown sampling scheme {sampling!r}")
    # replace-one: the sum's sensitivity is 2 * clip, the noise std z * clip
    return dp_accounting.SampledWithoutReplacementDpEvent(
        num_clients, per_round, dp_accounting.GaussianDpEvent(noise_multiplier / 2)
    )


def make_accountant(
    kind: str = "rdp", orders: Sequence[float] | None = None, replace: bool = False
) -> Any:
    """A fresh `dp_accounting` accountant: add/remove-one-client neighbouring, or replace-one."""
    import dp_accounting
    from dp_accounting import pld, rdp

    relation = (
        dp_accounting.NeighboringRelation.REPLACE_ONE
        if replace
        else dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE
    )
    if kind == "pld":
        return pld.PLDAccountant(neighboring_relation=relation)
    orders = list(orders) if orders is not None else None
    return rdp.RdpAccountant(orders=orders, neighboring_relation=relation)


def epsilon(
    noise_multiplier: float,
    rounds: int,
    delta: float,
    *,
    num_clients: int,
    per_round: int,
    sampling: str = "poisson",
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
        acc = make_accountant(accountant, orders, replace_one(sampling, num_clients, per_round))
        acc.compose(round_event(noise_multiplier, num_clients, per_round, sampling), rounds)
        return float(acc.get_epsilon(delta))
    finally:
        absl.setLevel(level)
