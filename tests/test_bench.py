"""The speed benchmark (experiments/benchmarks/bench.py, outside the package): variants as
processes, the compute floor and the ratios to it; its folder read back as untrusted input; the
privacy protocol's cost (privacy_protocol.py)."""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest
import yaml

from rayfl import gate
from rayfl.config import build_config
from rayfl.errors import ConfigError, UserError
from rayfl.sampling import sample_clients
from tests.conftest import SYNTHETIC
from tests.security.plants import PLANTS, PROBLEM, VICTIM, one_line

BENCHMARKS = Path(__file__).resolve().parents[1] / "experiments" / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))  # the scripts import each other as `python3 bench.py` does

import bench  # noqa: E402
import bench_floors  # noqa: E402
import privacy_protocol  # noqa: E402
from bench import (  # noqa: E402
    FLOOR,
    Bench,
    floor_label,
    format_report,
    load_bench,
    median_repetition,
    only,
    run_bench,
    summarize,
)
from bench_floors import floor_shares, ray_floor_label  # noqa: E402


def bench_file(tmp_path, section):
    raw = copy.deepcopy(SYNTHETIC)
    raw["engine"]["rounds"] = 1
    raw["bench"] = section
    path = tmp_path / "bench.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def test_overrides_win_and_each_worker_count_gets_its_floor(tmp_path):
    variants = {
        "ray": ["engine.executor=ray", "engine.num_workers=2"],
        "ray3": ["engine.executor=ray", "engine.num_workers=3"],
        "serial": [],
    }
    path = bench_file(tmp_path, {"variants": variants})
    bench = load_bench(path, ["engine.rounds=2"])
    assert list(bench.variants) == ["ray", "ray3", "serial"]
    assert bench.variants["ray"] == [
        "engine.executor=ray",
        "engine.num_workers=2",
        "engine.rounds=2",
    ]
    assert bench.floors() == [1, 2, 3]
    assert only(bench, ["ray"]).floors() == [2]
    with pytest.raises(ConfigError, match="no such variant; this benchmark has ray, ray3, serial"):
        only(bench, ["grouped"])
    off = load_bench(bench_file(tmp_path, {"variants": {"a": []}, "floor": False}))
    assert off.floors() == []
    with pytest.raises(ConfigError, match="reserved"):
        load_bench(bench_file(tmp_path, {"variants": {FLOOR: []}}))
    with pytest.raises(ConfigError, match="reserved"):
        load_bench(bench_file(tmp_path, {"variants": {floor_label(2): []}}))
    with pytest.raises(ConfigError, match="reserved"):
        load_bench(bench_file(tmp_path, {"variants": {ray_floor_label(2): []}}))
    with pytest.raises(ConfigError, match="bench.ray_floor needs bench.floor"):
        load_bench(bench_file(tmp_path, {"variants": {"a": []}, "floor": False, "ray_floor": True}))
    assert load_bench(bench_file(tmp_path, {"variants": {"a": []}, "ray_floor": True})).ray_floor


def test_floor_shares_hold_every_training_once_with_equal_work():
    cfg = build_config(SYNTHETIC, ["engine.rounds=4", "data.num_clients=5", "engine.fraction=0.6"])
    sizes = [50, 10, 40, 30, 20]
    shares = floor_shares(cfg, sizes, 2)
    jobs = sorted(j for share in shares for j in share)
    expected = sorted((r, c) for r in range(1, 5) for c in sample_clients(cfg.seed, r, 5, 3))
    assert jobs == expected  # every sampled client of every round, once
    loads = [sum(sizes[c] for _, c in share) for share in shares]
    assert abs(loads[0] - loads[1]) <= max(sizes)  # largest first: within one client
    assert all(share == sorted(share) for share in shares)  # trained in round order


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


def floor_report(wall, train, workers, startup=3.0):
    return summarize(
        {
            "rounds": [],
            "floor": True,
            "wall_s": wall,
            "workers": workers,
            "clients": 4,
            "per_round": 4,
            "startup_s": startup,
            "in_run_s": train / workers,
            "train_s": train,
            "trainings": 8,
            "driver_peak_mb": float("nan"),
            "ray_peak_mb": float("nan"),
            "total_peak_mb": 3.0,
            "store_peak_mb": 0.0,
        },
        warmup=1,
    )


def test_rounds_without_evaluation_and_the_evaluation_are_reported_apart():
    result = report(30.0, 40.0, 2, [9.0, 5.0, 7.0, 12.0])
    result_rows = result["rounds"]
    result_rows[2].update({"eval/clients": 4.0, "time/eval_s": 2.0})
    result_rows[3].update({"eval/clients": 4.0, "time/eval_s": 4.0})
    again = summarize(result, warmup=1)
    assert again["round_s"] == 8.0  # rounds 2-4
    assert again["plain_round_s"] == 5.0  # round 2 only: 3 and 4 evaluated
    assert again["eval_s"] == 3.0
    line = next(
        x
        for x in format_report("x.yaml", Bench({}, {}, 1), {"ray": again}).splitlines()
        if x.split()[:1] == ["ray"]
    )
    assert line.split()[7:10] == ["8.00", "5.00", "3.00"]


