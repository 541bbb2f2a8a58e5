"""The report of one run directory (`summary.json`)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from functools import partial
from pathlib import Path
from typing import Any

from rayfl import gate
from rayfl.report.page import (
    MAX_DRAWN,
    arch_bars,
    capped,
    esc,
    figure,
    image,
    is_file,
    page,
    read_history,
    table,
)


def _final_rows(final: Mapping[str, Any], targets: Sequence[Any] = ()) -> list[list[Any]]:
    """The final-metrics table's rows: what the run measured, in a reader's order."""
    rows: list[list[Any]] = []

    def add(label: str, key: str) -> None:
        if key in final and final[key] is not None:
            rows.append([label, final[key]])

    add("personalized accuracy, last round (personal/acc)", "personal/acc")
    if final.get("personal/acc_ci95") is not None:
        mean, ci = final.get("personal/acc_mean", float("nan")), final["personal/acc_ci95"]
        rows.append(["client mean ± 95% confidence interval", f"{mean:.4f} ± {ci:.4f}"])
    add("validation accuracy, last round (personal/val_acc)", "personal/val_acc")
    if final.get("at_best_val/round") is not None:
        chosen = f"personalized accuracy at the best validation round ({int(final['at_best_val/round'])})"
        add(chosen, "at_best_val/personal/acc")
    for key in ("personal/loss", "personal/val_loss"):
        add(key, key)
    for target in targets:
        t = f"{float(target):g}"
        rounds, b = final.get(f"rounds_to/acc_{t}"), final.get(f"bytes_to/acc_{t}")
        sec = final.get(f"seconds_to/acc_{t}")
        reached = "not reached"
        if rounds is not None:
            reached = f"round {rounds:g}, {(b or 0) / 1e6:.2f} MB, {sec or 0:.1f} s"
        rows.append([f"to personal/acc {t}", reached])
    if "baseline/local_acc" in final:
        add("local-only accuracy, same partition (baseline/local_acc)", "baseline/local_acc")
        gain = final.get("baseline/gain_points") or 0.0
        rows.append(["gain over local training (points)", f"{gain:+.2f}"])
    if "baseline/control_acc" in final:
        add("no-federation control (baseline/control_acc)", "baseline/control_acc")
        gain = final.get("baseline/federated_gain_points") or 0.0
        rows.append(["federated gain over the control (points)", f"{gain:+.2f}"])
    for key in ("personal/acc_mean", "personal/acc_std", "personal/acc_worst10"):
        add(key, key)
    for key in sorted(k for k in final if k.endswith("/acc") and k.count("/") == 1):
        if key != "personal/acc":
            add(key, key)
    add("pfedes/kl_local_proxy", "pfedes/kl_local_proxy")
    for way in ("up", "down"):
        total = final.get(f"comm/bytes_{way}_total")
        if total is not None:
            rows.append([f"communication {way}, MB in all", f"{total / 1e6:.2f}"])
    return rows


def run_report(run_dir: Path) -> str:
    from rayfl.engine.rundir import read_summary
    from rayfl.tracking.plots import default_keys, plot_cost_curves, plot_learning_curves

    summary = read_summary(run_dir)
    final = summary.get("final", {})
    cfg = summary.get("config", {})
    history = read_history(run_dir / "metrics.parquet")
    algo = _section(cfg, "algorithm").get("name", "?")
    data = _section(cfg, "data")
    subtitle = (
        f"{algo} on {data.get('dataset', '?')}, {data.get('num_clients', '?')} clients, "
        f"seed {summary.get('seed')}, {summary.get('rounds')} rounds, status "
        f"{summary.get('status')}, wall time {summary.get('wall_s', 0):.0f} s"
    )
    targets = _section(cfg, "eval").get("targets")
    targets = [t for t in targets if isinstance(t, int | float)] if type(targets) is list else []
    sections = [("Final metrics", table(["metric", "value"], _final_rows(final, targets)))]
    if history:
        keys, note = capped(list(default_keys(history)), MAX_DRAWN, "metrics")
        curves = figure(partial(plot_learning_curves, history, keys=keys), "learning curves")
        sections.append(("Learning curves", curves + note))
    for what, tag in (("architecture", "arch="), ("domain", "domain=")):
        values = _tagged(final, f"personal/acc/{tag}")
        shown, note = capped(sorted(values), MAX_DRAWN, f"{what}s")
        if not shown:
            continue
        groups = {algo: {a: values[a] for a in shown}}
        if local := _tagged(final, f"baseline/local_acc/{tag}"):
            groups["local-only"] = local
        body = [[a, *(g.get(a, float("nan")) for g in groups.values())] for a in shown]
        bars = figure(arch_bars(groups, xlabel=what), f"per {what}")
        content = table([what, *groups], body) + bars + note
        sections.append((f"Personalized accuracy per {what}", content))
    if history:
        cost = figure(partial(plot_cost_curves, {algo: [history]}), "accuracy vs cost")
        sections.append(("Accuracy against communication and time", cost))
    if is_file(run_dir / "label_distribution.png"):
        labels = image(run_dir / "label_distribution.png", "label distribution")
        sections.append(("Label distribution", labels))
    if is_file(run_dir / "config.yaml"):
        sections.append(("Config", f"<pre>{esc(gate.read_text(run_dir / 'config.yaml'))}</pre>"))
    return page(f"Run {summary.get('name', run_dir.name)}", subtitle, sections)


def _tagged(final: Mapping[str, Any], prefix: str) -> dict[str, Any]:
    """`{tag: value}` of the final metrics `<prefix><tag>` (an architecture, a domain)."""
    return {k[len(prefix) :]: v for k, v in final.items() if k.startswith(prefix) and v is not None}


def _section(cfg: Mapping[str, Any], name: str) -> Mapping[str, Any]:
    value = cfg.get(name)
    return value if isinstance(value, dict) else {}
