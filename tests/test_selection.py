"""Choices are made on validation data: test labels cannot change which trial or round wins.

Two trials (two learning rates) of a tiny serial run are scored twice: once as they are, once
with every test label a client or the server scores against replaced by another class. The
validation metrics, the trial chosen on them (`rayfl.tune`'s ranking) and the round chosen on
them (`at_best_val`) must be the same; the test accuracies differ, so the test labels were read.
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any

import numpy as np
import pytest

import rayfl.engine.loop as loop
from rayfl.config import build_config
from rayfl.engine.loop import Simulation
from rayfl.engine.metrics import AT_BEST_VAL
from rayfl.errors import ConfigError
from rayfl.tune.report import best_row
from rayfl.tune.sweep import TEST_METRIC, VAL_METRIC, ranking_metric


def _wrong_test_labels(prepare: Any) -> Any:
    def prepare_federation(cfg: Any) -> Any:
        fed = prepare(cfg)
        ds = fed.dataset
        y_train = ds.y_train.copy()
        test = np.concatenate([c.test for c in fed.clients])
        y_train[test] = (y_train[test] + 1) % ds.num_classes
        y_test = (ds.y_test + 1) % ds.num_classes
        data = dataclasses.replace(ds, y_train=y_train, y_test=y_test)
        return dataclasses.replace(fed, dataset=data)

    return prepare_federation


def _trials(raw: dict[str, Any], tmp_path: Any) -> list[dict[str, Any]]:
    rows = []
    for lr in (0.005, 0.2):
        cfg = build_config(copy.deepcopy(raw), [f"train.lr={lr}"])
        result = Simulation(cfg, tmp_path / f"lr{lr}").run()
        final = result.final
        row = {"trial": f"lr={lr}", "status": "done", "history": result.history}
        row.update({k: final[k] for k in (VAL_METRIC, TEST_METRIC, AT_BEST_VAL + "round")})
        rows.append(row)
    return rows


def test_test_labels_cannot_change_the_chosen_trial_or_round(
    tmp_path, synthetic_raw, monkeypatch
) -> None:
    raw = copy.deepcopy(synthetic_raw)
    raw["data"]["val_fraction"] = 0.25
    raw["algorithm"] = {"name": "fedavg"}
    raw["model"] = {"architectures": ["tiny_a"]}
    raw["engine"]["rounds"] = 3
    honest = _trials(raw, tmp_path / "honest")
    monkeypatch.setattr(loop, "prepare_federation", _wrong_test_labels(loop.prepare_federation))
    tampered = _trials(raw, tmp_path / "tampered")

    for a, b in zip(honest, tampered):
        val = [(r["round"], r[VAL_METRIC], r["personal/val_loss"]) for r in a["history"]]
        assert val == [(r["round"], r[VAL_METRIC], r["personal/val_loss"]) for r in b["history"]]
        assert a[AT_BEST_VAL + "round"] == b[AT_BEST_VAL + "round"]
        assert a[TEST_METRIC] != b[TEST_METRIC]  # the test labels did change the test scores
    assert (
        best_row(honest, VAL_METRIC, "max")["trial"]
        == best_row(tampered, VAL_METRIC, "max")["trial"]
    )


def test_tune_ranks_on_validation_or_refuses(synthetic_raw, caplog) -> None:
    cfg = build_config(copy.deepcopy(synthetic_raw))
    with pytest.raises(ConfigError, match=r"tune\.metric: .*data\.val_fraction is 0"):
        ranking_metric("", cfg)
    with pytest.raises(ConfigError, match=r"tune\.metric: .*data\.val_fraction is 0"):
        ranking_metric("personal/val_loss", cfg)
    assert ranking_metric("personal/acc", cfg) == "personal/acc"  # explicit: allowed, warned
    assert "ranks trials on test data" in caplog.text
    with_val = build_config(copy.deepcopy(synthetic_raw), ["data.val_fraction=0.1"])
    assert ranking_metric("", with_val) == VAL_METRIC
