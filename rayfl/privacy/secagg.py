"""Secure aggregation, simulated faithfully: Bonawitz et al., "Practical Secure Aggregation for
Privacy-Preserving Machine Learning" (CCS 2017).

What is real here, and what is simulated:
- **Key agreement is real**: every participant of a round holds an X25519 key pair; the pairwise
  seed of clients i and j is `SHA-256(X25519(sk_i, pk_j))`, which both compute from their own
  private key and the other's public key. The pairs are *seeded*: derived from
  (run seed, round, client id) so that runs are reproducible; the advertise-keys step of the
  protocol is simulated by every client deriving the others' public keys itself.
- **Masks are real**: a ChaCha20 keystream (the PRG) expands each seed into `uint64` words; a
  client adds its self mask `PRG(b_i)` and, for every other participant j, `+PRG(s_ij)` if
  `i < j` else `-PRG(s_ij)`, all modulo 2^64 (the fixed-point ring, see `encode`). One masked
  upload alone is uniformly random; the pairwise masks cancel in the sum.
- **Recovery is real arithmetic**: `b_i` and the 32-byte X25519 private key of every participant
  are Shamir-shared (threshold t) over the prime field GF(2^521 - 1). After the upload phase the
  server reconstructs, from the shares of the *survivors only*, the self masks of clients whose
  upload arrived and the private keys of clients that dropped after masking, and removes their
  masks. Simulated: the share distribution (encrypted pairwise in the paper) is replaced by the
  dealer's deterministic share function, queried only for shares a survivor holds.
- Not simulated: consistency checks against malicious servers, signatures (the paper's active
  security), network rounds.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence

import numpy as np
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms
from cryptography.hazmat.primitives.serialization import Encoding, NoEncryption, PrivateFormat

from rayfl.errors import UserError

PRIME = 2**521 - 1  # Mersenne prime: a field larger than any 32-byte secret
RING_BITS = 64


class SecAggFailed(UserError):
    """Too few survivors to reconstruct the secrets of a round."""


def _digest(*parts: object) -> bytes:
    return hashlib.sha256(b"|".join(str(p).encode() for p in parts)).digest()


def private_key(seed: int, round_idx: int, client: int) -> X25519PrivateKey:
    """The seeded X25519 key pair of `client` in this round."""
    return X25519PrivateKey.from_private_bytes(_digest("rayfl-secagg-sk", seed, round_idx, client))


def public_key(seed: int, round_idx: int, client: int) -> X25519PublicKey:
    return private_key(seed, round_idx, client).public_key()


def agree(sk: X25519PrivateKey, pk: X25519PublicKey) -> bytes:
    """The pairwise seed: SHA-256 of the X25519 shared secret (the same from either side)."""
    return hashlib.sha256(sk.exchange(pk)).digest()


def self_seed(seed: int, round_idx: int, client: int) -> bytes:
    """`b_i`, the seed of the client's self mask."""
    return _digest("rayfl-secagg-b", seed, round_idx, client)


def prg(key: bytes, n: int) -> np.ndarray:
    """`n` uniformly random uint64 words: the ChaCha20 keystream of `key` (zero nonce)."""
    enc = Cipher(algorithms.ChaCha20(key, b"\0" * 16), mode=None).encryptor()
    return np.frombuffer(enc.update(b"\0" * (8 * n)), dtype=np.uint64).copy()


# --------------------------------------------------------------------------- fixed-point ring


def encode(x: np.ndarray, frac_bits: int, parties: int) -> np.ndarray:
    """Float vector -> uint64 ring elements `round(x * 2^frac_bits) mod 2^64` (two's complement).

    Refuses values whose sum over `parties` uploads could wrap around the signed range.
    """
    scaled = np.rint(np.asarray(x, dtype=np.float64) * float(2**frac_bits))
    bound = float(2 ** (RING_BITS - 1)) / max(1, parties)
    if scaled.size and float(np.abs(scaled).max()) >= bound:
        raise UserError(
            f"privacy.secagg: a value of {float(np.abs(x).max()):.3g} would overflow the 64-bit ring "
            f"summed over {parties} clients at frac_bits={frac_bits}; lower privacy.secagg.frac_bits"
        )
    return scaled.astype(np.int64).view(np.uint64)


def decode(ring: np.ndarray, frac_bits: int) -> np.ndarray:
    """uint64 ring elements -> floats (the inverse of `encode`, for sums that did not wrap)."""
    return np.asarray(ring, dtype=np.uint64).view(np.int64).astype(np.float64) / float(2**frac_bits)


# --------------------------------------------------------------------------- Shamir sharing


