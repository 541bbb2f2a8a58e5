"""Every random stream of a run, named once.

A stream is a `numpy.random.SeedSequence` over a tuple of integers, its *words*: the run's seed,
where it applies (round, client) and its purpose's tag. Two streams with the same words draw the
same numbers, so every purpose's words must differ from every other's for any seed, round and
client (`tests/test_seeding.py` checks it over a grid).

Secure aggregation derives its keys by hashing with labels of its own (`rayfl.privacy.secagg`),
a domain apart from these streams. A dataset's own `data.options.seed` (synthetic data, the
digits test split) defines the data, not a run's randomness, and is not a stream here.

The same streams give the same numbers on another machine only with the same float arithmetic:
`PORTABLE_CPU_ENV` pins it on x86-64.
"""

from __future__ import annotations

from enum import IntEnum

import numpy as np


class Purpose(IntEnum):
    """The tag of each purpose: the last word of its streams."""

    INIT = 1  # a client's initial weights: (seed, client, INIT)
    TRAIN = 2  # a client's training (shuffling, dropout): (seed, round, client, TRAIN)
    SERVER = 3  # the server's model init (seed, SERVER), its round (seed, round, SERVER)
    SAMPLE = 4  # the round's clients: (seed, round, SAMPLE)
    EVAL = 5  # a client's evaluation: (seed, round, client, EVAL)
    # a client's noise (seed, round, client, PRIVACY), the server's (seed, round, PRIVACY)
    PRIVACY = 6
    DATA_SUBSET = 7  # `data.train_samples`'s subset: (seed, DATA_SUBSET)
    DATA_PUBLIC = 8  # the public split: (seed, DATA_PUBLIC)
    DATA_SPLIT = 9  # a client's train/test split: (seed, client, DATA_SPLIT)
    POISSON_SAMPLE = 10  # `engine.sampling=poisson`'s draw: (seed, round, attempt, POISSON_SAMPLE)
    # `data.domains`' transformations and noise: a client's (seed, client, DATA_SHIFT), the
    # server test set's (seed, DATA_SHIFT)
    DATA_SHIFT = 11
    DATA_DOMAIN = 12  # a multi-domain dataset's per-domain partition: (seed, domain, DATA_DOMAIN)
    DATA_VAL = 13  # a client's validation split, out of its train split: (seed, client, DATA_VAL)
    DEVICE_TIER = 20  # clients drawn into device tiers (`devices.proportions`): (seed, DEVICE_TIER)
    DEVICE_AVAILABLE = 21  # a device's availability: (seed, round, client, DEVICE_AVAILABLE)
    DEVICE_DROPOUT = 22  # a device dropping out mid-training: (seed, round, client, DEVICE_DROPOUT)


# PyTorch's kernels, oneDNN's and MKL's each choose their code by the CPU's instruction set, and
# an AVX-512 machine sums in another order than an AVX2 one: the last digits differ and training
# drifts apart. These settings make every x86-64 CPU with AVX2 compute as an AVX2 one. They must
# be in the environment before the first tensor operation; Ray workers and subprocesses started
# afterwards inherit them. The test suite and the results plan run under them.
PORTABLE_CPU_ENV = {
    "ATEN_CPU_CAPABILITY": "avx2",
    "ONEDNN_MAX_CPU_ISA": "AVX2",
    "MKL_ENABLE_INSTRUCTIONS": "AVX2",
}


# The server's second stream in a round (its public-data batches): (seed, round, SERVER, 1), a
# four-word stream whose last word no four-word purpose has.
SERVER_DATA_WORD = 1


def words(
    purpose: Purpose, seed: int, round_idx: int | None = None, client: int | None = None
) -> tuple[int, ...]:
    """The words of `purpose`'s stream for `seed` (and the round and client where it has them)."""
    where = [w for w in (round_idx, client) if w is not None]
    return (int(seed), *(int(w) for w in where), int(purpose))


def server_data_words(seed: int, round_idx: int) -> tuple[int, ...]:
    """The words of the server's public-data stream in round `round_idx`."""
    return (*words(Purpose.SERVER, seed, round_idx), SERVER_DATA_WORD)


def seed_of(stream: tuple[int, ...]) -> int:
    """A 31-bit seed (for `torch.manual_seed`) from a stream's words: independent of workers."""
    return int(np.random.SeedSequence(list(stream)).generate_state(1)[0] & 0x7FFFFFFF)


def rng_of(stream: tuple[int, ...]) -> np.random.Generator:
    """A numpy generator on a stream's words."""
    return np.random.default_rng(list(stream))
