"""Progress inside a round: the executors report clients done per phase (fit, eval) through
their `progress` listener, and the terminal bar shows it (`r2 fit 4/6`, `r2 server`)."""

from __future__ import annotations

import io

import pytest

from rayfl.config import build_config
from rayfl.engine.callbacks import Callback, ProgressBar
from rayfl.launch import simulate
from tests.conftest import SYNTHETIC

pytestmark = pytest.mark.slow  # end-to-end runs, subprocesses or Ray

# 6 clients, all in every round, 2 per call: three batches per phase
OVERRIDES = ["engine.clients_per_call=2", "engine.rounds=2"]


class Recorder(Callback):
    def __init__(self) -> None:
        self.calls: list[tuple[str, int, int]] = []

    def on_run_start(self, sim):
        sim.executor.progress = lambda *call: self.calls.append(call)


ONE_ROUND = [("fit", 2, 6), ("fit", 4, 6), ("fit", 6, 6), ("eval", 2, 6), ("eval", 4, 6)]
ONE_ROUND += [("eval", 6, 6)]


def recorded(tmp_path, overrides):
    recorder = Recorder()
    cfg = build_config(SYNTHETIC, [*OVERRIDES, *overrides])
    result = simulate(cfg, tmp_path / "run", progress=False, extra_callbacks=[recorder])
    return recorder.calls, result


def test_serial_executor_reports_each_batch_of_clients_per_phase(tmp_path):
    calls, result = recorded(tmp_path, [])
    assert calls == 2 * ONE_ROUND
    # the same numbers as one call for all clients (clients are seeded one by one)
    whole, _ = recorded(tmp_path / "b", ["engine.clients_per_call=6"])
    assert whole == 2 * [("fit", 6, 6), ("eval", 6, 6)]
    again = simulate(
        build_config(SYNTHETIC, [*OVERRIDES, "engine.clients_per_call=6"]),
        tmp_path / "c",
        progress=False,
    )
    assert again.final["personal/acc"] == result.final["personal/acc"]


@pytest.mark.ray
def test_ray_executor_reports_each_batch_of_clients_per_phase(tmp_path, ray_local):
    calls, _ = recorded(tmp_path, ["engine.executor=ray", "engine.num_workers=2"])
    for phase in ("fit", "eval"):
        done = [d for p, d, t in calls if p == phase]
        assert all(t == 6 for p, _, t in calls if p == phase)
        # per round: 2, 4, 6 in whatever order the workers finish (always increasing)
        assert done == [2, 4, 6, 2, 4, 6]


class Tty(io.StringIO):
    def isatty(self):
        return True

    def fileno(self):
        raise OSError  # no real terminal: tqdm falls back to its default width


def test_terminal_bar_shows_the_phase_and_clients_done(tmp_path):
    stream = Tty()
    bar = ProgressBar(stream=stream, plain=False, redraw_s=0.0)
    cfg = build_config(SYNTHETIC, OVERRIDES)
    simulate(cfg, tmp_path / "run", progress=False, extra_callbacks=[bar])
    text = stream.getvalue()
    for shown in ("r1 fit 2/6", "r1 fit 4/6", "r1 server", "r1 eval 4/6", "r2 fit 2/6"):
        assert shown in text, shown
    assert "r2 eval 6/6" in text and "r3" not in text
