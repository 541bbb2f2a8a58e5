"""Plots: files are written, non-empty and decodable; data selection is right."""

from __future__ import annotations

import math
from pathlib import Path

import matplotlib.image as mpimg
import pytest

from rayfl.tracking import plots

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"

HISTORY = [
    {"round": 1, "personal/acc": 0.30, "personal/acc/arch=cnn1": 0.2, "comm/bytes_up": 10.0},
    {"round": 2, "personal/acc": 0.45, "personal/acc/arch=cnn1": 0.4, "proxy/acc": 0.25},
    {"round": 3, "personal/acc": math.nan, "personal/acc/arch=cnn2": 0.5, "proxy/acc": 0.35},
    {"round": 4, "personal/acc": 0.60, "global/acc": 0.55},
]


def _assert_png(path: Path) -> None:
    data = path.read_bytes()
    assert data[:8] == PNG_MAGIC and len(data) > 2000
    image = mpimg.imread(path)
    assert image.shape[0] > 100 and image.shape[1] > 100
    assert image.std() > 0  # something was drawn, not a blank canvas


def test_series_skips_missing_and_nonfinite_points() -> None:
    assert plots.series(HISTORY, "personal/acc") == [(1.0, 0.30), (2.0, 0.45), (4.0, 0.60)]
    assert plots.series(HISTORY, "proxy/acc") == [(2.0, 0.25), (3.0, 0.35)]
    # Without "round", the position in the history is the x value.
    assert plots.series([{"a": 1.0}, {"a": True}, {"a": 2}], "a") == [(0.0, 1.0), (2.0, 2.0)]


def test_default_keys_are_one_accuracy_per_panel() -> None:
    history = [*HISTORY, {"round": 5, "personal/acc_std": 0.1, "personal/acc_worst10": 0.2}]
    # no std, no mean, no per-architecture keys: those are not learning curves of their own
    assert plots.default_keys(history) == [
        "personal/acc",
        "personal/acc_worst10",
        "global/acc",
        "proxy/acc",
    ]


def test_learning_curves_one_metric_per_panel(tmp_path) -> None:
    history = [
        {"round": r, "personal/acc": 0.5 + r / 20, "baseline/local_acc": 0.5, "proxy/acc": 0.1}
        for r in (1, 2, 3)
    ]
    svg = plots.plot_learning_curves(history, tmp_path / "c.svg").read_text()
    assert svg.count('id="axes_') == 2  # two panels: personal/acc, proxy/acc
    assert "local-only" in svg and "round" in svg  # reference line in the legend, x label
    assert "accuracy" in svg  # y axis labelled


def test_learning_curves_and_per_architecture_write_pngs(tmp_path) -> None:
    out = plots.plot_learning_curves(HISTORY, tmp_path / "a" / "curves.png", title="fmnist")
    assert out == tmp_path / "a" / "curves.png"
    _assert_png(out)
    _assert_png(plots.plot_learning_curves(HISTORY, tmp_path / "c.png", keys=["comm/bytes_up"]))
    _assert_png(plots.plot_per_architecture(HISTORY, tmp_path / "arch.png"))


def test_svg_and_pdf_by_suffix(tmp_path) -> None:
    svg = plots.plot_learning_curves(HISTORY, tmp_path / "curves.svg")
    assert svg.read_text().lstrip().startswith("<?xml") and "<svg" in svg.read_text()
    pdf = plots.plot_per_architecture(HISTORY, tmp_path / "arch.pdf")
    assert pdf.read_bytes()[:5] == b"%PDF-"


@pytest.fixture
def drawn(monkeypatch):
    """The figures the plot functions save, in order (their axes, lines and points can fail)."""
    from matplotlib.figure import Figure

    figures: list[Figure] = []
    save = Figure.savefig

    def recording(self, *args, **kwargs):
        figures.append(self)
        return save(self, *args, **kwargs)

    monkeypatch.setattr(Figure, "savefig", recording)
    return figures


def _texts(ax) -> list[str]:
    return [t.get_text() for t in ax.texts]


def test_empty_history_still_writes_a_figure(tmp_path, caplog, drawn) -> None:
    _assert_png(plots.plot_learning_curves([], tmp_path / "empty.png"))
    _assert_png(plots.plot_per_architecture([{"round": 1, "loss": 1.0}], tmp_path / "e2.png"))
    assert sum("no data" in r.getMessage() for r in caplog.records) == 2
    for fig in drawn:
        assert not any(ax.lines for ax in fig.axes)  # nothing plotted ...
        assert any(t.startswith("no data") for ax in fig.axes for t in _texts(ax))  # ... said so


def test_plot_compare_draws_one_line_per_algorithm_without_non_finite_points(
    tmp_path, drawn
) -> None:
    curves = {
        "pfedes": [(1, 0.3), (2, 0.5), (3, 0.6)],
        "fedavg": [(1, 0.2), (2, math.inf), (3, 0.4)],
    }
    _assert_png(plots.plot_compare(curves, tmp_path / "cmp.png", ylabel="personal/acc"))
    (fig,) = drawn
    (ax,) = fig.axes
    lines = {line.get_label(): line for line in ax.lines}
    assert sorted(lines) == ["fedavg", "pfedes"]
    assert list(lines["pfedes"].get_xdata()) == [1.0, 2.0, 3.0]
    assert list(lines["pfedes"].get_ydata()) == [0.3, 0.5, 0.6]
    assert list(lines["fedavg"].get_xdata()) == [1.0, 3.0]  # the inf at round 2 is left out
    assert ax.get_ylabel() == "personal/acc" and ax.get_xlabel() == "round"


