"""Seeded client sampling: the same (seed, round) picks the same clients on any executor.

Two schemes (`engine.sampling`), each accounted as what it is when DP is on (`rayfl.privacy.dp`):

- `uniform`: exactly `per_round` clients drawn without replacement (fixed-size sampling).
- `poisson`: every client joins independently with probability q = per_round / num_clients, the
  scheme of DP-FedAvg (McMahan et al. 2018); the number of participants varies around q * N. A
  draw with no client at all is drawn again from the next stream (the engine cannot run an
  empty round); `rayfl.privacy.hook.check_accounting` bounds how often that can happen.
"""

from __future__ import annotations

import numpy as np

from rayfl.seeding import Purpose, rng_of, words

SCHEMES = ("uniform", "poisson")
# Redraws of an empty Poisson draw before giving up (each has probability (1 - q)^N).
_MAX_REDRAWS = 1000


def sample_clients(
    seed: int, round_idx: int, num_clients: int, per_round: int, scheme: str = "uniform"
) -> list[int]:
    """Sorted ids of this round's clients under `scheme` (`uniform` or `poisson`)."""
    if not 1 <= per_round <= num_clients:
        raise ValueError(f"cannot sample {per_round} of {num_clients} clients")
    if scheme not in SCHEMES:
        raise ValueError(f"unknown sampling scheme {scheme!r}; use one of {', '.join(SCHEMES)}")
    if per_round == num_clients:
        return list(range(num_clients))
    if scheme == "poisson":
        return poisson_clients(seed, round_idx, num_clients, per_round / num_clients)
    rng = rng_of(words(Purpose.SAMPLE, seed, round_idx))
    return sorted(int(c) for c in rng.choice(num_clients, size=per_round, replace=False))


def poisson_clients(seed: int, round_idx: int, num_clients: int, rate: float) -> list[int]:
    """Ids of the clients whose independent coin with probability `rate` came up (non-empty)."""
    for attempt in range(_MAX_REDRAWS):
        rng = rng_of(words(Purpose.POISSON_SAMPLE, seed, round_idx, attempt))
        picked = np.flatnonzero(rng.random(num_clients) < rate)
        if picked.size:
            return [int(c) for c in picked]
    raise ValueError(f"Poisson sampling at rate {rate} of {num_clients} clients drew nobody")
