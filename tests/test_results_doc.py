"""docs/results.md is exactly what experiments/make_results.py makes of the files in docs/results/."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def make_results():
    spec = importlib.util.spec_from_file_location(
        "make_results", ROOT / "experiments" / "make_results.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def verified(tmp_path, monkeypatch):
    """`results_plan` with its result files under `tmp_path` and a git whose every diff answers
    `same["code"]`: whether the package, suites and plan equal a verify's code."""
    import subprocess

    import results_plan

    same = {"code": True}
    monkeypatch.setattr(
        results_plan,
        "git",
        lambda *a: subprocess.CompletedProcess(a, 0 if same["code"] else 1, "", ""),
    )
    monkeypatch.setattr(results_plan, "RESULTS", tmp_path)
    return results_plan, same


def test_results_page_matches_its_files(make_results):
    # Fails when a result file changed without `python3 experiments/make_results.py`, or when
    # docs/results.md was edited by hand.
    assert (ROOT / "docs" / "results.md").read_text() == make_results.page()


def test_paired_differences_to_the_best_baseline_golden(make_results):
    runs = {"a": {0: 0.80, 1: 0.90}, "b": {0: 0.70, 1: 0.86}, "m": {0: 0.85, 1: 0.89}}
    best, rows = make_results.paired_rows(runs, ["a", "b"])
    assert best == "a"  # mean 0.85 against b's 0.78
    by = {r[0]: r for r in rows}
    # m - a per seed: +5.0, -1.0 points; mean +2.0, sample std 4.2
    assert by["m"][1:] == ["+2.0 ± 4.2 (2)", "+5.0, -1.0"]
    assert by["b"][1] == "-7.0 ± 4.2 (2)"


def _part(seed: int, accs: dict[str, float], gain: float) -> dict:
    runs = [
        {"label": k, "seed": seed, "setting": "x", "final": {"personal/acc": v}}
        for k, v in accs.items()
    ]
    runs[-1]["final"]["baseline/federated_gain_points"] = gain
    return {"commit": "abc1234", "command": "rayfl compare s.yaml", "runs": runs}


def test_a_plan_table_shows_its_parts_means_and_paired_differences(make_results, tmp_path):
    import results_plan

    spec = {
        "title": "T",
        "suite": "s.yaml",
        "rounds": 2,
        "seeds": [0, 1, 2],
        "settings": ["x"],
        "metric": "personal/acc",
        "baselines": ["a", "b"],
        "columns": {"baseline/federated_gain_points": "federated gain (pts)"},
        "what": "w",
        "protocol": "p",
        "round_s": {"a": 1, "b": 1, "m": 2},
    }
    table = results_plan.Table("t", spec)
    assert table.parts() == ["x-s0", "x-s1", "x-s2"] and table.part_cost_s("x-s1") == 8
    assert results_plan.split_part("dir0.1-s2") == ("dir0.1", 2, "")
    assert results_plan.split_part("s1") == ("", 1, "")
    original = results_plan.RESULTS
    results_plan.RESULTS = tmp_path
    try:
        (tmp_path / "t").mkdir()
        for seed, accs, gain in [(0, (0.80, 0.70, 0.85), 1.5), (1, (0.90, 0.86, 0.89), 2.5)]:
            part = _part(seed, dict(zip("abm", accs)), gain)
            if seed == 1:
                part["runs"][1]["nonfinite"] = ["train/loss"]  # b's training diverged
            (tmp_path / "t" / f"x-s{seed}.json").write_text(json.dumps(part))
        text = "\n".join(make_results.plan_section(table))
    finally:
        results_plan.RESULTS = original
    assert text.startswith("## T — PARTIAL")
    assert "Parts done: 2 of 3 (missing: x-s2)" in text and "`abc1234`" in text
    # a: 85.0 ± 7.1; m - a per seed +5.0, -1.0 (mean +2.0, std 4.2); m's gain 2.0 ± 0.7 points
    assert "| a | 2 | 85.0 ± 7.1 | – | best baseline |  |" in text
    assert "| m | 2 | 87.0 ± 2.8 | +2.0 ± 0.7 | +2.0 ± 4.2 (2) | +5.0, -1.0 |" in text
    assert "**Non-finite final metrics (a client's training diverged):** b seed 1." in text