def test_the_table_reports_what_spilled_to_disk_apart_from_memory():
    result = report(30.0, 40.0, 2, [9.0, 5.0])
    result["spilled_mb"] = 3900.0  # e.g. 10,000 clients' state beyond a 1 GB store
    text = format_report("x.yaml", Bench({}, {}, 1), {"ray": result})
    header = next(x for x in text.splitlines() if "store MB" in x).split()
    line = next(x for x in text.splitlines() if x.split()[:1] == ["ray"]).split()
    assert header[header.index("spill") - 1 : header.index("spill") + 2] == ["MB", "spill", "MB"]
    assert line[-3] == "3900.0"  # spill MB, before floor s and x floor
    assert "spill MB = bytes Ray spilled to disk" in text


def test_the_store_probe_measures_the_spill_folder_on_disk(tmp_path):
    probe = bench.StoreProbe(tmp_path / "ray-spill")
    probe.on_round_end(None, 1, {})
    assert probe.spilled_bytes == 0.0  # nothing spilled yet: no folder
    (tmp_path / "ray-spill" / "node").mkdir(parents=True)
    (tmp_path / "ray-spill" / "node" / "obj").write_bytes(b"x" * 3000)
    probe.on_round_end(None, 2, {})
    (tmp_path / "ray-spill" / "node" / "obj").unlink()  # Ray deletes what it restored
    probe.on_round_end(None, 3, {})
    assert probe.spilled_bytes == 3000.0  # the peak


def test_ratios_to_the_floor_of_the_same_worker_count_golden():
    results = {
        floor_label(1): floor_report(45.0, 40.0, 1),
        floor_label(2): floor_report(25.0, 44.0, 2),
        "ray": report(30.0, 44.0, 2, [9.0, 5.0]),
        "serial": report(50.0, 40.0, 1, [10.0, 10.0]),
    }
    assert results["ray"]["round_s"] == 5.0  # the warm-up round is left out
    # 8 trainings of 4 clients a round = 2 rounds, each share holding half of both rounds; the
    # longest share's in-run 22 s -> 11 s a round
    assert results[floor_label(2)]["round_s"] == 11.0
    text = format_report("x.yaml", Bench({}, {}, 1), results)

    def tail(label):
        line = next(x for x in text.splitlines() if x.strip().split()[:1] == [label])
        return line.split()[-2:]

    # ray (2 workers): 30 s end to end against the 2-worker floor's 25 s -> 1.20x
    assert tail("ray") == ["25.0", "1.20"]
    assert tail("serial") == ["45.0", "1.11"]
    assert tail(floor_label(2)) == ["25.0", "1.00"]


@pytest.mark.ray
def test_bench_runs_each_variant_as_a_process(tmp_path):
    path = bench_file(tmp_path, {"warmup_rounds": 0, "variants": {"serial": []}})
    text = run_bench(path, ["data.num_clients=3"], out=tmp_path / "out")
    lines = text.splitlines()
    assert any(line.strip().startswith("serial") for line in lines)
    floor = next(line.split() for line in lines if line.strip().startswith(floor_label(1)))
    assert floor[-1] == "1.00"
    assert (tmp_path / "out" / "report.txt").exists()
    assert (tmp_path / "out" / floor_label(1) / "share0.json").exists()
    assert (tmp_path / "out" / "serial" / "run" / "summary.json").exists()


def test_repetitions_pair_each_variant_with_its_own_floor_golden():
    # The machine slows down in repetition 2: floor and variant both take longer, and the paired
    # ratio stays what it is; the row is the median repetition's (the lower of an even count).
    reps = [
        {floor_label(2): floor_report(50.0, 90.0, 2), "ray": report(60.0, 90.0, 2, [9.0, 5.0])},
        {floor_label(2): floor_report(80.0, 140.0, 2), "ray": report(92.0, 140.0, 2, [9.0, 5.0])},
        {floor_label(2): floor_report(55.0, 99.0, 2), "ray": report(63.0, 99.0, 2, [9.0, 5.0])},
    ]
    combined = median_repetition(reps)
    assert combined["ray"]["wall_s"] == 63.0 and combined[floor_label(2)]["wall_s"] == 55.0
    assert combined["ray"]["ratios"] == pytest.approx([1.2, 1.15, 63.0 / 55.0])
    text = format_report("x.yaml", Bench({}, {}, 1), combined)
    line = next(x for x in text.splitlines() if x.strip().split()[:1] == ["ray"])
    assert line.split()[-1] == "1.15"  # median of 1.20, 1.15, 1.145
    assert "ray: x floor per repetition 1.20 1.15 1.15 (median 1.15)" in text
    assert median_repetition(reps[:2])["ray"]["wall_s"] == 60.0


