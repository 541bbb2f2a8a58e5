"""A suite's results: one row per run, mean and std over seeds, the printed and HTML tables."""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from rayfl.compare.suite import Suite, SuiteRun
from rayfl.tables import text_table

PERSONAL = "personal/acc"
# the test accuracy at the round chosen on validation (`rayfl.engine.metrics.at_best_val`)
AT_BEST_VAL = "at_best_val/personal/acc"
ARCH_PREFIX = "personal/acc/arch="
DOMAIN_PREFIX = "personal/acc/domain="  # a federation with domains (`data.domains`)
ID_COLUMNS = (
    "setting",
    "label",
    "algorithm",
    "seed",
    "status",
    "rounds",
    "run_dir",
    "mlflow_run_id",
    "error",
)


def run_row(
    run: SuiteRun,
    run_dir: Path,
    wall_s: float,
    status: str,
    final: Mapping[str, Any] | None = None,
    rounds: int = 0,
    run_id: str | None = None,
) -> dict[str, Any]:
    """One run's row of runs.parquet: who it is (`ID_COLUMNS`), its final metrics, its
    communication per round and wall time."""
    final = final or {}
    up = final.get("comm/bytes_up_total", 0.0) / max(1, rounds) / 1e6
    down = final.get("comm/bytes_down_total", 0.0) / max(1, rounds) / 1e6
    ids = (run.setting, run.label, run.config.algorithm.name, run.seed, status, rounds)
    row: dict[str, Any] = dict(zip(ID_COLUMNS, (*ids, str(run_dir), run_id or "", "")))
    # summary.json keeps a non-finite metric (a diverged loss) as null: NaN again here
    nan = float("nan")
    row.update(
        {k: nan if v is None else float(v) for k, v in sorted(final.items()) if k != "round"}
    )
    row["comm/mb_up_per_round"] = up
    row["comm/mb_down_per_round"] = down
    row["comm/mb_per_round"] = up + down
    row["time/wall_s"] = wall_s
    return row


def failed_row(
    run: SuiteRun, run_dir: Path, exc: BaseException, wall_s: float = 0.0
) -> dict[str, Any]:
    """The row of a run that failed (or whose trial died): FAILED, with the error's first line."""
    error = f"{type(exc).__name__}: {exc}".splitlines()[0][:500]
    return {**run_row(run, run_dir, wall_s, "FAILED"), "error": error}


def mean_col(metric: str) -> str:
    """Column of the mean over seeds of `metric` in results.parquet: `personal/acc [mean]`."""
    return f"{metric} [mean]"


def std_col(metric: str) -> str:
    """Column of the sample std over seeds (empty with one seed): `personal/acc [std]`."""
    return f"{metric} [std]"


