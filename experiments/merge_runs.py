"""Merge the `runs.csv` of suites run in pieces (one `rayfl compare` per setting and seed) into
the markdown tables of docs/results.md: mean ± sample std over seeds, accuracies in %.

    python3 experiments/merge_runs.py docs/results/pf_*.runs.csv
    python3 experiments/merge_runs.py docs/results/fd_*.runs.csv

The statistics are `rayfl.compare.aggregate`'s, the ones `rayfl compare` prints for one call.
"""

from __future__ import annotations

import csv
import sys
from typing import Any

from rayfl.compare import aggregate, mean_col, std_col

COLUMNS = [  # (metric, header): shown when any run of the table reports the metric
    ("personal/acc", "personal/acc (%)"),
    ("personal/acc_mean", "mean over clients"),
    ("personal/acc_worst10", "worst 10%"),
    ("global/acc", "global/acc (%)"),
    ("meme/acc", "FML meme acc (%)"),
    ("mentee/acc", "FedKD mentee acc (%)"),
    ("proxy/acc", "global proxy acc (%)"),
    ("pfedes/proxy_acc", "pfedes/proxy_acc (%)"),
]


def _number(text: str) -> Any:
    try:
        return float(text)
    except ValueError:
        return text or None


def read_rows(paths: list[str]) -> list[dict[str, Any]]:
    rows = []
    for path in paths:
        with open(path, newline="") as f:
            rows += [{k: _number(v) for k, v in row.items()} for row in csv.DictReader(f)]
    for row in rows:
        row["setting"] = str(row["setting"] or "")
        row["seed"] = int(row["seed"])
    return rows


def cell(agg: dict[str, Any], metric: str) -> str:
    mean = agg.get(mean_col(metric))
    if mean is None:
        return "–"
    std = agg.get(std_col(metric)) or 0.0
    return f"{100 * mean:.1f} ± {100 * std:.1f}"


def tables(rows: list[dict[str, Any]]) -> str:
    seeds: dict[tuple[str, str], list[int]] = {}
    for row in rows:
        if row["status"] == "FINISHED":
            seeds.setdefault((row["setting"], row["label"]), []).append(row["seed"])
    results = aggregate(rows)
    out = []
    for setting in dict.fromkeys(r["setting"] for r in results):
        group = [r for r in results if r["setting"] == setting]
        shown = [(m, h) for m, h in COLUMNS if any(mean_col(m) in r for r in group)]
        archs = sorted(
            {
                k[len("personal/acc/arch=") : -len(" [mean]")]
                for r in group
                for k in r
                if k.startswith("personal/acc/arch=") and k.endswith(" [mean]")
            }
        )
        shown += [(f"personal/acc/arch={a}", a) for a in archs]
        out += [f"**{setting}**", ""] if setting else []
        out.append("| method | seeds | " + " | ".join(h for _, h in shown) + " |")
        out.append("|---|---|" + "---|" * len(shown))
        for r in group:
            done = ",".join(str(s) for s in sorted(seeds.get((setting, r["label"]), [])))
            cells = " | ".join(cell(r, m) for m, _ in shown)
            out.append(f"| {r['label']} | {r['seeds']} ({done}) | {cells} |")
        out.append("")
    return "\n".join(out)


if __name__ == "__main__":
    if len(sys.argv) < 2:
        sys.exit("usage: python3 experiments/merge_runs.py RUNS.csv [RUNS.csv ...]")
    print(tables(read_rows(sys.argv[1:])))
