"""Static plots of a run or a comparison, written as image files (PNG, SVG or PDF by suffix).

Figures use matplotlib's object API on the Agg canvas, never ``pyplot``: no display is needed,
and no global figure registry grows inside long-lived Ray workers or Tune trials.

A ``history`` is one mapping per evaluated round, ``{"round": 3, "personal/acc": 0.71, ...}``;
a key missing from a round (metrics evaluated every k rounds) leaves a gap, not a zero.
"""

from __future__ import annotations

import logging
import math
import numbers
import statistics
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from matplotlib.axes import Axes
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.ticker import AutoLocator, MaxNLocator

from rayfl.gate import write_with

logger = logging.getLogger(__name__)

ARCH_PREFIX = "personal/acc/arch="
LABELS, CURVES, PER_ARCH = "label_distribution.png", "learning_curves.png", "per_architecture.png"

# Reports show figures at most this wide (inches at `_save`'s 120 dpi: 1080 px, inside the HTML
# page's 1100 px column), so a browser never scales them down.
MAX_WIDTH_IN = 9.0


def _finite(value: Any) -> float | None:
    """``value`` as a float if it is a finite real number, else None."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        return None
    out = float(value)
    return out if math.isfinite(out) else None


def series(history: Sequence[Mapping[str, Any]], key: str) -> list[tuple[float, float]]:
    """``[(round, value)]`` for ``key`` where it is finite; a row without ``"round"`` is at its
    position in ``history``."""
    rows = ((_finite(row.get("round", i)), _finite(row.get(key))) for i, row in enumerate(history))
    return [(x, y) for x, y in rows if x is not None and y is not None]


def default_keys(history: Sequence[Mapping[str, Any]]) -> list[str]:
    """The panels of a run's learning curves: personalized accuracy, its worst 10%, and each
    server-side model's accuracy (``proxy/acc``, ``global/acc``, ...). Spreads (``_std``), plain
    means and per-architecture keys stay out (they have their own plot)."""
    present = {k for row in history for k in row}
    keys = [k for k in ("personal/acc", "personal/acc_worst10") if k in present]
    servers = (k for k in present if k.endswith("/acc") and k.count("/") == 1)
    return keys + sorted(k for k in servers if k != "personal/acc")


# Reference lines drawn in the panel of the metric they are compared with (local-only: dashed).
REFERENCES = {
    "personal/acc": (
        ("baseline/local_acc", "local-only, same partition"),
        ("personal/val_acc", "validation"),
    ),
}


def _new_figure(nrows: int = 1, ncols: int = 1, width: float = 6.4, height: float = 4.0) -> Figure:
    fig = Figure(figsize=(width * ncols, height * nrows), layout="constrained")
    FigureCanvasAgg(fig)
    return fig


def _panels(n: int) -> tuple[Figure, Any]:
    """A figure of `n` panels, two a row, as wide as a report shows; its axes, flat."""
    ncols = min(2, n)
    nrows = math.ceil(n / ncols)
    fig = _new_figure(nrows, ncols, width=MAX_WIDTH_IN / 2, height=3.2)
    return fig, fig.subplots(nrows, ncols, squeeze=False).ravel()


def _save(fig: Figure, path: str | Path, **options: Any) -> Path:
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    kind = out.suffix.lstrip(".") or "png"
    return write_with(out, lambda f: fig.savefig(f, format=kind, **{"dpi": 120, **options}))


def _no_data(ax: Axes, what: str) -> None:
    logger.warning("plot: no data for %s; writing an empty figure", what)
    ax.text(0.5, 0.5, f"no data: {what}", ha="center", va="center", transform=ax.transAxes)


MAX_LEGEND = 16  # more lines than this: no legend (it would hide the axes); the table names them


def _lines(
    ax: Axes,
    named: Mapping[str, Sequence[tuple[float, float]]],
    spread: Mapping[str, Sequence[tuple[float, float]]] | None = None,
) -> int:
    """One line per name; with `spread` ({name: [(x, std)]}), a band of mean +- std around it."""
    drawn = 0
    for name, points in named.items():
        if not points:
            continue
        xs, ys = zip(*sorted(points))
        style = "--" if name.startswith("local-only") else "-"
        marker = "o" if len(xs) <= 30 else None
        (line,) = ax.plot(xs, ys, style, marker=marker, markersize=3, label=name)
        std = dict(spread.get(name, ())) if spread else {}
        band = [(x, y, std[x]) for x, y in zip(xs, ys) if x in std]
        if len(band) > 1:
            bx, by, bs = zip(*band)
            lo, hi = [y - s for y, s in zip(by, bs)], [y + s for y, s in zip(by, bs)]
            ax.fill_between(bx, lo, hi, color=line.get_color(), alpha=0.18, linewidth=0)
        drawn += 1
    if drawn:
        if 1 < drawn <= MAX_LEGEND:  # beside the axes, never over the lines
            ax.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.02, 1.0))
        ax.grid(alpha=0.3)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # rounds are whole numbers
    return drawn


def _ylabel(key: str) -> str:
    return "accuracy" if key.endswith(("/acc", "_worst10")) or "/acc/" in key else key


def plot_learning_curves(
    history: Sequence[Mapping[str, Any]],
    path: str | Path,
    keys: Sequence[str] | None = None,
    title: str = "",
) -> Path:
    """Plot the metrics ``keys`` (default: :func:`default_keys`) against rounds, one panel each,
    two a row; a panel also shows the metric's :data:`REFERENCES` the run has (e.g. the
    local-only baseline, dashed)."""
    keys = list(default_keys(history) if keys is None else keys)
    fig, axes = _panels(max(1, len(keys)))
    if not keys:
        _no_data(axes[0], "accuracy metrics")
        axes[0].set_xlabel("round")
    for ax, key in zip(axes, keys):
        named = {key: series(history, key)}
        for ref, label in REFERENCES.get(key, ()):
            if any(ref in row for row in history):
                named[label] = series(history, ref)
        if not _lines(ax, named):
            _no_data(ax, key)
        ax.set_title(key, fontsize="medium")
        ax.set(xlabel="round", ylabel=_ylabel(key))
    for ax in axes[max(1, len(keys)) :]:
        ax.set_visible(False)
    if title:
        fig.suptitle(title)
    return _save(fig, path)


def plot_per_architecture(history: Sequence[Mapping[str, Any]], path: str | Path) -> Path:
    """Plot personalized accuracy per architecture group (``personal/acc/arch=<name>``)."""
    keys = sorted({k for row in history for k in row if k.startswith(ARCH_PREFIX)})
    curves = {k[len(ARCH_PREFIX) :]: series(history, k) for k in keys}
    return plot_compare(curves, path, "personalized accuracy", title="accuracy per architecture")


MAX_BAR_LABELS = 12  # more bars than this: no value over each bar (the table has the numbers)


def plot_bars(
    groups: Mapping[str, Mapping[str, float]],
    path: str | Path,
    ylabel: str,
    title: str = "",
    errors: Mapping[str, Mapping[str, float]] | None = None,
    xlabel: str = "architecture",
) -> Path:
    """Grouped bars: one group per category (e.g. architecture), one bar per series (e.g.
    algorithm, or pFedES beside the local-only baseline). The figure is at most
    `MAX_WIDTH_IN` wide whatever the number of bars, so its text stays legible in a report;
    each bar carries its value when there are few bars, and an error bar when `errors`
    (``{series: {category: std}}``, like `groups`' ``{series: {category: value}}``) gives one."""
    categories = sorted({c for values in groups.values() for c in values})
    fig = _new_figure(width=min(MAX_WIDTH_IN, max(5.0, 1.6 * len(categories))), height=4.0)
    ax = fig.add_subplot()
    if not categories:
        _no_data(ax, ylabel)
        return _save(fig, path)
    width = 0.8 / max(1, len(groups))
    label_bars = len(groups) * len(categories) <= MAX_BAR_LABELS
    for i, (name, values) in enumerate(groups.items()):
        xs = [j + (i - (len(groups) - 1) / 2) * width for j in range(len(categories))]
        ys = [values.get(c, math.nan) for c in categories]
        err = (errors or {}).get(name, {})
        yerr = [err.get(c) or 0.0 for c in categories] if err else None
        bars = ax.bar(xs, ys, width=width * 0.95, label=name, yerr=yerr, capsize=2)
        if label_bars:
            ax.bar_label(bars, fmt="%.3f", fontsize="small", padding=2)
    rotate = len(categories) > 6 or max(len(c) for c in categories) * len(categories) > 60
    ha = "right" if rotate else "center"
    ax.set_xticks(range(len(categories)), categories, rotation=30 if rotate else 0, ha=ha)
    ax.set(xlabel=xlabel, ylabel=ylabel)
    finite = [v for values in groups.values() for v in values.values() if _finite(v) is not None]
    if finite:
        ax.set_ylim(0, min(1.0, max(finite) * 1.15) if max(finite) <= 1 else max(finite) * 1.15)
    if len(groups) > 1:
        ax.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.02, 1.0))
    ax.grid(alpha=0.3, axis="y")
    if title:
        ax.set_title(title)
    return _save(fig, path)


