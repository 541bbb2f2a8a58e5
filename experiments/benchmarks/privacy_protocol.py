"""The protocol's own cost, without training: bytes of one upload and seconds to protect it
(client) and to combine a round (server), for a payload of `size` floats and `clients` clients.

    python3 experiments/benchmarks/privacy_protocol.py --clients 10 --size 142000

`python3 experiments/benchmarks/bench.py experiments/benchmarks/privacy.yaml` measures the same
inside whole runs. Timings on a shared machine say little: re-measure on a quiet one.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Sequence

import numpy as np

from rayfl.algorithms.base import Reply
from rayfl.algorithms.functional import payload_nbytes
from rayfl.privacy import dp
from rayfl.privacy.hook import PrivacyHook
from rayfl.schema import DPConfig, PrivacyConfig, SecAggConfig

VARIANTS = {
    "dp": PrivacyConfig(dp=DPConfig(enabled=True)),
    "secagg": PrivacyConfig(secagg=SecAggConfig(enabled=True)),
    "secagg_drop30%": PrivacyConfig(secagg=SecAggConfig(enabled=True, dropout=0.3)),
    "secagg_dp": PrivacyConfig(dp=DPConfig(enabled=True), secagg=SecAggConfig(enabled=True)),
}


def measure(cfg: PrivacyConfig, clients: int, size: int) -> dict[str, float]:
    hook = PrivacyHook(cfg, "weighted_mean", seed=0, num_clients=clients, per_round=clients)
    rng = np.random.default_rng(0)
    sent = {"w": np.zeros(size, np.float32)}
    replies, protect_s = [], []
    for c in range(clients):
        upload = {"w": rng.normal(0, 0.01, size).astype(np.float32)}
        start = time.perf_counter()
        payload = hook.protect(upload, sent, 1, c, 100)
        protect_s.append(time.perf_counter() - start)
        replies.append(Reply(c, "a", 100, payload))
    start = time.perf_counter()
    hook.combine(replies, 1, {"a": sent})
    return {
        "bytes_up": float(max(payload_nbytes(r.payload) for r in replies)),
        "protect_s": float(np.mean(protect_s)),
        "combine_s": time.perf_counter() - start,
        "dropped": float(sum(not r.payload for r in replies)),
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="privacy protocol overhead")
    parser.add_argument("--clients", type=int, default=10)
    parser.add_argument("--size", type=int, default=142_000, help="floats per upload")
    args = parser.parse_args(argv)
    plain = 4 * args.size
    # the accountant's one-time import is not the protocol's cost
    dp.epsilon(1.0, 1, 1e-5, num_clients=2, per_round=1)
    lines = [
        f"{args.clients} clients, {args.size} floats per upload (plain float32: {plain} bytes)",
        f"  {'variant':15s} {'bytes up':>10s} {'x plain':>7s} {'protect s':>10s} {'combine s':>10s} {'dropped':>7s}",
    ]
    for label, cfg in VARIANTS.items():
        r = measure(cfg, args.clients, args.size)
        lines.append(
            f"  {label:15s} {r['bytes_up']:10.0f} {r['bytes_up'] / plain:7.2f} {r['protect_s']:10.3f} "
            f"{r['combine_s']:10.3f} {r['dropped']:7.0f}"
        )
    print("\n".join(lines))  # noqa: T201 (a command-line report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