@pytest.mark.parametrize("params", [["lr", "algorithm", "local_epochs"], []])
def test_metric_vs_params_numeric_log_and_categorical(tmp_path, params, drawn) -> None:
    rows = [
        {"lr": 1e-4, "algorithm": "fedavg", "local_epochs": 1, "personal/acc": 0.4},
        {"lr": 1e-3, "algorithm": "pfedes", "local_epochs": 2, "personal/acc": 0.6},
        {"lr": 1e-1, "algorithm": "pfedes", "local_epochs": 5, "personal/acc": 0.7},
        {"lr": 1e-2, "algorithm": "fedfd", "personal/acc": None},  # no metric: left out
    ]
    _assert_png(plots.plot_metric_vs_params(rows, "personal/acc", params, tmp_path / "p.png"))
    (fig,) = drawn
    assert len(fig.axes) == max(1, len(params))  # one panel per parameter
    if not params:
        assert _texts(fig.axes[0]) == ["no data: personal/acc vs (none)"]
        return
    panels = {ax.get_xlabel(): ax for ax in fig.axes}
    assert list(panels) == params
    lr_points = panels["lr"].collections[0].get_offsets()
    assert sorted(lr_points[:, 1].tolist()) == [0.4, 0.6, 0.7]  # three trials with the metric
    assert panels["lr"].get_xscale() == "log"  # 1e-4 .. 1e-1 spans three decades
    assert panels["local_epochs"].get_xscale() == "linear"
    algo = panels["algorithm"]
    assert [t.get_text() for t in algo.get_xticklabels()] == ["fedavg", "pfedes"]
    means = algo.collections[1].get_offsets()  # the mean marker per category
    assert means[:, 1].tolist() == pytest.approx([0.4, 0.65])


def test_no_pyplot_state_is_created(tmp_path) -> None:
    import matplotlib.pyplot as plt

    before = plt.get_fignums()
    plots.plot_learning_curves(HISTORY, tmp_path / "x.png")
    assert plt.get_fignums() == before


def test_bars_stay_legible_in_a_report_column_whatever_their_number(tmp_path) -> None:
    # 6 algorithms x 10 architectures: the old figure was 34 inches wide (4100 px), so a
    # 1100 px page column showed its 7 pt labels at ~2 px
    groups = {f"algo{i}": {f"cnn{j}": 0.1 * j / (i + 1) for j in range(10)} for i in range(6)}
    errors = {name: {c: 0.01 for c in values} for name, values in groups.items()}
    png = plots.plot_bars(groups, tmp_path / "bars.png", ylabel="acc", errors=errors)
    image = mpimg.imread(png)
    assert image.shape[1] <= plots.MAX_WIDTH_IN * 120 <= 1100
    svg = plots.plot_bars(groups, tmp_path / "bars.svg", ylabel="acc", errors=errors).read_text()
    assert "0.050" not in svg  # 60 bars: no value printed over each (the table has them)
    few = plots.plot_bars({"a": {"x": 0.5, "y": 0.25}}, tmp_path / "few.svg", ylabel="acc")
    assert "0.500" in few.read_text() and "0.250" in few.read_text()


def test_compare_curves_draw_the_seed_spread_as_a_band(tmp_path) -> None:
    curves = {"a": [(1, 0.3), (2, 0.5)], "b": [(1, 0.2), (2, 0.4)]}
    plain = plots.plot_compare(curves, tmp_path / "plain.svg", ylabel="acc").read_text()
    spread = {"a": [(1, 0.05), (2, 0.1)]}
    band = plots.plot_compare(curves, tmp_path / "band.svg", ylabel="acc", spread=spread)
    assert "PolyCollection" not in plain
    assert band.read_text().count("PolyCollection") >= 1  # one band, for "a" only


def test_log_sampled_parameters_get_a_log_axis_whatever_their_span(tmp_path, drawn) -> None:
    rows = [{"lr": lr, "mu": mu, "acc": 0.5} for lr, mu in [(0.01, 0.1), (0.05, 0.2), (0.09, 0.3)]]
    plots.plot_metric_vs_params(rows, "acc", ["lr", "mu", "lr"], tmp_path / "p.png", ["lr"])
    plots.plot_metric_vs_params(rows, "acc", ["lr"], tmp_path / "q.png")
    logged, plain = drawn
    assert [ax.get_xscale() for ax in logged.axes] == ["log", "linear", "log"]  # 2 a row
    assert [ax.get_xscale() for ax in plain.axes] == ["linear"]  # under two decades: linear


def test_cost_series_averages_seeds_per_round_against_cumulative_cost(tmp_path) -> None:
    def run(acc: list[float], mb: float, s: float) -> list[dict[str, float]]:
        return [
            {
                "round": r,
                "personal/acc": a,
                "comm/bytes_up_total": r * mb * 1e6 / 2,
                "comm/bytes_down_total": r * mb * 1e6 / 2,
                "time/round_s": s,
            }
            for r, a in enumerate(acc, 1)
        ]

    by_mb, by_s = plots.cost_series([run([0.2, 0.4], 1.0, 2.0), run([0.4, 0.6], 3.0, 4.0)])
    flat = [[v for point in points for v in point] for points in (by_mb, by_s)]
    # mean MB (1 and 3, then 2 and 6) and mean accuracy; rounds' seconds summed per run, then meaned
    assert flat[0] == pytest.approx([2.0, 0.3, 4.0, 0.5])
    assert flat[1] == pytest.approx([3.0, 0.3, 6.0, 0.5])
    svg = plots.plot_cost_curves({"a": [run([0.2, 0.4], 1.0, 2.0)]}, tmp_path / "c.svg")
    text = svg.read_text()
    assert text.count('id="axes_') == 2 and "communication" in text and "wall time" in text
