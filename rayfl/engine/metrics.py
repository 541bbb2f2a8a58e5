"""A round's metrics: the personalized accuracy over clients (`summarize_clients`: weighted,
per architecture and domain, against the local and no-federation references), the confidence
interval of the client mean, the round chosen on validation, the rounds, bytes and seconds to a
target accuracy, and the per-client table (`clients.parquet`). The round loop
(`rayfl.engine.loop`) calls them."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from typing import Any

import numpy as np

from rayfl.data.federated import Federation
from rayfl.engine.worker import ClientMetrics

# Prefix of the metrics of the round chosen on validation (`at_best_val`).
AT_BEST_VAL = "at_best_val/"

# What a client's evaluation row keeps while its deployed model is unchanged: the model's score,
# not the algorithm's diagnostics against the payload it was scored with (`_evaluate_deployed`).
SCORE_KEYS = frozenset(
    {
        "client",
        "arch",
        "acc",
        "loss",
        "num_test",
        "val_acc",
        "val_loss",
        "num_val",
        "baseline_acc",
        "control_acc",
    }
)


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


def summarize_clients(
    rows: list[ClientMetrics],
    evaluated: list[ClientMetrics] | None = None,
    client_domain: Sequence[str] | None = None,
) -> dict[str, float]:
    """Personalized accuracy (sample-weighted, mean, std, worst 10%, 95% confidence interval
    over clients), per architecture, per domain; the test loss; the validation accuracy and loss
    when the clients have a validation split; the algorithm's extras.

    `rows` are the participants' fit rows (training metrics, and accuracy under `after_fit`);
    `evaluated`, when given, are the evaluation phase's rows (`deployed`) and the only ones scored;
    `client_domain`, when given, each client's domain (`Federation.client_domain`).
    """
    out: dict[str, float] = {}
    # completion order varies with workers; summing in client order keeps every bit the same
    rows = sorted(rows, key=lambda r: r["client"])
    if evaluated is None:
        scored = [r for r in rows if "acc" in r]
    else:
        scored = sorted(evaluated, key=lambda r: r["client"])
        out["eval/clients"] = float(len(scored))
    if scored:
        acc = np.array([r["acc"] for r in scored])
        n = np.array([r["num_test"] for r in scored])
        out["personal/acc"] = float((acc * n).sum() / n.sum())
        out["personal/acc_mean"] = float(acc.mean())
        out["personal/acc_std"] = float(acc.std())
        k = max(1, int(np.ceil(0.1 * len(acc))))
        out["personal/acc_worst10"] = float(np.sort(acc)[:k].mean())
        out["personal/acc_ci95"] = ci95(acc)
        if all("loss" in r for r in scored):
            out["personal/loss"] = weighted_mean(scored, "loss", "num_test")
        if all("val_acc" in r for r in scored):
            out["personal/val_acc"] = weighted_mean(scored, "val_acc", "num_val")
            out["personal/val_loss"] = weighted_mean(scored, "val_loss", "num_val")
        by_arch: dict[str, list[tuple[float, float]]] = defaultdict(list)
        for r in scored:
            by_arch[r["arch"]].append((r["acc"], r["num_test"]))
        for arch, pairs in sorted(by_arch.items()):
            a, w = np.array(pairs).T
            out[f"personal/acc/arch={arch}"] = float((a * w).sum() / w.sum())
        if client_domain is not None:
            out.update(_domain_summary(scored, client_domain))
        if all("baseline_acc" in r for r in scored):
            out.update(_baseline_summary(scored, out["personal/acc"]))
        if all("control_acc" in r for r in scored):
            out.update(_baseline_summary(scored, out["personal/acc"], "control_acc"))
        skip = set(SCORE_KEYS) | {"num_train"}
        skip |= {"train_s", "bytes_up"}
        extras = {k for r in scored for k in r if k not in skip and not k.startswith("train/")}
        for key in sorted(extras):
            vals = [(r[key], r["num_test"]) for r in scored if key in r]
            v, w = np.array(vals).T
            out[key] = float((v * w).sum() / w.sum())
    train_keys = sorted({k for r in rows for k in r if k.startswith("train/")})
    for key in train_keys:
        vals = [(r[key], r["num_train"]) for r in rows if key in r]
        v, w = np.array(vals).T
        out[key] = float((v * w).sum() / w.sum())
    out["time/train_s_sum"] = float(sum(r["train_s"] for r in rows))
    return out


def _domain_summary(scored: list[ClientMetrics], client_domain: Sequence[str]) -> dict[str, float]:
    """`personal/acc/domain=<name>` (weighted like `personal/acc`) per domain scored, and the
    worst of them, `personal/acc_worst_domain`."""
    by_domain: dict[str, list[tuple[float, float]]] = defaultdict(list)
    for r in scored:
        by_domain[client_domain[int(r["client"])]].append((r["acc"], r["num_test"]))
    out: dict[str, float] = {}
    for name, pairs in sorted(by_domain.items()):
        a, w = np.array(pairs).T
        out[f"personal/acc/domain={name}"] = float((a * w).sum() / w.sum())
    out["personal/acc_worst_domain"] = min(out.values())
    return out


def _baseline_summary(
    scored: list[ClientMetrics], personal_acc: float, key: str = "baseline_acc"
) -> dict[str, float]:
    """A reference's accuracy, weighted exactly like `personal/acc`, per architecture, and the
    gain over it in points: the local-only shadows' (`baseline_acc`: equals what
    `algorithm.name=local` reports) or the no-federation controls' (`control_acc`)."""
    name, gain = (
        ("local_acc", "gain_points")
        if key == "baseline_acc"
        else ("control_acc", "federated_gain_points")
    )
    b = np.array([r[key] for r in scored])
    n = np.array([r["num_test"] for r in scored])
    ref = float((b * n).sum() / n.sum())
    out = {f"baseline/{name}": ref, f"baseline/{gain}": 100.0 * (personal_acc - ref)}
    for arch in sorted({r["arch"] for r in scored}):
        mask = np.array([r["arch"] == arch for r in scored])
        out[f"baseline/{name}/arch={arch}"] = float((b[mask] * n[mask]).sum() / n[mask].sum())
    return out
