"""The proxy's health line: a warning when `proxy/acc` has not left chance after
`eval.proxy_health_rounds` rounds, and `rayfl validate`'s warning for a pFedES config that equals
local training."""

from __future__ import annotations

from rayfl.algorithms.pfedes import PFedESParams
from rayfl.config import build_config
from rayfl.engine.callbacks import proxy_health


def rows(*accs):
    return [{"proxy/acc": a, "proxy/chance": 0.1} for a in accs]


def test_a_proxy_at_chance_warns_after_the_configured_rounds(synthetic_raw):
    cfg = build_config(synthetic_raw, ["eval.proxy_health_rounds=3"])
    assert proxy_health(cfg, rows(0.1, 0.1)) == ""  # too early to tell
    line = proxy_health(cfg, rows(0.1, 0.1, 0.12))
    assert line.startswith("warning: proxy/acc 0.1200 has not risen above chance (0.10)")
    assert "train/pfedes/kd_loss" in line and "EMA" in line and "\n" not in line


def test_a_learning_proxy_or_an_unscored_one_or_the_check_off_is_quiet(synthetic_raw):
    cfg = build_config(synthetic_raw, ["eval.proxy_health_rounds=3"])
    assert proxy_health(cfg, rows(0.1, 0.2, 0.1)) == ""  # rose above chance once
    assert proxy_health(cfg, [{"personal/acc": 0.5}] * 4) == ""
    off = build_config(synthetic_raw, ["eval.proxy_health_rounds=0"])
    assert proxy_health(off, rows(0.1, 0.1, 0.1)) == ""


def test_kd_without_return_path_is_flagged_as_local_training():
    (note,) = PFedESParams(variant="kd", beta=0.0).notes()
    assert "equals algorithm.name=local" in note
    assert PFedESParams(variant="kd", beta=0.5).notes() == []
    assert PFedESParams(variant="input").notes() == []


def test_validate_prints_the_note(capsys):
    from rayfl.cli import main

    argv = [
        "validate",
        "experiments/pfedes_fmnist.yaml",
        "algorithm.variant=kd",
        "algorithm.beta=0",
    ]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "warning: algorithm.beta=0 with variant kd" in out
