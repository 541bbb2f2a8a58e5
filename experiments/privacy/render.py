"""Render the privacy study (experiments/privacy/study.py) from its per-run JSON files: the
markdown fragment docs/results/privacy/section.md and the plot docs/results/privacy/acc_vs_eps.png.

    python3 experiments/privacy/render.py [--runs docs/results/privacy/runs]

Accuracy is personalized accuracy (every client's deployed model on its own test split) after the
last round, mean +- sample std over the seeds that finished; epsilon is the run's final
`privacy/epsilon` (the same for every seed of a setting).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
from collections import defaultdict
from pathlib import Path
from typing import Any

from privacy_report import save_epsilon_plot  # this folder: scripts run as files

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "docs" / "results" / "privacy"


def load(runs: Path) -> dict[str, list[dict[str, Any]]]:
    by_label: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for path in sorted(runs.glob("*.json")):
        run = json.loads(path.read_text())
        if run.get("status") == "FINISHED":
            by_label[run["label"]].append(run)
    return by_label


def describe(run: dict[str, Any]) -> dict[str, Any]:
    cfg = run["config"]
    algo, privacy = cfg["algorithm"], cfg.get("privacy", {})
    dp, sa = privacy.get("dp", {}), privacy.get("secagg", {})
    name = algo["name"] if algo["name"] != "pfedes" else f"pfedes-{algo.get('variant')}"
    names = {
        "fedavg": "FedAvg (model update)",
        "pfedes-stats": "pFedES stats-only",
        "pfedes-kd": "pFedES proxy (kd, beta 0.5)",
    }
    parts = [names.get(name, name)]
    if dp.get("enabled"):
        parts.append(f"DP clip {dp['clip']:g}")
    if sa.get("enabled"):
        parts.append(f"SecAgg, dropout {sa.get('dropout', 0):g}")
    eps = run["final"].get("privacy/epsilon")
    return {
        "setting": ", ".join(parts),
        "z": dp["noise_multiplier"] if dp.get("enabled") else None,
        "epsilon": math.inf if eps is None else float(eps),
        "delta": dp.get("delta"),
        "dp": bool(dp.get("enabled")),
        "algo": name,
    }


def mean_std(values: list[float]) -> tuple[float, float]:
    return statistics.fmean(values), (statistics.stdev(values) if len(values) > 1 else math.nan)


def pct(m: float, s: float) -> str:
    return f"{100 * m:.1f} ± {100 * s:.1f}" if not math.isnan(s) else f"{100 * m:.1f}"


def rows(by_label: dict[str, list[dict[str, Any]]]) -> list[dict[str, Any]]:
    out = []
    for label, runs in by_label.items():
        d = describe(runs[0])
        accs = [r["final"]["personal/acc"] for r in runs]
        dropped = [r["final"].get("privacy/dropped") for r in runs]
        d.update(label=label, seeds=sorted(r["seed"] for r in runs), acc=mean_std(accs))
        secagg = runs[0]["config"].get("privacy", {}).get("secagg", {}).get("enabled")
        d["dropped"] = None if None in dropped or not secagg else statistics.fmean(dropped)
        out.append(d)
    return sorted(out, key=lambda d: (d["algo"], d["dp"], -d["epsilon"], d["setting"]))


def baseline(by_label: dict[str, list[dict[str, Any]]]) -> tuple[float, float, int] | None:
    values = [
        r["final"]["baseline/local_acc"]
        for runs in by_label.values()
        for r in runs
        if "baseline/local_acc" in r["final"]
    ]
    return (*mean_std(values), len(values)) if values else None


def markdown(table: list[dict[str, Any]], local: tuple[float, float, int] | None, cfg: dict) -> str:
    data, engine = cfg["data"], cfg["engine"]
    local_txt = f"{pct(local[0], local[1])} (seeds: {local[2]})" if local else "-"
    deltas = sorted({d["delta"] for d in table if d["dp"]})
    per_round = engine["clients_per_round"] or engine["fraction"] * data["num_clients"]
    q = per_round / data["num_clients"]
    lines = [
        f"Fashion-MNIST ({data.get('train_samples') or 60000} of the 60000 training images), "
        f"{data['num_clients']} clients "
        f"(Dirichlet {data['partition']['alpha']:g}), mlp, {engine['rounds']} rounds, "
        f"{engine['sampling']} client sampling at q = {q:g}, 1 local epoch; "
        f"personalized accuracy (%) after the last round, mean ± std over seeds; epsilon at "
        f"delta = {', '.join(f'{x:g}' for x in deltas) or '-'} for the sampling that ran "
        "(dp-accounting RDP). Local-only baseline (every client trains alone, same partition "
        f"and seeds): {local_txt}.",
        "",
        "| setting | z | epsilon | personal/acc (%) | seeds | local baseline (%) | gain over local "
        "(points) | SecAgg dropped (last round) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for d in table:
        eps = "inf (no DP)" if math.isinf(d["epsilon"]) else f"{d['epsilon']:.2f}"
        z = "-" if d["z"] is None else f"{d['z']:g}"
        dropped = "-" if d["dropped"] is None else f"{d['dropped']:.1f}"
        gain = f"{100 * (d['acc'][0] - local[0]):+.1f}" if local else "-"
        lines.append(
            f"| {d['setting']} | {z} | {eps} | {pct(*d['acc'])} | {len(d['seeds'])} | "
            f"{local_txt if local else '-'} | {gain} | {dropped} |"
        )
    lines += [
        "",
        "Regenerate: `PYTHONPATH=$PWD nice -n 19 python3 experiments/privacy/study.py --jobs 3` "
        "(skips runs already in docs/results/privacy/runs/), then "
        "`python3 experiments/privacy/render.py`. DP noise is fresh per run "
        "(`privacy.dp.noise_seed` unset): seeds differ in data split, sampling and noise, and a "
        "rerun draws new noise (its DP numbers move within the spread shown). "
        "Leaves out: the other 40k training images and longer training (cost on a shared 2-core "
        "machine); SecAgg dropout is measured on the statistics channel only (masking 235k-float "
        "updates of about 60 participants costs gigabytes of ChaCha20 keystream a round); "
        "`privacy/epsilon` is an upper bound from RDP (PLD is tighter).",
    ]
    return "\n".join(lines) + "\n"


def plot(table: list[dict[str, Any]], local: tuple[float, float, int] | None, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    labels = {
        "fedavg": "FedAvg + DP",
        "pfedes-stats": "pFedES stats-only + DP",
        "pfedes-kd": "pFedES proxy + DP",
    }
    for algo, marker in (("fedavg", "o"), ("pfedes-stats", "s"), ("pfedes-kd", "^")):
        pts = sorted((d["epsilon"], *d["acc"]) for d in table if d["algo"] == algo and d["dp"])
        if pts:
            xs, ms, ss = zip(*pts)
            ss = [0.0 if math.isnan(s) else s for s in ss]
            ax.errorbar(xs, ms, yerr=ss, marker=marker, capsize=3, label=labels[algo])
    colors = iter(plt.get_cmap("Dark2").colors)
    for d in table:
        if not d["dp"] and "SecAgg" not in d["setting"]:
            m, s = d["acc"]
            c = next(colors)
            ax.axhline(m, color=c, ls="--", label=f"{d['setting']}, no DP")
            if not math.isnan(s):
                ax.axhspan(m - s, m + s, color=c, alpha=0.12)
    if local:
        ax.axhline(local[0], color="k", ls=":", label="local training only")
        if not math.isnan(local[1]):
            ax.axhspan(local[0] - local[1], local[0] + local[1], color="k", alpha=0.08)
    save_epsilon_plot(
        fig,
        ax,
        out,
        "epsilon (client-level, Poisson sampling, RDP)",
        "personal/acc (mean ± std over seeds)",
        "Fashion-MNIST, 200 clients: accuracy vs privacy budget",
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=Path, default=RESULTS / "runs")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    by_label = load(args.runs)
    if not by_label:
        parser.error(f"no finished run in {args.runs}")
    table, local = rows(by_label), baseline(by_label)
    cfg = next(iter(by_label.values()))[0]["config"]
    text = markdown(table, local, cfg)
    (args.out / "section.md").write_text(text)
    plot(table, local, args.out / "acc_vs_eps.png")
    print(text)  # noqa: T201 (a command-line script)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