def plot_compare(
    curves: Mapping[str, Sequence[tuple[float, float]]],
    path: str | Path,
    ylabel: str,
    spread: Mapping[str, Sequence[tuple[float, float]]] | None = None,
    title: str = "",
) -> Path:
    """Plot one curve per algorithm (e.g. mean accuracy over seeds against rounds), with a band
    of mean +- std where `spread` (``{algorithm: [(round, std), ...]}``) has one."""

    def finite(pairs: Mapping[str, Sequence[tuple[float, float]]]) -> dict[str, list[Any]]:
        return {
            k: [(float(x), y) for x, v in p if (y := _finite(v)) is not None]
            for k, p in pairs.items()
        }

    named, bands = finite(curves), finite(spread or {})
    fig = _new_figure(width=7.5)
    ax = fig.add_subplot()
    if not _lines(ax, named, bands):
        _no_data(ax, ylabel)
    ax.set(xlabel="round", ylabel=ylabel)
    if title:
        ax.set_title(title, fontsize="medium")
    return _save(fig, path)


def cost_series(
    histories: Sequence[Sequence[Mapping[str, Any]]], key: str = "personal/acc"
) -> tuple[list[tuple[float, float]], list[tuple[float, float]]]:
    """`key` against cumulative communication (MB, up + down) and against cumulative seconds
    of rounds (`time/round_s` summed, start-up excluded), at every round `key` was measured,
    each point the mean over `histories` (seeds) of the runs that have the round."""
    by_round: dict[float, list[tuple[float, float, float]]] = {}
    for history in histories:
        seconds = 0.0
        for row in history:
            seconds += _finite(row.get("time/round_s")) or 0.0
            value, rnd = _finite(row.get(key)), _finite(row.get("round"))
            if value is None or rnd is None:
                continue
            up = _finite(row.get("comm/bytes_up_total")) or 0.0
            down = _finite(row.get("comm/bytes_down_total")) or 0.0
            by_round.setdefault(rnd, []).append(((up + down) / 1e6, seconds, value))
    means = [[sum(c) / len(points) for c in zip(*points)] for _, points in sorted(by_round.items())]
    return [(m, y) for m, _, y in means], [(s, y) for _, s, y in means]


