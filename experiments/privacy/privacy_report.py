"""The privacy-utility report: personalized accuracy against epsilon for the DP sweep's trials,
beside reference runs (no protection, SecAgg, statistics-only upload), as a plot and a Markdown
table. Reads run directories' `summary.json` (what every run writes), so it needs no MLflow.

    python3 experiments/privacy/privacy_report.py runs/sweeps/pfedes_privacy/trials \\
        --ref plain=runs/privacy/plain --ref secagg=runs/privacy/secagg \\
        --out docs/figures/privacy_acc_vs_epsilon.png
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rayfl.engine.rundir import read_summary
from rayfl.errors import UserError

ACC = "personal/acc"
EPS = "privacy/epsilon"


def read_run(run_dir: Path) -> dict[str, Any] | None:
    """`{noise, alpha, clip, variant, acc, epsilon, rounds}` of a finished run, or None; a
    UserError for a `summary.json` the gate refuses or rayfl did not write (untrusted input)."""
    summary = read_summary(run_dir)  # {} when there is none (an unfinished trial)
    if not summary:
        return None
    try:
        return _row(run_dir, summary)
    except (KeyError, TypeError, AttributeError, ValueError):
        raise UserError(
            f"{run_dir / 'summary.json'}: not a summary rayfl wrote (a key is missing or of the "
            "wrong type); restore it or leave the run out"
        ) from None


def _row(run_dir: Path, summary: Any) -> dict[str, Any]:
    cfg, final = summary["config"], summary["final"]
    dp = cfg.get("privacy", {}).get("dp", {})
    return {
        "run": run_dir.name,
        "variant": cfg["algorithm"].get("variant", "-"),
        "alpha": cfg["algorithm"].get("alpha"),
        "noise": dp.get("noise_multiplier") if dp.get("enabled") else None,
        "clip": dp.get("clip") if dp.get("enabled") else None,
        "secagg": bool(cfg.get("privacy", {}).get("secagg", {}).get("enabled")),
        "acc": final.get(ACC),
        # summary.json writes inf as null; no DP at all is epsilon = inf too
        "epsilon": math.inf if final.get(EPS) is None else float(final[EPS]),
        "rounds": summary["rounds"],
        "status": summary["status"],
    }


def markdown(trials: Sequence[dict[str, Any]], refs: dict[str, dict[str, Any]]) -> str:
    lines = [
        "| run | protection | alpha | noise multiplier | epsilon | personal/acc |",
        "|---|---|---|---|---|---|",
    ]
    rows = [(label, r, r["noise"] or "-") for label, r in refs.items()]
    trials = sorted(trials, key=lambda r: (r["alpha"], r["noise"] or 0))
    rows += [(r["run"], r, r["noise"]) for r in trials]
    for label, r, noise in rows:
        lines.append(
            f"| {label} | {_protection(r)} | {r['alpha']} | {noise} | "
            f"{_num(r['epsilon'])} | {_num(r['acc'])} |"
        )
    return "\n".join(lines)


def _protection(r: dict[str, Any]) -> str:
    parts = []
    if r["noise"] is not None:
        parts.append(f"DP (clip {r['clip']})")
    if r["secagg"]:
        parts.append("SecAgg")
    if r["variant"] == "stats":
        parts.append("stats-only upload")
    return " + ".join(parts) or "none"


def _num(v: Any) -> str:
    if v is None:
        return "-"
    return "inf" if isinstance(v, float) and math.isinf(v) else f"{float(v):.4f}"


def plot(trials: Sequence[dict[str, Any]], refs: dict[str, dict[str, Any]], out: Path) -> Path:
    from matplotlib import colormaps
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(6.5, 4.2))  # no pyplot: no global backend or figure registry
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    for alpha in sorted({r["alpha"] for r in trials}):
        pts = sorted(
            (r["epsilon"], r["acc"]) for r in trials if r["alpha"] == alpha and r["acc"] is not None
        )
        if pts:
            xs, ys = zip(*pts)
            ax.plot(xs, ys, marker="o", label=f"DP-FedAvg, alpha={alpha}")
    styles = ["--", ":", "-.", (0, (5, 1)), (0, (1, 1))]
    colors = [colormaps["Dark2"](k) for k in range(8)]
    for i, (label, r) in enumerate(refs.items()):
        if r["acc"] is None:
            continue
        color = colors[i % len(colors)]
        if math.isfinite(r["epsilon"]):  # a DP reference run is a point at its budget
            ax.plot([r["epsilon"]], [r["acc"]], "*", markersize=12, color=color, label=label)
        else:  # no DP: a level line (epsilon is infinite)
            ax.axhline(
                r["acc"], linestyle=styles[i % len(styles)], color=color, label=f"{label} (no DP)"
            )
    xlabel = "epsilon (client-level, at the run's delta)"
    title = "pFedES: personalized accuracy vs privacy budget"
    return save_epsilon_plot(fig, ax, out, xlabel, ACC, title)


def save_epsilon_plot(fig: Any, ax: Any, out: Path, xlabel: str, ylabel: str, title: str) -> Path:
    """Finish an accuracy-vs-epsilon plot (log epsilon axis, legend) and write it to `out`."""
    import matplotlib.pyplot as plt

    ax.set_xscale("log")
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.legend(fontsize=7)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("trials", type=Path, help="folder of the sweep's trial run directories")
    parser.add_argument("--ref", action="append", default=[], help="label=run_dir (repeatable)")
    parser.add_argument("--out", type=Path, required=True, help="the plot (PNG)")
    args = parser.parse_args(argv)
    try:
        return _report(args)
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)  # noqa: T201 (one line, no traceback)
        return 2


def _report(args: argparse.Namespace) -> int:
    # a trial folder that is a symlink is refused, not followed (docs/security.md); stray
    # files beside the trials are skipped
    from rayfl import gate

    with gate.Folder(args.trials) as top:
        folders = [top.path / n for n in top.names() if top.kind(n) in ("dir", "link")]
        for d in folders:
            top.sub(d.name).close()  # a link is refused here, not followed
    trials = [r for d in folders if (r := read_run(d)) is not None]
    refs: dict[str, dict[str, Any]] = {}
    for item in args.ref:
        label, _, path = item.rpartition("=")  # labels may hold "=", run paths rarely do
        run = read_run(Path(path))
        if run is not None:
            refs[label] = run
    plot(trials, refs, args.out)
    print(markdown(trials, refs))  # noqa: T201 (a command-line report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