def test_a_controlled_table_shows_each_seeds_gains_and_their_mean(make_results, tmp_path):
    import results_plan

    spec = {"title": "C", "render": "controlled", "suite": "s.yaml", "rounds": 2}
    spec |= {"seeds": [0, 1], "what": "w", "protocol": "p", "round_s": {"m": 1}}
    table = results_plan.Table("c", spec)
    original = results_plan.RESULTS
    results_plan.RESULTS = tmp_path
    try:
        (tmp_path / "c").mkdir()
        for seed, acc, local, control in [(1, 0.84, 0.83, 0.80), (0, 0.80, 0.81, 0.78)]:
            final = {"personal/acc": acc, "baseline/local_acc": local}
            final |= {"baseline/control_acc": control}
            final |= {"baseline/gain_points": 100 * (acc - local)}
            final |= {"baseline/federated_gain_points": 100 * (acc - control)}
            run = {"label": "m", "seed": seed, "setting": "", "final": final, "history": []}
            part = {"commit": "abc1234", "command": "rayfl compare s.yaml", "runs": [run]}
            (tmp_path / "c" / f"s{seed}.json").write_text(json.dumps(part))
        text = "\n".join(make_results.controlled_section(make_results.controlled_plan_data(table)))
    finally:
        results_plan.RESULTS = original
    assert text.startswith("## C\n") and "commit `abc1234`" in text
    # seeds in order; gains over local -1.0 and +1.0 (mean 0.0, std 1.4), over the control +2.0
    # and +4.0 (mean +3.0, std 1.4); no proxy accuracy recorded
    assert "| 0 | FINISHED | 80.0 | 81.0 | 78.0 | -1.00 | +2.00 | – |" in text
    assert "| 1 | FINISHED | 84.0 | 83.0 | 80.0 | +1.00 | +4.00 | – |" in text
    assert (
        "| mean ± std | 2 seeds | 82.0 ± 2.8 | 82.0 ± 1.4 | 79.0 ± 1.4 | +0.0 ± 1.4 | +3.0 ± 1.4 | – |"
        in text
    )


def test_a_table_names_the_commits_its_runs_ran_at(make_results):
    def part(commit, *runs):
        return {"commit": commit, "runs": [{"commits": c} if c is not None else {} for c in runs]}

    every_run_knows = part("p1", ["a1"], ["a1", "b1"])
    assert make_results.part_commits([every_run_knows]) == ["a1", "b1"]  # not the plan's p1
    older = part("p2", None, ["c1"])  # a run made before runs recorded their commits
    assert make_results.part_commits([every_run_knows, older]) == ["a1", "b1", "c1", "p2"]


def test_a_per_round_table_pairs_each_round_with_the_best_baseline(make_results):
    def run(label, seed, accs):
        history = [{"round": i + 1, "personal/acc": a} for i, a in enumerate(accs)]
        return {"label": label, "seed": seed, "history": history}

    runs = [run("a", 0, [0.5, 0.7]), run("a", 1, [0.6, 0.8])]
    runs += [run("m", 0, [0.52, 0.69]), run("m", 1, [0.64, 0.81])]
    text = "\n".join(make_results.per_round_table(runs, "personal/acc", ["a"]))
    # round 1: a 55.0 ± 7.1, m - a +2.0 and +4.0 points; round 2: -1.0 and +1.0
    assert "| round | a | m: paired Δ | m: paired Δ per seed |" in text
    assert "| 1 | 55.0 ± 7.1 | +3.0 ± 1.4 (2) | +2.0, +4.0 |" in text
    assert "| 2 | 75.0 ± 7.1 | +0.0 ± 1.4 (2) | -1.0, +1.0 |" in text


