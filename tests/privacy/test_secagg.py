"""Secure aggregation: masks hide single uploads, cancel exactly in the ring, dropouts recover."""

from __future__ import annotations

import numpy as np
import pytest

from rayfl.errors import UserError
from rayfl.privacy import secagg

FRAC = 24


def plaintexts(n: int, size: int = 4000) -> dict[int, np.ndarray]:
    rng = np.random.default_rng(0)
    return {c: rng.normal(size=size) for c in range(n)}


def test_shamir_any_t_shares_rebuild_the_secret():
    secret = 2**255 + 12345
    shares = secagg.shamir_split(secret, holders=5, t=3, key=b"k")
    for pick in ([0, 1, 2], [4, 2, 0], [1, 3, 4]):
        assert secagg.shamir_combine([shares[i] for i in pick]) == secret
    assert secagg.shamir_combine(shares[:2]) != secret  # t - 1 shares say nothing useful


def test_key_agreement_is_symmetric():
    a, b = secagg.private_key(0, 1, 3), secagg.private_key(0, 1, 7)
    assert secagg.agree(a, b.public_key()) == secagg.agree(b, a.public_key())
    assert secagg.agree(a, b.public_key()) != secagg.agree(a, secagg.public_key(0, 1, 8))


def test_masked_upload_is_uncorrelated_with_its_plaintext():
    xs = plaintexts(4)
    sa = secagg.SecAggRound(seed=0, round_idx=1, participants=list(xs), threshold_fraction=0.5)
    x = secagg.encode(xs[2], FRAC, 4)
    y = sa.mask(2, x)
    signed_x = x.view(np.int64).astype(np.float64)
    signed_y = y.view(np.int64).astype(np.float64)
    assert abs(np.corrcoef(signed_x, signed_y)[0, 1]) < 0.1
    assert np.mean(y == x) < 0.01
    # uniform over the ring: the top bit is set about half the time
    assert 0.45 < float(np.mean(y >> np.uint64(63))) < 0.55


def test_masks_cancel_exactly_in_the_ring():
    xs = plaintexts(5)
    sa = secagg.SecAggRound(seed=3, round_idx=2, participants=list(xs), threshold_fraction=0.5)
    encoded = {c: secagg.encode(v, FRAC, 5) for c, v in xs.items()}
    masked = {c: sa.mask(c, e) for c, e in encoded.items()}
    total = sa.unmask(masked, 4000)
    plain = np.zeros(4000, dtype=np.uint64)
    for e in encoded.values():
        plain = plain + e
    np.testing.assert_array_equal(total, plain)  # exact in the fixed-point ring
    np.testing.assert_allclose(secagg.decode(total, FRAC), sum(xs.values()), atol=5 * 2.0**-FRAC)


def test_clients_dropped_after_masking_are_recovered():
    xs = plaintexts(6)
    sa = secagg.SecAggRound(seed=1, round_idx=4, participants=list(xs), threshold_fraction=0.5)
    encoded = {c: secagg.encode(v, FRAC, 6) for c, v in xs.items()}
    masked = {c: sa.mask(c, e) for c, e in encoded.items()}
    survivors = {c: y for c, y in masked.items() if c not in (1, 4)}  # 1 and 4 drop out
    total = sa.unmask(survivors, 4000)
    plain = np.zeros(4000, dtype=np.uint64)
    for c in survivors:
        plain = plain + encoded[c]
    np.testing.assert_array_equal(total, plain)
    # without the recovery step the dropped clients' pairwise masks would remain
    naive = np.zeros(4000, dtype=np.uint64)
    for y in survivors.values():
        naive = naive + y
    assert np.mean(naive == plain) < 0.01


def test_too_few_survivors_fail_clearly():
    xs = plaintexts(4, 10)
    sa = secagg.SecAggRound(seed=0, round_idx=1, participants=list(xs), threshold_fraction=0.5)
    masked = {c: sa.mask(c, secagg.encode(xs[c], FRAC, 4)) for c in (0, 1)}  # t = 3
    with pytest.raises(secagg.SecAggFailed, match="threshold"):
        sa.unmask(masked, 10)


def test_encoding_refuses_overflow():
    with pytest.raises(UserError, match="frac_bits"):
        secagg.encode(np.array([1e12]), 24, 10)
