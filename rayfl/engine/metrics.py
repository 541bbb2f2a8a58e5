"""The metrics papers report beside the personalized accuracy: the confidence interval of the
client mean, the round chosen on validation, the rounds, bytes and seconds to a target accuracy,
and the per-client table (`clients.parquet`). The round loop (`rayfl.engine.loop`) calls them."""

from __future__ import annotations

from typing import Any

import numpy as np

from rayfl.data.federated import Federation
from rayfl.engine.worker import ClientMetrics

# Prefix of the metrics of the round chosen on validation (`at_best_val`).
AT_BEST_VAL = "at_best_val/"


def at_best_val(history: list[dict[str, float]]) -> dict[str, float]:
    """The evaluated round with the highest `personal/val_acc` (the earliest on ties) and its
    personalized and server metrics, prefixed `at_best_val/`: the round a paper may report as
    "best", chosen on validation data only. Empty without a validation split. No metric is ever
    chosen on test data."""
    scored = [r for r in history if np.isfinite(r.get("personal/val_acc", float("nan")))]
    if not scored:
        return {}
    best = max(scored, key=lambda r: (r["personal/val_acc"], -r["round"]))
    keep = [
        k for k in best if k.startswith("personal/") or (k.endswith("/acc") and k.count("/") == 1)
    ]
    out = {AT_BEST_VAL + "round": best["round"]}
    out.update({AT_BEST_VAL + k: best[k] for k in sorted(keep)})
    return out


def target_key(kind: str, target: float) -> str:
    """`rounds_to/acc_0.8`-style key of `eval.targets`' metrics (`kind`: rounds, bytes, seconds)."""
    return f"{kind}_to/acc_{target:g}"


def reached_targets(
    targets: tuple[float, ...], row: dict[str, float], history: list[dict[str, float]]
) -> dict[str, float]:
    """For each target accuracy first reached by `row`'s `personal/acc` (not by any round of
    `history` before it): the round, the cumulative bytes (up + down) and the seconds of rounds
    (sum of `time/round_s`, start-up excluded) it took."""
    acc = row.get("personal/acc", float("nan"))
    out: dict[str, float] = {}
    for t in targets:
        key = target_key("rounds", t)
        if not acc >= t or any(key in r for r in history):
            continue
        out[key] = row["round"]
        out[target_key("bytes", t)] = row["comm/bytes_up_total"] + row["comm/bytes_down_total"]
        out[target_key("seconds", t)] = sum(r["time/round_s"] for r in (*history, row))
    return out


def weighted_mean(rows: list[ClientMetrics], key: str, weight: str) -> float:
    """`key` averaged over `rows` weighted by `weight` (NaN where no row has a sample)."""
    v = np.array([r[key] for r in rows], dtype=np.float64)
    w = np.array([r[weight] for r in rows], dtype=np.float64)
    keep = w > 0
    return float((v[keep] * w[keep]).sum() / w[keep].sum()) if keep.any() else float("nan")


def t975(df: int) -> float:
    """Student's t 97.5% quantile for `df` degrees of freedom: exact for 1 and 2, else the
    Cornish-Fisher expansion (Abramowitz & Stegun 26.7.5), within 0.004 at 3 and 1e-6 from 19."""
    if df <= 2:
        return (12.706204736174694, 4.302652729749462)[df - 1]
    z, v = 1.959963984540054, float(df)
    return (
        z
        + (z**3 + z) / (4 * v)
        + (5 * z**5 + 16 * z**3 + 3 * z) / (96 * v**2)
        + (3 * z**7 + 19 * z**5 + 17 * z**3 - 15 * z) / (384 * v**3)
        + (79 * z**9 + 776 * z**7 + 1482 * z**5 - 1920 * z**3 - 945 * z) / (92160 * v**4)
    )


def ci95(values: np.ndarray) -> float:
    """Half-width of the 95% confidence interval of the mean of `values` over clients (Student's
    t, sample std): `personal/acc_mean ± ci95`. NaN for fewer than two clients."""
    n = len(values)
    if n < 2:
        return float("nan")
    return float(t975(n - 1) * values.std(ddof=1) / np.sqrt(n))


CLIENT_COLUMNS = (
    "round",
    "client",
    "arch",
    "domain",
    "num_train",
    "num_test",
    "acc",
    "loss",
    "num_val",
    "val_acc",
    "val_loss",
)


def per_client_rows(fed: Federation, rnd: int, scored: list[ClientMetrics]) -> list[dict[str, Any]]:
    """One row per scored client of round `rnd` (`CLIENT_COLUMNS`, in client order): the per-client
    table a paper's per-client results and spreads come from. `domain` is the client's domain
    where the federation has domains (`Federation.client_domain`), else None."""
    domains = fed.client_domain
    out = []
    for r in sorted(scored, key=lambda r: r["client"]):
        cid = int(r["client"])
        row: dict[str, Any] = {
            "round": rnd,
            "client": cid,
            "arch": r["arch"],
            "domain": None if domains is None else str(domains[cid]),
            "num_train": len(fed.clients[cid].train),
        }
        row.update({k: float(r[k]) if k in r else None for k in CLIENT_COLUMNS[5:]})
        for k in ("num_test", "num_val"):
            row[k] = None if row[k] is None else int(row[k])
        out.append(row)
    return out
