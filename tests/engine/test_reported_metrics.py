"""The metrics papers report: targets reached, the client-mean confidence interval, the round
chosen on validation, and the per-client table in the run directory."""

from __future__ import annotations

import copy

import numpy as np
import pyarrow.parquet as pq
import pytest

import rayfl
from rayfl.cli import final_table
from rayfl.engine.metrics import CLIENT_COLUMNS, at_best_val, ci95, reached_targets


def _row(rnd: int, acc: float, up: float, down: float, secs: float) -> dict[str, float]:
    return {
        "round": float(rnd),
        "personal/acc": acc,
        "comm/bytes_up_total": up,
        "comm/bytes_down_total": down,
        "time/round_s": secs,
    }


def test_targets_record_the_first_round_its_bytes_and_seconds() -> None:
    history: list[dict[str, float]] = []
    rows = [_row(1, 0.5, 10, 20, 1.5), _row(2, 0.81, 20, 40, 2.0), _row(3, 0.9, 30, 60, 2.5)]
    for row in rows:
        row.update(reached_targets((0.8, 0.95), row, history))
        history.append(row)
    assert "rounds_to/acc_0.8" not in history[0]
    assert history[1]["rounds_to/acc_0.8"] == 2
    assert history[1]["bytes_to/acc_0.8"] == 60  # 20 up + 40 down, cumulative
    assert history[1]["seconds_to/acc_0.8"] == 3.5  # rounds 1 and 2
    assert "rounds_to/acc_0.8" not in history[2]  # first reached only
    assert not any("acc_0.95" in k for r in history for k in r)  # never reached


def test_ci95_is_students_t_over_clients() -> None:
    # two clients: sample std 0.1414, standard error 0.1, t(0.975, 1) = 12.706
    assert ci95(np.array([0.5, 0.7])) == pytest.approx(12.706204736174694 * 0.1)
    # 20 clients: t(0.975, 19) = 2.0930
    values = np.linspace(0.4, 0.8, 20)
    want = 2.093024054 * values.std(ddof=1) / np.sqrt(20)
    assert ci95(values) == pytest.approx(want, rel=1e-6)
    assert np.isnan(ci95(np.array([0.5])))


def test_the_best_round_is_chosen_on_validation_never_on_test() -> None:
    history = [
        {"round": 1.0, "personal/acc": 0.9, "personal/val_acc": 0.5, "global/acc": 0.3},
        {"round": 2.0, "personal/acc": 0.6, "personal/val_acc": 0.7, "global/acc": 0.4},
        {"round": 3.0, "personal/acc": 0.99, "personal/val_acc": 0.7, "global/acc": 0.5},
    ]
    chosen = at_best_val(history)
    assert chosen["at_best_val/round"] == 2  # the earliest of the tied validation maxima
    assert chosen["at_best_val/personal/acc"] == 0.6
    assert chosen["at_best_val/global/acc"] == 0.4
    assert at_best_val([{k: v for k, v in r.items() if "val" not in k} for r in history]) == {}


@pytest.mark.slow
def test_run_directory_holds_the_per_client_table(tmp_path, synthetic_raw) -> None:
    raw = copy.deepcopy(synthetic_raw)
    raw["data"]["val_fraction"] = 0.2
    raw["eval"] = {"targets": [0.01, 0.999]}
    result = rayfl.run(raw, out=tmp_path / "run")
    rows = pq.read_table(tmp_path / "run" / "clients.parquet").to_pylist()
    assert [(r["round"], r["client"]) for r in rows] == [(r, c) for r in (1, 2) for c in range(6)]
    assert list(rows[0]) == list(CLIENT_COLUMNS)
    assert all(r["domain"] is None and r["num_val"] > 0 for r in rows)
    last = [r for r in rows if r["round"] == 2]
    weighted = sum(r["acc"] * r["num_test"] for r in last) / sum(r["num_test"] for r in last)
    assert weighted == pytest.approx(result.final["personal/acc"])
    assert result.final["rounds_to/acc_0.01"] == 1
    assert "rounds_to/acc_0.999" not in result.final
    assert {"personal/loss", "personal/val_acc", "personal/val_loss"} <= set(result.final)

    class Shown:  # what `rayfl run` prints at the end
        config = result.config
        final = result.final
        history = result.history
        status = result.status

    table = final_table(Shown(), 1.0)
    assert "at best validation round" in table and "not reached" in table


@pytest.mark.slow
def test_the_per_client_table_names_each_clients_domain(tmp_path, synthetic_raw) -> None:
    raw = copy.deepcopy(synthetic_raw)
    raw["data"]["domains"] = {"transforms": ["identity", "rotate:90"]}
    rayfl.run(raw, out=tmp_path / "run")
    rows = pq.read_table(tmp_path / "run" / "clients.parquet").to_pylist()
    assert {r["domain"] for r in rows} == {"identity", "rotate:90"}