def test_each_variant_is_also_paired_with_the_ray_floor_golden():
    # rayfloor: the floor's work in Ray actors; a variant's ratio to it is what rayfl adds
    reps = [
        {
            floor_label(2): floor_report(50.0, 90.0, 2),
            ray_floor_label(2): floor_report(54.0, 92.0, 2),
            "ray": report(60.0, 90.0, 2, [9.0, 5.0]),
        },
        {
            floor_label(2): floor_report(80.0, 140.0, 2),
            ray_floor_label(2): floor_report(88.0, 150.0, 2),
            "ray": report(92.0, 140.0, 2, [9.0, 5.0]),
        },
    ]
    combined = median_repetition(reps)
    assert combined["ray"]["ray_ratios"] == pytest.approx([60.0 / 54.0, 92.0 / 88.0])
    assert combined[ray_floor_label(2)]["ratios"] == pytest.approx([1.08, 1.1])
    assert combined[ray_floor_label(2)]["ray_ratios"] == []  # a floor is not paired with itself
    text = format_report("x.yaml", Bench({}, {}, 1), combined)
    assert "ray: x rayfloor-2w per repetition 1.11 1.05 (median 1.08)" in text
    row = next(x for x in text.splitlines() if x.strip().startswith(ray_floor_label(2)))
    assert row.split()[-1] == "1.09"  # the Ray floor's own ratio to the compute floor


@pytest.mark.ray
def test_the_ray_floor_trains_the_floors_shares_in_ray_actors(tmp_path):
    # one private Ray in a child process (started and shut down there), as a run's
    section = {"warmup_rounds": 0, "ray_floor": True, "variants": {"serial": []}}
    out = tmp_path / "out"
    text = run_bench(bench_file(tmp_path, section), ["data.num_clients=3"], out=out)
    row = next(x.split() for x in text.splitlines() if x.strip().startswith(ray_floor_label(1)))
    floor = next(x.split() for x in text.splitlines() if x.strip().startswith(floor_label(1)))
    # same trainings as the floor's; the driver and Ray's processes measured
    assert row[1:4] == floor[1:4] == ["3", "3", "1"]
    assert float(row[4]) > 0 and float(row[5]) > 0  # e2e, start-up
    assert float(row[-7]) > 0 and float(row[-6]) > 0  # driver MB, ray MB
    shares = json.loads((out / ray_floor_label(1) / "rayfloor.json").read_text())["shares"]
    assert [s["trainings"] for s in shares] == [3]  # 1 round, 3 clients, 1 share
    assert "serial: x rayfloor-1w per repetition" in text


def test_repeat_must_be_positive(tmp_path):
    path = bench_file(tmp_path, {"variants": {"serial": []}})
    with pytest.raises(UserError, match="--repeat 0"):
        run_bench(path, repeat=0)