def shamir_split(secret: int, holders: int, t: int, key: bytes) -> list[tuple[int, int]]:
    """Shares `(x, f(x))`, x = 1..holders, of a degree-(t-1) polynomial with `f(0) = secret`;
    the coefficients come from `key` (seeded dealer)."""
    coeffs = [secret % PRIME] + [
        int.from_bytes(hashlib.sha512(key + k.to_bytes(4, "big")).digest(), "big") % PRIME
        for k in range(1, t)
    ]
    shares = []
    for x in range(1, holders + 1):
        y = 0
        for c in reversed(coeffs):
            y = (y * x + c) % PRIME
        shares.append((x, y))
    return shares


def shamir_combine(shares: Sequence[tuple[int, int]]) -> int:
    """The secret `f(0)` by Lagrange interpolation of `t` shares."""
    secret = 0
    for i, (xi, yi) in enumerate(shares):
        num, den = 1, 1
        for j, (xj, _) in enumerate(shares):
            if i != j:
                num = num * (-xj) % PRIME
                den = den * (xi - xj) % PRIME
        secret = (secret + yi * num * pow(den, -1, PRIME)) % PRIME
    return secret


# --------------------------------------------------------------------------- the protocol


class SecAggRound:
    """One round's participants (sorted client ids) and the protocol's operations.

    Args:
        seed: the run seed (keys and shares are derived from it, the round and the client).
        round_idx: the round.
        participants: client ids that were sent this round's keys (all sampled clients).
        threshold_fraction: `t = floor(fraction * n) + 1` shares rebuild a secret.
    """

    def __init__(
        self, seed: int, round_idx: int, participants: Sequence[int], threshold_fraction: float
    ) -> None:
        self.seed = seed
        self.round = round_idx
        self.participants = sorted(int(c) for c in participants)
        n = len(self.participants)
        self.t = min(n, max(1, int(threshold_fraction * n) + 1))  # shares that rebuild a secret
        self._holder = {c: k for k, c in enumerate(self.participants)}

    # -- client side ---------------------------------------------------------------------------
    def mask(self, client: int, x: np.ndarray) -> np.ndarray:
        """`y_i = x_i + PRG(b_i) + sum_{j != i} ±PRG(s_ij)` in the ring, for `client` = i."""
        if client not in self._holder:
            raise ValueError(f"client {client} is not a participant of round {self.round}")
        n = x.size
        y = np.asarray(x, dtype=np.uint64) + prg(self_seed(self.seed, self.round, client), n)
        sk = private_key(self.seed, self.round, client)
        for other in self.participants:
            if other == client:
                continue
            pairwise = prg(agree(sk, public_key(self.seed, self.round, other)), n)
            y = y + pairwise if client < other else y - pairwise
        return y

    def _share_key(self, client: int, what: str) -> bytes:
        return _digest("rayfl-secagg-share", what, self.seed, self.round, client)

    def shares_held(self, owner: int, what: str, holders: Sequence[int]) -> list[tuple[int, int]]:
        """The shares of `owner`'s secret (`"b"`: self-mask seed, `"sk"`: private key) that the
        participants `holders` received from it in the share-keys step."""
        secret = (
            self_seed(self.seed, self.round, owner)
            if what == "b"
            else private_key(self.seed, self.round, owner).private_bytes(
                Encoding.Raw, PrivateFormat.Raw, NoEncryption()
            )
        )
        shares = shamir_split(
            int.from_bytes(secret, "big"),
            len(self.participants),
            self.t,
            self._share_key(owner, what),
        )
        return [shares[self._holder[h]] for h in holders]

    # -- server side ---------------------------------------------------------------------------
    def unmask(self, masked: Mapping[int, np.ndarray], size: int) -> np.ndarray:
        """The ring sum of the survivors' inputs from their masked uploads alone.

        Survivors are the keys of `masked`; participants missing from it dropped after masking.
        Each survivor's self mask is removed with its `b` rebuilt from t survivors' shares; each
        dropped client's pairwise masks are removed with its private key rebuilt the same way.
        """
        survivors = sorted(masked)
        if len(survivors) < self.t:
            raise SecAggFailed(
                f"secure aggregation, round {self.round}: {len(survivors)} of {len(self.participants)} "
                f"clients survived but {self.t} are needed to unmask; lower privacy.secagg.threshold "
                "or privacy.secagg.dropout"
            )
        dropped = [c for c in self.participants if c not in masked]
        total = np.zeros(size, dtype=np.uint64)
        for c in survivors:
            total = total + np.asarray(masked[c], dtype=np.uint64)
        helpers = survivors[: self.t]
        for c in survivors:
            b = shamir_combine(self.shares_held(c, "b", helpers)).to_bytes(32, "big")
            total = total - prg(b, size)
        for d in dropped:
            raw = shamir_combine(self.shares_held(d, "sk", helpers)).to_bytes(32, "big")
            sk_d = X25519PrivateKey.from_private_bytes(raw)
            for j in survivors:
                pairwise = prg(agree(sk_d, public_key(self.seed, self.round, j)), size)
                # survivor j added +PRG(s_jd) if j < d, else subtracted it
                total = total - pairwise if j < d else total + pairwise
        return total
