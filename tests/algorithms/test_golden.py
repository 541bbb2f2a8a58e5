"""Golden numbers: every registered algorithm's exact metrics after a short deterministic run.

Each algorithm runs the contract's configuration (`test_contract.contract_raw`: 2 rounds,
3 clients, serial executor, two tiny heterogeneous models) on 300 synthetic 8x8 images, and every final
metric except timings must equal the pinned value in `golden.json` to 1e-6. A change that moves
an algorithm's numbers fails here; if the change is meant to, regenerate the table deliberately
and say why in the commit:

    RAYFL_REGEN_GOLDEN=1 PYTHONPATH=$PWD python3 -m pytest -q tests/algorithms/test_golden.py

(the regenerating tests are skipped, so that a regeneration is never mistaken for a pass). The
numbers are this machine's float32 CPU arithmetic; another CPU or torch version may differ in
the last digits of a loss and flip a close prediction, which is a reason to regenerate, not to
widen the tolerance.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping
from pathlib import Path

import pytest

from tests.algorithms.test_contract import NAMES, run_contract

GOLDEN = Path(__file__).with_name("golden.json")
REGEN = os.environ.get("RAYFL_REGEN_GOLDEN") == "1"
TOLERANCE = 1e-6
SIZES = {"num_samples": 300, "num_test": 100}  # half the contract's data: the file stays fast


def pinned(final: Mapping[str, float]) -> dict[str, float]:
    """The metrics a golden test pins: every finite number but wall-clock timings."""
    return {
        k: float(v)
        for k, v in sorted(final.items())
        if not k.startswith("time/") and isinstance(v, int | float) and math.isfinite(v)
    }


def golden_table() -> dict[str, dict[str, float]]:
    return json.loads(GOLDEN.read_text()) if GOLDEN.exists() else {}


@pytest.mark.parametrize("name", NAMES)
def test_golden_numbers(name: str, tmp_path: Path) -> None:
    _, _, result = run_contract(name, tmp_path, **SIZES)
    got = pinned(result.final)
    if REGEN:
        table = golden_table()
        table[name] = got
        GOLDEN.write_text(json.dumps(table, indent=1, sort_keys=True) + "\n")
        pytest.skip(f"regenerated the golden numbers of {name}")
    want = golden_table().get(name)
    assert want is not None, f"no golden numbers for {name}: regenerate (see module docstring)"
    assert sorted(got) == sorted(want), f"{name}: the pinned metrics changed"
    off = {k: (got[k], want[k]) for k in want if abs(got[k] - want[k]) > TOLERANCE}
    assert not off, f"{name}: metrics moved from their golden values (got, pinned): {off}"


def test_every_pinned_algorithm_is_registered() -> None:
    # A renamed or removed algorithm must drop its row deliberately too.
    assert set(golden_table()) == set(NAMES)