def plot_cost_curves(
    runs: Mapping[str, Sequence[Sequence[Mapping[str, Any]]]],
    path: str | Path,
    key: str = "personal/acc",
    title: str = "",
) -> Path:
    """Two panels: `key` against cumulative communication (MB, up + down) and against
    cumulative wall time of the rounds, one line per name of `runs` (`{name: [history, ...]}`,
    a run's seeds averaged round by round, `cost_series`): what an accuracy costs to reach."""
    fig, axes = _panels(2)
    series_of = {name: cost_series(histories, key) for name, histories in runs.items()}
    xlabels = ("communication, MB (up + down, cumulative)", "wall time of rounds, s")
    for i, (ax, xlabel) in enumerate(zip(axes, xlabels)):
        if not _lines(ax, {name: pair[i] for name, pair in series_of.items()}):
            _no_data(ax, key)
        ax.xaxis.set_major_locator(AutoLocator())  # megabytes and seconds are not whole rounds
        ax.set(xlabel=xlabel, ylabel=_ylabel(key))
        ax.set_title(f"{key} vs {'communication' if i == 0 else 'time'}", fontsize="medium")
    if title:
        fig.suptitle(title)
    return _save(fig, path)


def plot_metric_vs_params(
    rows: Sequence[Mapping[str, Any]],
    metric: str,
    params: Sequence[str],
    path: str | Path,
    log_params: Sequence[str] = (),
) -> Path:
    """Scatter ``metric`` against each swept parameter, one subplot per parameter, two a row.

    Numeric parameters get a numeric axis: logarithmic for the ones in ``log_params`` (sampled
    log-uniformly) and for positive values spanning two or more decades, as learning rates do;
    others get one column per distinct value, with the mean marked. Rows without a finite
    ``metric`` or without the parameter are left out."""
    params = list(params) or ["(none)"]
    fig, axes = _panels(len(params))
    for ax in axes[len(params) :]:
        fig.delaxes(ax)  # the odd panel's empty neighbour
    for ax, param in zip(axes, params):
        pairs = [
            (row[param], y)
            for row in rows
            if param in row and (y := _finite(row.get(metric))) is not None
        ]
        ax.set(xlabel=param, ylabel=metric)
        if not pairs:
            _no_data(ax, f"{metric} vs {param}")
            continue
        xs, ys = [x for x, _ in pairs], [y for _, y in pairs]
        if all(_finite(x) is not None for x in xs):
            fx = [float(x) for x in xs]
            ax.scatter(fx, ys, s=18)
            if min(fx) > 0 and (param in log_params or max(fx) / min(fx) >= 100):
                ax.set_xscale("log")
        else:
            labels = sorted({str(x) for x in xs})
            pos = {label: i for i, label in enumerate(labels)}
            ax.scatter([pos[str(x)] for x in xs], ys, s=18, alpha=0.7)
            means = [statistics.fmean(y for x, y in pairs if str(x) == label) for label in labels]
            ax.scatter(range(len(labels)), means, marker="_", s=400, color="black", label="mean")
            ax.set_xticks(range(len(labels)), labels, rotation=30, ha="right")
            ax.set_xlim(-0.5, len(labels) - 0.5)
            ax.legend(fontsize="small")
        ax.grid(alpha=0.3)
    return _save(fig, path)


