"""`rayfl bench`: variants as processes, the compute floor and the ratios to it."""

from __future__ import annotations

import copy

import pytest
import yaml

from rayfl.bench import FLOOR, Bench, format_report, load_bench, run_bench, summarize
from rayfl.errors import ConfigError
from tests.conftest import SYNTHETIC


def bench_file(tmp_path, section):
    raw = copy.deepcopy(SYNTHETIC)
    raw["engine"]["rounds"] = 1
    raw["bench"] = section
    path = tmp_path / "bench.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def test_the_floor_is_a_single_thread_serial_variant_and_overrides_win(tmp_path):
    path = bench_file(tmp_path, {"variants": {"ray": ["engine.executor=ray"]}})
    bench = load_bench(path, ["engine.rounds=2"])
    assert list(bench.variants) == ["ray", FLOOR]
    assert bench.variants["ray"] == ["engine.executor=ray", "engine.rounds=2"]
    assert "engine.num_threads=1" in bench.variants[FLOOR]
    off = load_bench(bench_file(tmp_path, {"variants": {"a": []}, "floor": False}))
    assert FLOOR not in off.variants
    with pytest.raises(ConfigError, match="reserved"):
        load_bench(bench_file(tmp_path, {"variants": {FLOOR: []}}))


def report(wall, train, workers, rounds):
    rows = [
        {"time/round_s": r, "time/train_s_sum": train / len(rounds), "clients": 4.0} for r in rounds
    ]
    rows[0]["time/startup/first_round_at_s"] = 3.0
    return summarize(
        {
            "rounds": rows,
            "wall_s": wall,
            "workers": workers,
            "clients": 4,
            "driver_peak_mb": 1.0,
            "ray_peak_mb": 2.0,
            "total_peak_mb": 3.0,
            "store_peak_mb": 0.5,
        },
        warmup=1,
    )


def test_ratios_to_the_floor_golden():
    results = {FLOOR: report(50.0, 40.0, 1, [10.0, 10.0]), "ray": report(30.0, 44.0, 2, [9.0, 5.0])}
    assert results["ray"]["round_s"] == 5.0  # the warm-up round is left out
    text = format_report("x.yaml", Bench({}, {}, 1), results)
    ray_line = next(line for line in text.splitlines() if line.strip().startswith("ray"))
    # floor of 2 workers = 40 s / 2 = 20 s; 30 s end to end -> 1.50x
    assert ray_line.split()[-2:] == ["20.0", "1.50"]
    floor_line = next(line for line in text.splitlines() if line.strip().startswith(FLOOR))
    assert floor_line.split()[-2:] == ["40.0", "1.25"]


def test_bench_runs_each_variant_as_a_process(tmp_path):
    path = bench_file(tmp_path, {"warmup_rounds": 0, "variants": {"serial": []}})
    text = run_bench(path, ["data.num_clients=3"], out=tmp_path / "out")
    lines = text.splitlines()
    assert any(line.strip().startswith("serial") for line in lines)
    assert any(line.strip().startswith(FLOOR) for line in lines)
    assert (tmp_path / "out" / "report.txt").exists()
    assert (tmp_path / "out" / "serial" / "run" / "summary.json").exists()