def test_a_table_with_method_groups_splits_each_setting_and_seed_into_group_parts():
    import results_plan

    spec = {"suite": "s.yaml", "rounds": 10, "seeds": [0, 1], "settings": ["dir0.1"]}
    spec |= {"round_s": {"a": 1, "b": 2, "m": 30}, "groups": {"base": ["a", "b"], "new": ["m"]}}
    table = results_plan.Table("t", spec)
    assert table.parts() == ["dir0.1-s0-base", "dir0.1-s0-new", "dir0.1-s1-base", "dir0.1-s1-new"]
    assert results_plan.split_part("dir0.1-s1-new") == ("dir0.1", 1, "new")
    assert results_plan.part_name("dir0.1", 1, "new") == "dir0.1-s1-new"
    # (1 + 2) x 10 and 30 x 10 core-seconds; the group's labels select its runs of the suite
    assert table.part_cost_s("dir0.1-s0-base") == 30 and table.max_part_cost_s() == 300
    command = table.command("dir0.1-s1-base")
    assert "seeds=[1]" in command and "settings=[dir0.1]" in command
    assert "algorithms=[a,b]" in command and command[-1].endswith("t/dir0.1-s1-base")


def test_every_plan_table_names_its_suites_methods_and_settings(make_results):
    import results_plan

    from rayfl.compare import load_suite

    for table in results_plan.load_plan():
        suite = load_suite(table.suite)
        labels = {r.label for r in suite.runs}
        assert labels == set(table.methods()), table.name  # round_s prices every method
        grouped = [m for g in table.groups().values() for m in g]
        assert sorted(grouped) == sorted(table.methods()), table.name  # each method in one group
        assert set(table.spec["baselines"]) <= labels, table.name
        settings = {r.setting for r in suite.runs}
        assert {s for s in table.settings() if s} <= settings, table.name


def test_stopping_the_plan_stops_its_running_parts_and_starts_no_other(make_results, tmp_path):
    import results_plan

    parts = results_plan.Parts()
    with (tmp_path / "log").open("w") as out:
        running = [parts.start(["sleep", "60"], out) for _ in range(2)]
        assert all(p is not None for p in running)
        parts.stop()
        assert [parts.wait(p) for p in running if p is not None] == [-2, -2]  # SIGINT
        assert parts.start(["sleep", "60"], out) is None
    assert parts.running == set()


