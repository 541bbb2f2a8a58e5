"""A sweep killed with SIGKILL mid-way (driver, Ray and trials: its whole process group) resumes
from the snapshot of Tune's state sealed after its last finished trial, to the numbers of an
uninterrupted sweep."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from rayfl.tune.state import SEAL
from tests.test_tune import _write

REPO = Path(__file__).resolve().parents[1]
VALUES = [1.0, 2.0, 3.0, 4.0]


def _tune(path: Path, out: Path, *extra: str) -> subprocess.Popen:
    code = "import sys; from rayfl.cli import main; sys.exit(main(sys.argv[1:]))"
    cmd = [sys.executable, "-c", code, "tune", str(path), "--out", str(out), *extra]
    env = {
        **os.environ,
        "PYTHONPATH": str(REPO),
        # Tune saves its state every step: the kill comes right after a snapshot
        "TUNE_GLOBAL_CHECKPOINT_S": "0",
    }
    return subprocess.Popen(
        cmd, env=env, cwd=path.parent, start_new_session=True, stdout=subprocess.DEVNULL
    )


@pytest.mark.slow
def test_a_sweep_killed_mid_way_resumes_to_the_uninterrupted_numbers(tmp_path, synthetic_raw):
    from rayfl.launch import simulate
    from rayfl.tune import load_sweep

    sweep_file = {
        "space": {"algorithm.T": {"grid": VALUES}},
        "overrides": ["engine.rounds=2", "engine.ray_num_cpus=2"],
        "tune": {"max_concurrent": 1, "verbose": 0},
    }
    path = _write(tmp_path, synthetic_raw, sweep_file)
    out = tmp_path / "out"
    proc = _tune(path, out)
    try:
        deadline = time.monotonic() + 300
        while not (out / SEAL).exists() and proc.poll() is None:
            assert time.monotonic() < deadline, "no trial finished in time"
            time.sleep(0.2)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)  # the driver, its Ray and the running trial
        proc.wait()
    assert not (out / "results.parquet").exists(), "the sweep ended before it was killed"

    resumed = _tune(path, out, "tune.resume=true")
    assert resumed.wait(timeout=600) == 0
    rows = {r["algorithm.T"]: r for r in pq.read_table(out / "results.parquet").to_pylist()}
    assert sorted(rows) == VALUES and {r["status"] for r in rows.values()} == {"done"}

    sweep = load_sweep(path)
    for value in VALUES:  # each trial's experiment run straight, outside Tune
        result = simulate(sweep.config_for({"algorithm.T": value}), tmp_path / f"straight{value}")
        assert rows[value]["personal/acc"] == result.final["personal/acc"]
        assert rows[value]["personal/val_acc"] == result.final["personal/val_acc"]


def test_a_trial_that_finished_after_the_restored_state_is_replayed(tmp_path):
    import json

    from rayfl import gate
    from rayfl.tables import write_table
    from rayfl.tune.trial import replay

    sent: list[dict[str, float]] = []
    assert not replay(tmp_path, "personal/val_acc", sent.append)  # nothing ran there: run it
    rows = [{"round": 1.0, "personal/acc": 0.5}]
    rows += [{"round": 2.0, "personal/acc": 0.625, "personal/val_acc": 0.75}]
    write_table(rows, tmp_path / "metrics")
    gate.write(tmp_path / "summary.json", json.dumps({"status": "FINISHED"}).encode())
    assert replay(tmp_path, "personal/val_acc", sent.append)
    assert sent == [{"round": 2.0, "personal/acc": 0.625, "personal/val_acc": 0.75}]


def test_a_seal_of_the_older_format_is_refused_in_one_line(tmp_path):
    import json

    from rayfl import gate
    from rayfl.errors import UserError
    from rayfl.tune.state import check_tune_state

    (tmp_path / "tune" / "tiny").mkdir(parents=True)
    gate.write(tmp_path / SEAL, json.dumps({"tiny/tuner.pkl": "ab" * 32}).encode())
    with pytest.raises(UserError, match="older format"):
        check_tune_state(tmp_path, "tiny")
