import json

import numpy as np
import pyarrow.parquet as pq
import pytest

from rayfl.config import build_config
from rayfl.engine.callbacks import RunDirectory
from rayfl.engine.checkpoint import Checkpoint
from rayfl.engine.loop import Simulation, summarize_clients
from rayfl.sampling import sample_clients


def run(run_dir, raw, overrides=(), callbacks=()):
    cfg = build_config(raw, list(overrides))
    sim = Simulation(cfg, run_dir, list(callbacks))
    return sim.run()


def test_sampling_is_seeded_and_sorted():
    a = sample_clients(0, 3, 100, 10)
    assert a == sample_clients(0, 3, 100, 10)
    assert a != sample_clients(0, 4, 100, 10)
    assert a == sorted(a) and len(set(a)) == 10
    assert sample_clients(0, 1, 5, 5) == [0, 1, 2, 3, 4]


def test_summarize_clients_golden():
    rows = [
        {
            "client": 0,
            "arch": "a",
            "acc": 1.0,
            "num_test": 10.0,
            "num_train": 40,
            "train_s": 1.0,
            "train/loss": 1.0,
        },
        {
            "client": 1,
            "arch": "b",
            "acc": 0.5,
            "num_test": 30.0,
            "num_train": 60,
            "train_s": 2.0,
            "train/loss": 2.0,
        },
    ]
    out = summarize_clients(rows)
    assert out["personal/acc"] == pytest.approx(0.625)
    assert out["personal/acc_mean"] == pytest.approx(0.75)
    assert out["personal/acc_std"] == pytest.approx(0.25)
    assert out["personal/acc_worst10"] == pytest.approx(0.5)
    assert out["personal/acc/arch=a"] == 1.0 and out["personal/acc/arch=b"] == 0.5
    assert out["train/loss"] == pytest.approx(1.6)


@pytest.mark.slow
def test_serial_run_metrics(synthetic_raw, tmp_path):
    result = run(
        tmp_path,
        synthetic_raw,
        ["engine.rounds=3", "engine.fraction=0.5"],
        [RunDirectory(tmp_path)],
    )
    assert [r["round"] for r in result.history] == [1, 2, 3]
    last = result.history[-1]
    for key in (
        "personal/acc",
        "personal/acc/arch=tiny_a",
        "personal/acc/arch=tiny_b",
        "proxy/acc",
        "pfedes/kl_local_proxy",
        "comm/bytes_up",
        "comm/bytes_down",
        "comm/bytes_up_total",
        "time/round_s",
    ):
        assert key in last and np.isfinite(last[key]), key
    assert last["clients"] == 3
    # the proxy travels both ways: same bytes up and down per client
    assert last["comm/bytes_up"] == last["comm/bytes_down"] > 0
    assert last["comm/bytes_up_total"] == pytest.approx(
        sum(r["comm/bytes_up"] for r in result.history)
    )
    table = pq.read_table(tmp_path / "metrics.parquet").to_pylist()
    assert len(table) == 3 and table[-1]["personal/acc"] == last["personal/acc"]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["final"]["personal/acc"] == last["personal/acc"] and summary["seed"] == 0
    for name in (
        "partition.parquet",
        "class_counts.parquet",
        "label_distribution.png",
        "learning_curves.png",
        "per_architecture.png",
        "config.yaml",
    ):
        assert (tmp_path / name).exists(), name


def test_same_seed_same_numbers_other_seed_differs(synthetic_raw, tmp_path):
    a = run(tmp_path, synthetic_raw).history
    b = run(tmp_path, synthetic_raw).history
    c = run(tmp_path, synthetic_raw, ["seed=1"]).history
    key = "personal/acc"
    assert [r[key] for r in a] == [r[key] for r in b]
    assert [r["train/loss"] for r in a] != [r["train/loss"] for r in c]


def test_learning_happens_on_synthetic_data(synthetic_raw, tmp_path):
    hist = run(
        tmp_path, synthetic_raw, ["engine.rounds=4", "algorithm.name=local", "train.local_epochs=3"]
    ).history
    assert hist[-1]["personal/acc"] > 0.6  # 10 classes: chance is 0.1


def test_checkpoint_resume_gives_the_uninterrupted_numbers(synthetic_raw, tmp_path):
    full = run(tmp_path / "full", synthetic_raw, ["engine.rounds=4"]).history
    cfg = build_config(synthetic_raw, ["engine.rounds=2", "engine.checkpoint_every=1"])
    Simulation(cfg, tmp_path, [Checkpoint(tmp_path, 1)]).run()
    cfg4 = build_config(synthetic_raw, ["engine.rounds=4", "engine.checkpoint_every=1"])
    resumed = Simulation(cfg4, tmp_path, [Checkpoint(tmp_path, 1, resume=True)]).run().history
    assert [r["round"] for r in resumed] == [1, 2, 3, 4]
    for a, b in zip(full, resumed):
        assert a["personal/acc"] == b["personal/acc"]
        assert a["proxy/acc"] == b["proxy/acc"]


