"""Checkpoints: no pickle, no torn state, a manifest that refuses what it did not write."""

import json
import math
import os
import pickle

import numpy as np
import pytest

from rayfl.config import build_config
from rayfl.engine import checkpoint as ckpt_mod
from rayfl.engine.checkpoint import Checkpoint, decode_state, encode_state, load_state, state_bytes
from rayfl.engine.loop import Simulation
from rayfl.errors import UserError
from rayfl.sampling import sample_clients


def comparable(history):
    return [{k: v for k, v in r.items() if not k.startswith("time/")} for r in history]


def run(raw, tmp_path, rounds, resume=False, overrides=()):
    cfg = build_config(raw, [f"engine.rounds={rounds}", *overrides])
    return Simulation(cfg, tmp_path, [Checkpoint(tmp_path, 1, resume=resume)]).run().history


def test_state_encoding_round_trips_exactly_without_pickle(tmp_path):
    state = {
        "global": {"w": np.arange(6, dtype=np.float32).reshape(2, 3), "n": np.int64(7)},
        "table": {3: np.ones(2), 0: np.zeros(2)},
        "consensus": None,
        "ema": [0.1, float("nan"), float("inf")],
        "shape": (2, "x", True),
        "count": 12,
    }
    path = tmp_path / "s.npz"
    path.write_bytes(state_bytes(state))
    back = load_state(path)
    assert set(back["table"]) == {3, 0}  # int keys stay ints
    np.testing.assert_array_equal(back["global"]["w"], state["global"]["w"])
    assert back["global"]["w"].dtype == np.float32 and back["global"]["n"] == 7
    assert back["consensus"] is None and back["shape"] == (2, "x", True) and back["count"] == 12
    assert back["ema"][0] == 0.1 and math.isnan(back["ema"][1]) and back["ema"][2] == math.inf
    with np.load(path, allow_pickle=False) as z:  # every member loads without pickle
        assert all(z[k].dtype != object for k in z.files)
    with pytest.raises(TypeError, match=r"state\.bad"):
        encode_state({"bad": object()})
    tree, arrays = encode_state({"a": np.ones(1)})
    assert decode_state(json.loads(json.dumps(tree)), arrays)["a"][0] == 1.0


def test_an_old_pickle_checkpoint_is_refused_and_never_loaded(synthetic_raw, tmp_path):
    marker = tmp_path / "pwned"

    class Evil:
        def __reduce__(self):
            return (open, (str(marker), "w"))

    old = tmp_path / "checkpoint"
    old.mkdir()
    (old / "server.pkl").write_bytes(pickle.dumps(Evil()))
    (old / "meta.json").write_text(json.dumps({"round": 1, "history": []}))
    with pytest.raises(UserError, match="pickle") as err:
        run(synthetic_raw, tmp_path, 2, resume=True)
    assert "\n" not in str(err.value)
    assert not marker.exists()


