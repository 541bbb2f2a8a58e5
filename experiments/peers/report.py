"""The "Peer checks against HtFLlib" section of docs/results.md, from the rows that
`experiments/peers/htfllib.py compare --out docs/results/peers/htfllib.jsonl` appends.

No torch here: `experiments/make_results.py` imports this module to build the page.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

TOLERANCE = 1.5  # points: the agreement asked of a peer check at the same round

COMMAND = (
    "PYTHONPATH=$PWD python3 experiments/peers/htfllib.py install "
    "<fetched TsingZ0/HtFLlib git dir> /tmp/i43/htfl (FD: a second copy at --commit 17f851e in "
    "/tmp/i43/htfl-17f851e); python3 -m venv --system-site-packages /tmp/i43/venv; "
    "/tmp/i43/venv/bin/pip install h5py; then each row's command with PYTHONPATH=$PWD "
    "OMP_NUM_THREADS=1, appending its row to docs/results/peers/htfllib.jsonl"
)


def read_rows(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def setting(row: Mapping[str, Any]) -> str:
    data = row["config"]["data"]
    if data["dataset"] == "synthetic":
        o = data["options"]
        shape = "x".join(str(d) for d in o["shape"])
        what = f"synthetic {o['num_classes']}-class Gaussian blobs ({o['num_samples']:,} x {shape})"
    else:
        what = f"{data['dataset']} ({data['train_samples']:,} training images)"
    return (
        f"{what}, {data['num_clients']} clients, Dirichlet({data['partition']['alpha']}), "
        f"test fraction {data['test_fraction']}"
    )


def section(rows: Sequence[Mapping[str, Any]]) -> list[str]:
    """Markdown lines: one table per (algorithm, setting), rayfl against HtFLlib per round."""
    out = [
        "## Peer checks against HtFLlib",
        "",
        "rayfl and HtFLlib's unmodified code (TsingZ0/HtFLlib, commit below) on the same "
        "partition (rayfl's, converted to HtFLlib's dataset folder with the same normalised "
        "tensors), the same architectures (family `cnn5`: client k gets CNN-(k mod 5 + 1) in "
        "both; the shared model of FML/FedKD is CNN-5), plain SGD lr 0.01, batch 10, one local "
        "epoch, every client every round, gradient clipping at 10 for FML and FedKD as "
        "HtFLlib's clients do; accuracy = correct / samples over every client's local test "
        "split after each round (HtFLlib's `evaluate`, rayfl's deployed protocol "
        "`personal/acc`). One seed: model initialisations and batch order differ between the "
        "libraries (HtFLlib iterates in a fixed order and drops the last incomplete batch), so "
        f"the runs agree in distribution only; the target is {TOLERANCE} points at the same "
        "round. One run's accuracy over N test images has a binomial standard error of "
        "sqrt(p(1 - p) / N): about 2.8 points with the 1,500-image rows' 300 test images, 1.4 "
        "with the 6,000-image rows' 1,200, so single-run differences below about twice that "
        "are within one run's noise. Where a round-1 accuracy is the same in both, both models "
        "still predict each client's majority class (Dirichlet 0.1 leaves most clients one or "
        "two classes).",
        "",
        f"- Setup: `{COMMAND}`.",
        "",
    ]
    for row in rows:
        cfg = row["config"]
        params = {k: v for k, v in cfg["algorithm"].items() if k != "name"}
        title = f"### {row['algo']}: {setting(row)}"
        out += [
            title,
            "",
            f"- rayfl options: {json.dumps(params) if params else 'defaults'}; HtFLlib "
            f"flags: `{' '.join(row['htfllib_flags'])}`; HtFLlib commit "
            f"`{row['htfllib_commit'][:7]}`; seed {row['seed']}.",
        ]
        if row.get("command"):
            out.append(f"- Command: `{row['command']}`.")
        if row.get("note"):
            out.append(f"- {row['note']}")
        if row.get("rayfl_failed"):
            out.append(f"- rayfl stopped: {row['rayfl_failed']}")
        out.append("")
        ours, theirs = row["rayfl"], row["htfllib"]
        body = []
        for r in range(max(len(ours), len(theirs))):
            a = ours[r] if r < len(ours) else None
            b = theirs[r] if r < len(theirs) else None
            cells = [f"{100 * v:.1f}" if v is not None and v == v else "-" for v in (a, b)]
            if a is not None and b is not None and a == a and b == b:
                d = 100 * (a - b)
                cells.append(f"{d:+.1f}" + ("" if abs(d) <= TOLERANCE else " (over)"))
            else:
                cells.append("-")
            body.append([str(r + 1), *cells])
        out += ["| round | rayfl (%) | HtFLlib (%) | Δ (points) |", "|---|---|---|---|"]
        out += ["| " + " | ".join(cells) + " |" for cells in body]
        out.append("")
    return out
