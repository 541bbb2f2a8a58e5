"""Every random stream's words differ from every other purpose's (rayfl.seeding)."""

from __future__ import annotations

import itertools

import numpy as np
import torch

from rayfl.seeding import Purpose, rng_of, seed_of, server_data_words, words

SEEDS, ROUNDS, CLIENTS = range(4), range(0, 13), range(0, 13)


def streams() -> dict[tuple[int, ...], set[str]]:
    """Words -> the purposes that draw them, over a grid of seeds, rounds and clients."""
    found: dict[tuple[int, ...], set[str]] = {}

    def add(name: str, w: tuple[int, ...]) -> None:
        found.setdefault(w, set()).add(name)

    for s in SEEDS:
        add("partitioner", (s,))  # partitioners draw `default_rng(seed)`
        for p in (
            Purpose.SERVER,
            Purpose.DATA_SUBSET,
            Purpose.DATA_PUBLIC,
            Purpose.DATA_SHIFT,
            Purpose.DEVICE_TIER,
        ):
            add(p.name, words(p, s))
        for c in CLIENTS:
            add("INIT", words(Purpose.INIT, s, client=c))
            add("DATA_SPLIT", words(Purpose.DATA_SPLIT, s, client=c))
            add("DATA_SHIFT", words(Purpose.DATA_SHIFT, s, client=c))
            add("DATA_DOMAIN", words(Purpose.DATA_DOMAIN, s, client=c))
            add("DATA_VAL", words(Purpose.DATA_VAL, s, client=c))
        for r in ROUNDS:
            add("SERVER", words(Purpose.SERVER, s, r))
            add("SERVER_DATA", server_data_words(s, r))
            add("SAMPLE", words(Purpose.SAMPLE, s, r))
            add("PRIVACY", words(Purpose.PRIVACY, s, r))
            for a in range(4):  # a Poisson draw's redraws
                add("POISSON_SAMPLE", words(Purpose.POISSON_SAMPLE, s, r, a))
            purposes = (Purpose.TRAIN, Purpose.EVAL, Purpose.PRIVACY)
            purposes += (Purpose.DEVICE_AVAILABLE, Purpose.DEVICE_DROPOUT)
            for c, p in itertools.product(CLIENTS, purposes):
                add(p.name, words(p, s, r, c))
    return found


def test_every_purpose_has_its_own_tag():
    # an IntEnum turns a repeated value into an alias: PRIVACY = 5 would silently be EVAL
    assert len(Purpose.__members__) == len(list(Purpose))
    assert Purpose.PRIVACY != Purpose.EVAL


def test_no_two_purposes_draw_the_same_stream():
    clashes = {w: names for w, names in streams().items() if len(names) > 1}
    assert clashes == {}


def test_the_old_data_streams_did_clash_and_the_new_ones_do_not():
    # before: client 1's split drew (seed, 3, 1), client 3's initial weights (seed, 3, 1)
    old_split, init = (0, 3, 1), words(Purpose.INIT, 0, client=3)
    assert old_split == init
    assert words(Purpose.DATA_SPLIT, 0, client=1) != init


def test_the_run_streams_keep_their_words_and_numbers():
    # what the engine drew before this module: the same words, so the same numbers
    assert words(Purpose.INIT, 7, client=4) == (7, 4, 1)
    assert words(Purpose.TRAIN, 7, 2, 4) == (7, 2, 4, 2)
    assert words(Purpose.EVAL, 7, 2, 4) == (7, 2, 4, 5)
    assert words(Purpose.SERVER, 7) == (7, 3) and server_data_words(7, 2) == (7, 2, 3, 1)
    assert words(Purpose.SAMPLE, 7, 2) == (7, 2, 4)
    expected = int(np.random.SeedSequence([7, 2, 4, 2]).generate_state(1)[0] & 0x7FFFFFFF)
    assert seed_of(words(Purpose.TRAIN, 7, 2, 4)) == expected
    assert 0 <= expected < 2**31 and torch.manual_seed(expected) is not None
    draws = rng_of(words(Purpose.SAMPLE, 7, 2)).integers(0, 1000, 5)
    assert (draws == np.random.default_rng([7, 2, 4]).integers(0, 1000, 5)).all()