@pytest.mark.parametrize("name", ["local", "fedavg", "pfedes"])
def test_core_algorithms_run(synthetic_raw, name, tmp_path):
    overrides = [f"algorithm.name={name}"]
    if name == "fedavg":
        overrides.append("model.architectures=[tiny_a]")
    hist = run(tmp_path, synthetic_raw, overrides).history
    assert np.isfinite(hist[-1]["personal/acc"])
    if name == "fedavg":
        assert "global/acc" in hist[-1]


def test_input_variant_runs(synthetic_raw, tmp_path):
    raw = dict(synthetic_raw)
    raw["algorithm"] = {"name": "pfedes", "variant": "input", "proxy_epochs": 1}
    raw["model"] = {"family": "seed3"}
    hist = run(tmp_path, raw).history
    assert np.isfinite(hist[-1]["personal/acc"]) and "proxy/acc" not in hist[-1]


def test_the_executor_shuts_down_after_the_callbacks_end_the_run(
    synthetic_raw, monkeypatch, tmp_path
):
    # a callback's on_run_end may still read the executor; it is closed once they all ended
    from rayfl.engine.callbacks import Callback
    from rayfl.engine.executor import SerialExecutor

    order: list[str] = []
    monkeypatch.setattr(SerialExecutor, "close", lambda self: order.append("close"))

    class Watch(Callback):
        def on_run_end(self, sim, status):
            order.append(status)

    result = run(tmp_path, synthetic_raw, ["engine.rounds=1"], callbacks=[Watch()])
    assert result.status == "FINISHED" and order == ["FINISHED", "close"]


def test_a_failing_close_is_still_raised_after_the_callbacks(synthetic_raw, monkeypatch, tmp_path):
    from rayfl.engine.callbacks import Callback
    from rayfl.engine.executor import SerialExecutor

    def close(self):
        raise RuntimeError("close failed")

    monkeypatch.setattr(SerialExecutor, "close", close)
    ended: list[str] = []

    class Watch(Callback):
        def on_run_end(self, sim, status):
            ended.append(status)

    with pytest.raises(RuntimeError, match="close failed"):
        run(tmp_path, synthetic_raw, ["engine.rounds=1"], callbacks=[Watch()])
    assert ended == ["FINISHED"]


@pytest.mark.slow
def test_a_resumed_run_sums_the_wall_time_of_its_pieces(synthetic_raw, tmp_path):
    def piece(rounds, resume):
        cfg = build_config(synthetic_raw, [f"engine.rounds={rounds}"])
        callbacks = [Checkpoint(tmp_path, 1, resume=resume), RunDirectory(tmp_path)]
        return Simulation(cfg, tmp_path, callbacks)

    first = piece(1, resume=False)
    first.started -= 1000.0  # as if the first piece had run for 1000 s more
    w1 = first.run().history[-1]["time/wall_s"]
    assert w1 >= 1000.0
    second = piece(2, resume=True)
    history = second.run().history
    assert second.wall_before == w1
    assert history[0]["time/wall_s"] == w1 and history[1]["time/wall_s"] > w1
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["status"] == "FINISHED" and summary["wall_s"] >= history[1]["time/wall_s"]
    assert "error" not in summary


@pytest.mark.slow
def test_a_resumed_run_lists_the_commit_of_each_piece(synthetic_raw, tmp_path, monkeypatch):
    import rayfl.engine.callbacks as callbacks

    def piece(rounds, resume, commit):
        monkeypatch.setattr(callbacks, "git_commit", lambda: commit)
        cfg = build_config(synthetic_raw, [f"engine.rounds={rounds}"])
        run = [Checkpoint(tmp_path, 1, resume=resume), RunDirectory(tmp_path)]
        Simulation(cfg, tmp_path, run).run()
        return json.loads((tmp_path / "summary.json").read_text())["commits"]

    assert piece(1, False, "a" * 40) == ["a" * 40]
    assert piece(2, True, "b" * 40) == ["a" * 40, "b" * 40]
    assert piece(3, True, "b" * 40) == ["a" * 40, "b" * 40]  # the same code again: listed once
    assert piece(1, False, None) == []  # started afresh outside a repository


@pytest.mark.slow
def test_a_failed_run_records_its_error_in_summary_json(synthetic_raw, tmp_path):
    from rayfl.engine.callbacks import Callback

    class Boom(Callback):
        def on_round_end(self, sim, round_idx, metrics):
            raise RuntimeError("disk on fire\nsecond line")

    cfg = build_config(synthetic_raw, ["engine.rounds=2"])
    sim = Simulation(cfg, tmp_path, [RunDirectory(tmp_path), Boom()])
    with pytest.raises(RuntimeError, match="disk on fire"):
        sim.run()
    assert sim.result.status == "FAILED"
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["status"] == "FAILED"
    assert summary["error"] == "RuntimeError: disk on fire"