MAX_BAR_CLIENTS = 300  # above this, the label distribution is drawn as an image, not bars


def plot_class_counts(counts: Any, dataset: str, path: str | Path) -> Path:
    """Save a stacked horizontal bar chart of each client's training class counts (`counts`:
    clients x classes, `Federation.class_counts`) of `dataset` as PNG; returns `path`."""
    import matplotlib
    import numpy as np

    counts = np.asarray(counts)
    n_clients, n_classes = counts.shape
    title = f"{dataset}: label distribution over {n_clients} clients"
    if n_clients > MAX_BAR_CLIENTS:
        # One bar per client and class is 10k x 10 artists at 10k clients (minutes to draw):
        # above a few hundred clients, each client's class shares as one image row instead.
        fig = Figure(figsize=(8.0, 8.0))
        ax = fig.add_subplot()
        shares = counts / np.maximum(counts.sum(axis=1, keepdims=True), 1)
        image = ax.imshow(shares, aspect="auto", interpolation="nearest", cmap="viridis")
        fig.colorbar(image, ax=ax, label="share of the client's training samples")
        ax.set_xlabel("class")
    else:
        fig = Figure(figsize=(8.0, min(2.0 + 0.25 * n_clients, 40.0)))
        ax = fig.add_subplot()
        cmap = matplotlib.colormaps[
            "tab10" if n_classes <= 10 else "tab20" if n_classes <= 20 else "viridis"
        ]
        left = np.zeros(n_clients)
        clients = np.arange(n_clients)
        for cls in range(n_classes):
            color = cmap(cls if n_classes <= 20 else cls / max(n_classes - 1, 1))
            ax.barh(clients, counts[:, cls], left=left, color=color, label=str(cls), height=0.8)
            left += counts[:, cls]
        ax.set_xlabel("training samples")
        ax.yaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_ylim(n_clients - 0.5, -0.5)  # client 0 on top, no empty rows
        if n_classes <= 20:
            ax.legend(title="class", loc="center left", bbox_to_anchor=(1.0, 0.5), fontsize="small")
    ax.set(ylabel="client", title=title)
    return _save(fig, path, dpi=100, bbox_inches="tight")


def plot_run(
    folder: str | Path,
    history: Sequence[Mapping[str, Any]],
    class_counts: Any,
    dataset: str,
    title: str,
) -> list[Path]:
    """A run directory's plots, written into `folder`: the clients' label distribution
    (`class_counts`: clients x classes), and once a round is in `history` the learning curves
    and, when the clients have several architectures, the accuracy per architecture."""
    folder = Path(folder)
    paths = [plot_class_counts(class_counts, dataset, folder / LABELS)]
    if history:
        paths.append(plot_learning_curves(history, folder / CURVES, title=title))
        if any(k.startswith(ARCH_PREFIX) for k in history[-1]):
            paths.append(plot_per_architecture(history, folder / PER_ARCH))
    return paths