def aggregate(rows: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Mean and sample std (ddof=1; None for one seed) over the finished seeds of every metric.

    Returns one row per (setting, label), in first-seen order, with `<metric> [mean]` and
    `<metric> [std]` columns, `seeds` (finished runs it averages) and `failed` (runs that failed).
    """
    groups: dict[tuple[str, str], list[Mapping[str, Any]]] = defaultdict(list)
    for row in rows:
        groups[(row["setting"], row["label"])].append(row)
    out: list[dict[str, Any]] = []
    for (setting, label), members in groups.items():
        done = [m for m in members if m.get("status", "FINISHED") == "FINISHED"]
        agg: dict[str, Any] = {
            "setting": setting,
            "label": label,
            "algorithm": members[0]["algorithm"],
            "seeds": len(done),
            "failed": len(members) - len(done),
        }
        metrics = sorted({k for m in done for k in m if k not in ID_COLUMNS})
        for key in metrics:
            values = np.array(
                [float(m[key]) for m in done if m.get(key) is not None], dtype=np.float64
            )
            values = values[~np.isnan(values)]
            if len(values) == 0:
                continue
            agg[mean_col(key)] = float(values.mean())
            agg[std_col(key)] = float(values.std(ddof=1)) if len(values) > 1 else None
        out.append(agg)
    return out


def curves_and_spread(
    histories: Mapping[str, Sequence[Sequence[Mapping[str, float]]]], key: str
) -> tuple[dict[str, list[tuple[int, float]]], dict[str, list[tuple[int, float]]]]:
    """Per label, `(round, mean)` and `(round, std)` over seeds of `key` at each round where any
    seed has it (sample std, ddof=1; no std where one seed has the round): what
    `plot_compare(means, ..., spread=stds)` draws."""
    means: dict[str, list[tuple[int, float]]] = {}
    stds: dict[str, list[tuple[int, float]]] = {}
    for label, runs in histories.items():
        by_round: dict[int, list[float]] = defaultdict(list)
        for history in runs:
            for row in history:
                value = row.get(key)
                if value is not None and math.isfinite(value):
                    by_round[int(row["round"])].append(float(value))
        rounds = sorted(by_round.items())
        means[label] = [(r, float(np.mean(v))) for r, v in rounds]
        stds[label] = [(r, float(np.std(v, ddof=1))) for r, v in rounds if len(v) > 1]
    return means, stds


def _pm(agg: Mapping[str, Any], key: str, fmt: str = "{:.4f}") -> str:
    """`mean ± std` over seeds, or the plain value when only one seed ran."""
    mean = agg.get(mean_col(key))
    if mean is None:
        return "-"
    std = agg.get(std_col(key))
    spread = fmt.replace("+", "")  # a sign on the mean (a gain), never on the spread
    return fmt.format(mean) if std is None else f"{fmt.format(mean)} ± {spread.format(std)}"


def server_acc_keys(agg: Mapping[str, Any]) -> list[str]:
    """`<model>/acc` metrics of server-side models (global, proxy, meme, mentee, ...)."""
    keys = [k[: -len(mean_col(""))] for k in agg if k.endswith(mean_col("/acc"))]
    return sorted(k for k in keys if k.count("/") == 1 and k != PERSONAL)


PROTOCOLS = {
    "deployed": "every client, after the server step, with the model it would deploy",
    "after_fit": "the round's participants, right after local training",
}


def protocol_line(suite: Suite) -> str:
    """Which evaluation protocol (`eval.protocol`) made a suite's personalized accuracies."""
    used = sorted({run.config.eval.protocol for run in suite.runs})
    return "evaluation protocol: " + "; ".join(f"{p} ({PROTOCOLS[p]})" for p in used)


GAIN = "baseline/gain_points"
FEDERATED_GAIN = "baseline/federated_gain_points"  # over the no-federation control


def table_rows(results: Sequence[Mapping[str, Any]]) -> tuple[list[str], list[list[str]]]:
    """The comparison as (header, rows) of text cells, shared by the printed table and the HTML
    report: personalized accuracy (last round, and at the round chosen on validation when the
    clients have a validation split; never a round chosen on test data), gain over local (when
    measured), server-side models' accuracy, communication, wall time, runs."""
    gain = any(mean_col(GAIN) in r for r in results)
    val = any(mean_col(AT_BEST_VAL) in r for r in results)
    header = ["algorithm", "personal acc (last round)"]
    header += ["personal acc (best-val round)"] if val else []
    header += ["gain over local (pts)"] if gain else []
    fed = any(mean_col(FEDERATED_GAIN) in r for r in results)
    header += ["federated gain (pts)"] if fed else []
    header += ["server model acc", "MB/round up+down", "wall s/run", "runs"]
    body = []
    for agg in results:
        measured = [k for k in server_acc_keys(agg) if agg.get(mean_col(k)) is not None]
        server = ", ".join(f"{k.split('/')[0]} {_pm(agg, k)}" for k in measured) or "-"
        runs = f"{agg['seeds']}" + (f" ({agg['failed']} FAILED)" if agg.get("failed") else "")
        body.append(
            [
                agg["label"],
                _pm(agg, PERSONAL),
                *([_pm(agg, AT_BEST_VAL)] if val else []),
                *([_pm(agg, GAIN, "{:+.2f}")] if gain else []),
                *([_pm(agg, FEDERATED_GAIN, "{:+.2f}")] if fed else []),
                server,
                _pm(agg, "comm/mb_per_round", "{:.3f}"),
                _pm(agg, "time/wall_s", "{:.1f}"),
                runs,
            ]
        )
    return header, body


def arch_rows(
    results: Sequence[Mapping[str, Any]], prefix: str = ARCH_PREFIX
) -> tuple[list[str], list[list[str]]]:
    """Personalized accuracy per architecture group (or per domain, with `DOMAIN_PREFIX`) as
    (header, rows); no columns when none."""
    suffix = mean_col("")
    archs = sorted(
        {
            k[len(prefix) : -len(suffix)]
            for r in results
            for k in r
            if k.startswith(prefix) and k.endswith(suffix)
        }
    )
    if not archs:
        return [], []
    body = [[agg["label"], *(_pm(agg, prefix + a) for a in archs)] for agg in results]
    return ["algorithm", *archs], body


def format_results(
    suite: Suite,
    results: Sequence[Mapping[str, Any]],
    wall_s: float,
    failed: Sequence[Mapping[str, Any]] = (),
) -> str:
    """The printed comparison: one table per setting, accuracy per architecture group, and the
    runs that failed with their errors."""
    spread = "mean ± std over seeds" if len(suite.seeds) > 1 else "one seed"
    lines = [
        f"suite {suite.name}: {len(suite.runs)} runs ({len(suite.labels)} algorithms x {len(suite.seeds)} seeds"
        f"{f' x {len(suite.settings)} settings' if suite.settings != [''] else ''}); "
        f"final round, {spread} {suite.seeds}; wall time {wall_s:.0f} s",
        protocol_line(suite),
    ]
    for setting in suite.settings:
        rows = [r for r in results if r["setting"] == setting]
        if not rows:
            continue
        lines.append("")
        if setting:
            lines.append(f"setting {setting}")
        lines += text_table(*table_rows(rows))
        for prefix, what in ((ARCH_PREFIX, "architecture group"), (DOMAIN_PREFIX, "domain")):
            header, body = arch_rows(rows, prefix)
            if header:
                lines.append("")
                lines.append(f"  personalized accuracy per {what}")
                lines += text_table(header, body)
    if failed:
        lines.append("")
        lines.append(f"  {len(failed)} run(s) FAILED (rerun the same command to retry them):")
        for row in failed:
            lines.append(f"    {row['run_dir']}: {row['error']}")
    return "\n".join(lines)
