"""Seeded client sampling: the same (seed, round) picks the same clients on any executor."""

from __future__ import annotations

from rayfl.seeding import Purpose, rng_of, words


def sample_clients(seed: int, round_idx: int, num_clients: int, per_round: int) -> list[int]:
    """Sorted ids of `per_round` clients drawn without replacement for this round."""
    if not 1 <= per_round <= num_clients:
        raise ValueError(f"cannot sample {per_round} of {num_clients} clients")
    if per_round == num_clients:
        return list(range(num_clients))
    rng = rng_of(words(Purpose.SAMPLE, seed, round_idx))
    return sorted(int(c) for c in rng.choice(num_clients, size=per_round, replace=False))