@pytest.mark.ray
def test_the_driver_runs_a_tiny_benchmark_from_the_command_line(tmp_path):
    path = bench_file(tmp_path, {"warmup_rounds": 0, "floor": False, "variants": {"serial": []}})
    proc = subprocess.run(
        [sys.executable, str(BENCHMARKS / "bench.py"), str(path), "data.num_clients=3"]
        + ["--out", str(tmp_path / "out")],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert any(line.strip().startswith("serial") for line in proc.stdout.splitlines())
    bad = subprocess.run(
        [sys.executable, str(BENCHMARKS / "bench.py"), str(path), "--repeat", "0"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert bad.returncode == 2 and bad.stderr.startswith("bench: error: --repeat 0")


def test_protocol_bench_counts_the_bytes_of_one_upload():
    measure, variants = privacy_protocol.measure, privacy_protocol.VARIANTS
    assert measure(variants["dp"], clients=3, size=50)["bytes_up"] == 4 * 50  # float32
    assert measure(variants["secagg"], clients=3, size=50)["bytes_up"] == 8 * 51  # uint64 + weight


def test_rayfl_validates_a_benchmark_as_its_base_run_and_run_names_the_driver(tmp_path, capsys):
    from rayfl.cli import main

    path = bench_file(tmp_path, {"variants": {"serial": []}})
    assert main(["validate", str(path)]) == 0
    assert "ok (benchmark: pfedes on synthetic" in capsys.readouterr().out
    assert main(["run", str(path)]) == 2
    err = capsys.readouterr().err
    assert "is a benchmark" in err and "python3 experiments/benchmarks/bench.py" in err


# ------------------------------------------------------------- the folder, as untrusted input


class _FinishedChild:
    """A child process that already exited 0 (the benchmark's children are not the point)."""

    def __init__(self, *args, **kwargs) -> None:
        self.pid = os.getpid()
        self.returncode = 0

    def communicate(self) -> tuple[str, None]:
        return "", None


@pytest.fixture
def no_children(monkeypatch):
    fake = types.SimpleNamespace(Popen=_FinishedChild, PIPE=-1, STDOUT=-2)
    monkeypatch.setattr(bench_floors, "subprocess", fake)  # every child the benchmark starts


FLOOR_REPORTS = {  # a floor's runner, and the report its children write
    "floor": (bench_floors.run_floor, "share0.json"),
    "rayfloor": (bench_floors.run_ray_floor, "rayfloor.json"),
}


@pytest.mark.parametrize("floor", FLOOR_REPORTS)
@pytest.mark.parametrize("kind", PLANTS)
def test_bench_refuses_an_unsafe_floor_report_in_one_line(
    kind, floor, tmp_path, victim, synthetic_raw, no_children
):
    run, name = FLOOR_REPORTS[floor]
    out = tmp_path / floor
    out.mkdir()
    PLANTS[kind](out / name, victim)
    with pytest.raises(UserError) as info, gate.Folder(out) as folder:
        run(synthetic_raw, (), 1, folder)
    line = one_line(str(info.value))
    assert name in line and PROBLEM[kind] in line
    assert victim.read_bytes() == VICTIM


@pytest.mark.parametrize("kind", PLANTS)
def test_bench_refuses_an_unsafe_variant_report_in_one_line(
    kind, tmp_path, victim, synthetic_raw, no_children
):
    out = tmp_path / "variant"
    (out / "run").mkdir(parents=True)
    PLANTS[kind](out / "run" / "bench.json", victim)
    with pytest.raises(UserError) as info, gate.Folder(out) as folder:
        bench.run_variant(synthetic_raw, [], folder)
    line = one_line(str(info.value))
    assert "bench.json" in line and PROBLEM[kind] in line
    assert victim.read_bytes() == VICTIM


def test_bench_says_in_one_line_when_a_variant_wrote_no_report(
    tmp_path, synthetic_raw, no_children
):
    out = tmp_path / "variant"
    (out / "run").mkdir(parents=True)  # the child exited 0 but wrote no bench.json
    with pytest.raises(UserError) as info, gate.Folder(out) as folder:
        bench.run_variant(synthetic_raw, [], folder)
    line = one_line(str(info.value))
    assert "bench.json" in line and "without writing its report" in line


def test_bench_replaces_a_symlinked_config_instead_of_writing_through_it(
    tmp_path, victim, synthetic_raw, no_children
):
    out = tmp_path / "variant"
    (out / "run").mkdir(parents=True)
    (out / "bench_config.yaml").symlink_to(victim)
    report = {"rounds": [], "store_peak_mb": 0.0, "spilled_mb": 0.0, "status": "FINISHED"}
    gate.write(out / "run" / "bench.json", json.dumps(report).encode())  # as its child writes it
    with gate.Folder(out) as folder:
        report = bench.run_variant(synthetic_raw, [], folder)
    assert report["clients"] == synthetic_raw["data"]["num_clients"]
    assert victim.read_bytes() == VICTIM
    assert not (out / "bench_config.yaml").is_symlink()
    assert yaml.safe_load((out / "bench_config.yaml").read_text())["seed"] == synthetic_raw["seed"]


def test_flower_comparison_exports_rayfls_federation(tmp_path):
    """Flower's clients get exactly rayfl's split: the same train and test indices per client,
    the raw images and the normalisation, from the benchmark config without its bench section."""
    import flower
    import numpy as np

    from rayfl.config import load_config
    from rayfl.data.federated import prepare_federation

    config, overrides = flower.run_config(tmp_path, rounds=3)
    assert "bench" not in yaml.safe_load(config.read_text())
    assert overrides == ["engine.rounds=3", "engine.eval_every=3"]
    small = copy.deepcopy(SYNTHETIC)
    path = tmp_path / "small.yaml"
    path.write_text(yaml.safe_dump(small))
    spec = flower.export(path, ["engine.rounds=4"], tmp_path / "fed.npz")
    assert spec["clients"] == 6 and spec["rounds"] == 4 and spec["batch_size"] == 32
    fed = prepare_federation(load_config(path, ["engine.rounds=4"]))
    got = np.load(tmp_path / "fed.npz")
    assert np.array_equal(got["x"], fed.dataset.x_train)
    for i, c in enumerate(fed.clients):
        assert np.array_equal(got[f"train{i}"], c.train)
        assert np.array_equal(got[f"test{i}"], c.test)