def test_clients_no_better_than_a_one_class_guess_are_named(make_results, tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq
    import results_plan

    # client 0 holds classes 1 and 9 (300 + 300 test images), client 1 only class 3
    rows = [(0, "test", 1, 300), (0, "test", 9, 300), (0, "train", 1, 1200), (1, "test", 3, 40)]
    rows += [(1, "test", 9, 0)]
    columns = dict(zip(("client", "split", "class", "count"), map(list, zip(*rows))))
    pq.write_table(pa.table(columns), tmp_path / "class_counts.parquet")
    assert results_plan.commonest_share(tmp_path) == {0: 0.5, 1: 1.0}

    def client(cid, acc, commonest):
        return {"client": cid, "arch": "cnn4", "acc": acc, "commonest": commonest}

    collapsed = {"label": "m", "seed": 1, "clients": [client(13, 0.0, 0.5), client(2, 1.0, 1.0)]}
    fine = {"label": "a", "seed": 1, "clients": [client(13, 0.98, 0.5), client(2, 1.0, None)]}
    # a client that holds one class, or a part file without the shares, is never named
    assert make_results.one_class_line([{**fine, "clients": [client(2, 1.0, None)]}]) == []
    assert "\n".join(make_results.one_class_line([fine])).strip().endswith(": none.")
    text = "\n".join(make_results.one_class_line([fine, collapsed])).strip()
    assert "would score 66.7% (unweighted" in text  # mean of 0.5, 0.5 and 1.0 (None left out)
    assert text.endswith(": m 1 (s1 c13 cnn4 0.0/50.0%).")
    many = {**collapsed, "clients": [client(i, 0.4, 0.5) for i in range(4)]}
    assert "\n".join(make_results.one_class_line([many])).strip().endswith(": m 4.")


def test_a_table_says_which_commits_give_the_current_codes_numbers(make_results, tmp_path):
    import results_plan

    same = results_plan.compare_numbers(
        {"a/acc": 0.5, "a/loss": 1.0}, {"a/acc": 0.5, "a/loss": 1.0}
    )
    assert same["equal"] and same["numbers"] == 2
    moved = results_plan.compare_numbers({"a/acc": 0.5, "a/x": 1.0}, {"a/acc": 0.5000001})
    assert not moved["equal"] and moved["differ"] == ["a/acc"] and moved["only_old"] == ["a/x"]
    dropped = results_plan.compare_numbers({"a/acc": 0.5, "a/x": 1.0}, {"a/acc": 0.5})
    assert dropped["equal"] and dropped["only_old"] == ["a/x"]  # a metric no longer reported
    assert not results_plan.compare_numbers({}, {})["equal"]  # nothing compared proves nothing
    part = {"commit": "p1", "runs": [{"label": "a", "commits": ["c1"]}, {"label": "b"}]}
    assert results_plan.ran_at(part, "c1") == {"a"} and results_plan.ran_at(part, "p1") == {"b"}
    assert results_plan.part_args("rayfl compare s.yaml seeds=[0] --out runs/x") == [
        "compare",
        "s.yaml",
        "seeds=[0]",
    ]
    spec = {"suite": "s.yaml", "rounds": 2, "seeds": [0], "round_s": {"a": 1}}
    table = results_plan.Table("t", spec)
    original = results_plan.RESULTS
    results_plan.RESULTS = tmp_path
    try:
        (tmp_path / "t").mkdir()
        assert "Not checked against the current code" in make_results.code_note(table, ["c1"])
        verdicts = {
            "c1": {"equal": True, "parts": [{"part": "s0", "equal": True}]},
            "c2": {"equal": False, "parts": [{**moved, "part": "s0"}]},
            "c4": {"equal": True, "parts": [{**dropped, "part": "s0"}]},
            "c5": {"equal": True, "identical": True, "parts": []},  # no run needed
        }
        code = {"code": "head", "check": ["engine.rounds=2"], "commits": verdicts}
        table.code_file().write_text(json.dumps(code))
        text = make_results.code_note(table, ["c1", "c2", "c3", "c4", "c5"])
    finally:
        results_plan.RESULTS = original
    assert "Checked against `head`" in text and "cut to engine.rounds=2" in text
    assert "the same numbers at `c1`, `c4`" in text and "not checked: `c3`" in text
    assert "**different at `c2`** (`a/acc` differ; `a/x` reported then only)" in text
    assert "at `c4` `a/x` reported then only" in text
    assert "the same package, suites and commands at `c5`" in text
    two = {"parts": [{**dropped, "part": "x-s0"}, {**dropped, "part": "y-s0"}]}
    assert make_results.differences(two) == "`a/x` reported then only"  # once, not per part


@pytest.mark.slow
def test_verify_reruns_a_commits_parts_at_that_commit_and_now(
    make_results, tmp_path, synthetic_raw
):
    """End to end at this clone's HEAD: a part recorded with the current command (its rounds
    aside, which the check cuts) gives the same numbers; one recorded with another learning
    rate does not."""
    import results_plan
    import yaml

    base = {k: v for k, v in synthetic_raw.items() if k not in ("name", "seed", "algorithm")}
    base["data"]["options"]["num_samples"] = 1200  # verify's check takes a thousand
    base["engine"]["rounds"] = 5
    suite = {
        "suite": "tiny",
        "base": base,
        "algorithms": [{"name": "fedproto"}],
        "settings": [{"name": "x", "overrides": {}}, {"name": "y", "overrides": {}}],
        "seeds": [0],
    }
    (tmp_path / "suite.yaml").write_text(yaml.safe_dump(suite))
    spec = {"suite": str(tmp_path / "suite.yaml"), "rounds": 3, "seeds": [0]}
    table = results_plan.Table("t", {**spec, "settings": ["x", "y"], "round_s": {"fedproto": 1}})
    head = results_plan.git("rev-parse", "--short", "HEAD").stdout.strip()
    original = results_plan.RESULTS
    results_plan.RESULTS = tmp_path / "results"
    try:
        (tmp_path / "results" / "t").mkdir(parents=True)
        for part, extra in [("x-s0", []), ("y-s0", ["train.lr=0.5"])]:
            args = [*table.command(part)[3:], *extra]
            args = [a if a != f"engine.rounds={table.rounds}" else "engine.rounds=5" for a in args]
            record = {"commit": head, "command": "rayfl " + " ".join(args)}
            record["runs"] = [{"label": "fedproto"}]  # made before runs recorded their commits
            table.result(part).write_text(json.dumps(record))
        verdict = results_plan.verify(table, lambda msg: None)["commits"][head]
    finally:
        results_plan.RESULTS = original
    x, y = verdict["parts"]
    assert x["part"] == "x-s0" and x["equal"] and x["numbers"] > 10
    assert x["methods"] == ["fedproto"]
    assert y["part"] == "y-s0" and not y["equal"] and "fedproto/personal/acc" in y["differ"]
    # a setting differs even where it does not bind
    assert "fedproto/config/train.lr" in y["differ"]
    assert not verdict["equal"]
    worktrees = results_plan.git("worktree", "list", "--porcelain").stdout.splitlines()
    assert not [w for w in worktrees if "rayfl-verify-" in w and w.endswith(f"/{head}")]


def test_verify_keeps_the_verdicts_it_ran_against_the_same_code(tmp_path, verified):
    results_plan, same = verified
    table = results_plan.Table("t", {"suite": "s.yaml", "rounds": 2, "seeds": [0]})
    assert results_plan.still_valid(table) == {}  # never verified
    ran = {"equal": True, "parts": [{"part": "s0", "equal": True}]}
    verdicts = {"a1": ran, "b1": {"equal": True, "identical": True, "parts": []}}
    (tmp_path / "t").mkdir()
    last = {"code": "abc1234", "check": table.check, "commits": verdicts}
    table.code_file().write_text(json.dumps(last))
    assert results_plan.still_valid(table) == {"a1": ran}  # identical ones depend on commands
    same["code"] = False  # the package, a suite or the plan changed since
    assert results_plan.still_valid(table) == {}
    same["code"] = True
    table.code_file().write_text(json.dumps({**last, "check": ["engine.rounds=1"]}))
    assert results_plan.still_valid(table) == {}
    table.code_file().write_text(json.dumps({**last, "code": "abc1234+dirty"}))
    assert results_plan.still_valid(table) == {}


def test_status_names_the_commits_not_verified_against_this_code(tmp_path, verified):
    results_plan, same = verified
    spec = {"suite": "s.yaml", "rounds": 2, "seeds": [0, 1], "round_s": {"a": 1, "b": 1}}
    table = results_plan.Table("t", spec)
    (tmp_path / "t").mkdir()
    s0 = {"commit": "c1", "runs": [{"label": "a"}, {"label": "b", "commits": ["c2"]}]}
    table.result("s0").write_text(json.dumps(s0))
    table.result("s1").write_text(json.dumps({"commit": "c3", "runs": [{"label": "a"}]}))
    assert results_plan.unverified(table) == ["c1", "c2", "c3"]  # never verified
    verdicts = {
        "c1": {"equal": True, "parts": [{"part": "s0", "equal": True}]},
        "c2": {"equal": False, "parts": [{"part": "s0", "equal": False}]},
    }
    last = {"code": "abc1234", "check": table.check, "commits": verdicts}
    table.code_file().write_text(json.dumps(last))
    assert results_plan.unverified(table) == ["c2", "c3"]  # differs; made after the last verify
    same["code"] = False  # the package, a suite or the plan changed since
    assert results_plan.unverified(table) == ["c1", "c2", "c3"]
    line = results_plan.status([table], jobs=2)[0]
    assert line.endswith("commits not verified against this code: c1, c2, c3")