def test_a_pickled_array_with_a_manifest_to_match_is_refused_unread(synthetic_raw, tmp_path):
    # anyone who can write the folder can rewrite manifest.json: the gate's key cannot
    run(synthetic_raw, tmp_path, 1)
    folder = tmp_path / os.readlink(tmp_path / "checkpoint")
    server = folder / "server.npz"
    np.savez(
        server, __tree__=np.frombuffer(b'{"a": "a0"}', np.uint8), a0=np.array([{}], dtype=object)
    )
    manifest = json.loads((folder / "manifest.json").read_text())
    data = server.read_bytes()
    import hashlib

    manifest["files"]["server.npz"] = {
        "bytes": len(data),
        "sha256": hashlib.sha256(data).hexdigest(),
    }
    (folder / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(UserError, match="not written by your rayfl"):
        run(synthetic_raw, tmp_path, 2, resume=True)


def test_every_client_stays_in_the_checkpoint_and_unchanged_files_are_linked(
    synthetic_raw, tmp_path
):
    run(synthetic_raw, tmp_path, 1, overrides=["engine.fraction=0.34"])
    round1 = {p.name: p.stat().st_ino for p in (tmp_path / "checkpoint" / "clients").iterdir()}
    run(synthetic_raw, tmp_path, 2, resume=True, overrides=["engine.fraction=0.34"])
    manifest = json.loads((tmp_path / "checkpoint" / "manifest.json").read_text())
    first, second = set(sample_clients(0, 1, 6, 2)), set(sample_clients(0, 2, 6, 2))
    assert manifest["round"] == 2 and first - second
    assert sorted(manifest["files"]) == sorted(
        ["server.npz", "history.json"] + [f"clients/{c}.npz" for c in first | second]
    )
    clients = tmp_path / "checkpoint" / "clients"
    for c in first - second:  # not trained in round 2: the same file, hard-linked
        assert (clients / f"{c}.npz").stat().st_ino == round1[f"{c}.npz"]
    for c in second:  # trained: written anew
        assert (clients / f"{c}.npz").stat().st_ino != round1.get(f"{c}.npz")
    # only the current checkpoint folder is left
    assert len(list(tmp_path.glob("checkpoint.r*"))) == 1


def test_a_resumed_partial_run_evaluates_with_the_uninterrupted_numbers(synthetic_raw, tmp_path):
    # 2 of 6 clients per round, pFedES, deployed evaluation: the uninterrupted run keeps the
    # scores of clients that did not train; the resumed one has none kept and scores everyone
    # once. Every metric must agree anyway (the proxy diagnostics included).
    partial = ["engine.clients_per_round=2"]
    whole = run(synthetic_raw, tmp_path / "whole", 4, overrides=partial)
    run(synthetic_raw, tmp_path / "cut", 2, overrides=partial)
    resumed = run(synthetic_raw, tmp_path / "cut", 4, resume=True, overrides=partial)
    assert comparable(resumed) == comparable(whole)


@pytest.mark.parametrize("crash_at", [1, 8, 9])
def test_a_crash_inside_a_checkpoint_write_keeps_the_previous_one(
    synthetic_raw, tmp_path, monkeypatch, crash_at
):
    full = run(synthetic_raw, tmp_path / "full", 4)
    run(synthetic_raw, tmp_path / "r", 1)
    calls = {"n": 0}
    real = ckpt_mod.write_file

    def crashing(path, data):
        calls["n"] += 1
        if calls["n"] == crash_at:
            real(path, data[: len(data) // 2])  # half a file, then the "power cut"
            raise KeyboardInterrupt
        real(path, data)

    monkeypatch.setattr(ckpt_mod, "write_file", crashing)
    with pytest.raises(KeyboardInterrupt):
        run(synthetic_raw, tmp_path / "r", 4, resume=True)
    monkeypatch.setattr(ckpt_mod, "write_file", real)
    current = json.loads((tmp_path / "r" / "checkpoint" / "manifest.json").read_text())
    assert current["round"] == 1  # the torn round-2 folder never became current
    resumed = run(synthetic_raw, tmp_path / "r", 4, resume=True)
    assert comparable(resumed) == comparable(full)


def _folder(path):
    return path / os.readlink(path / "checkpoint")


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        (
            lambda f: (f / "server.npz").write_bytes((f / "server.npz").read_bytes()[:100]),
            "truncated",
        ),
        (lambda f: (f / "clients" / "0.npz").unlink(), r"clients/0\.npz: it is missing"),
        (lambda f: (f / "manifest.json").unlink(), "manifest.json is missing"),
        (
            lambda f: (f / "manifest.json").write_text('{"format": "rayfl-ch'),
            "not written by your rayfl",
        ),
        (lambda f: (f / "history.json").write_text("[]"), "truncated or changed"),
    ],
)
def test_a_damaged_checkpoint_is_refused_in_one_line(synthetic_raw, tmp_path, damage, message):
    run(synthetic_raw, tmp_path, 1)
    damage(_folder(tmp_path))
    with pytest.raises(UserError, match=message) as err:
        run(synthetic_raw, tmp_path, 2, resume=True)
    assert "\n" not in str(err.value)


def test_a_foreign_checkpoint_is_refused(synthetic_raw, tmp_path):
    run(synthetic_raw, tmp_path, 1)
    with pytest.raises(UserError, match="other settings"):
        run(synthetic_raw, tmp_path, 2, resume=True, overrides=["seed=3"])
    link = tmp_path / "checkpoint"
    link.unlink()
    os.symlink("/etc", link)
    with pytest.raises(UserError, match="outside the run directory"):
        run(synthetic_raw, tmp_path, 2, resume=True)


def test_no_checkpoint_is_one_line(synthetic_raw, tmp_path):
    with pytest.raises(UserError, match="no checkpoint in"):
        run(synthetic_raw, tmp_path, 2, resume=True)


def test_resume_may_change_placement_but_not_the_numbers(synthetic_raw, tmp_path):
    raw = dict(synthetic_raw)
    cfg = build_config(raw, ["engine.rounds=1"])
    Simulation(cfg, tmp_path, [Checkpoint(tmp_path, 1)]).run()
    cfg2 = build_config(
        raw, ["engine.rounds=2", "engine.clients_per_call=2", "engine.max_retries=5"]
    )
    restored = Checkpoint(tmp_path, 1, resume=True).verify(cfg2)
    assert restored.round == 1 and [r["round"] for r in restored.history] == [1.0]
    assert restored.client_ids() == list(range(6))
