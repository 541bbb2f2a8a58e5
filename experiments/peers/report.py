"""The "Peer checks" sections of docs/results.md, from the rows that
`experiments/peers/htfllib.py compare --out docs/results/peers/htfllib.jsonl` and
`experiments/peers/pfllib.py compare --out docs/results/peers/pfllib.jsonl` append.

No torch here: `experiments/make_results.py` imports this module to build the page.
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

TOLERANCE = 1.5  # points: the agreement asked of a peer check at the same round

COMMAND = (
    "PYTHONPATH=$PWD python3 experiments/peers/htfllib.py install "
    "<fetched TsingZ0/HtFLlib git dir> /tmp/peers/htfl (FD: a second copy at --commit 17f851e "
    "in /tmp/peers/htfl-17f851e); python3 -m venv --system-site-packages /tmp/peers/venv; "
    "/tmp/peers/venv/bin/pip install h5py higher; then each row's command with PYTHONPATH=$PWD "
    "OMP_NUM_THREADS=1, appending its row to docs/results/peers/htfllib.jsonl (the rows' "
    "/tmp/i43 paths are an earlier copy of the same installs)"
)


PFLLIB_COMMAND = (
    "PYTHONPATH=$PWD python3 experiments/peers/pfllib.py install <fetched TsingZ0/PFLlib git "
    "dir> /tmp/peers/pfl; python3 -m venv --system-site-packages /tmp/peers/venv; "
    "/tmp/peers/venv/bin/pip install h5py; then each row's command with PYTHONPATH=$PWD "
    "OMP_NUM_THREADS=1, appending its row to docs/results/peers/pfllib.jsonl"
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
        "`personal/acc`). Model initialisations and batch order differ between the "
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
    out += seeds_summary(rows, "htfllib", "HtFLlib")
    for row in rows:
        out += row_table(row, "htfllib", "HtFLlib")
    return out


def peer_of(row: Mapping[str, Any]) -> tuple[str, str]:
    return ("pfllib", "PFLlib") if "pfllib" in row else ("htfllib", "HtFLlib")


def delta(a: Any, b: Any) -> float | None:
    ok = a is not None and b is not None and a == a and b == b
    return 100 * (a - b) if ok else None


def row_table(row: Mapping[str, Any], key: str, peer: str) -> list[str]:
    """One row's table: rayfl against the peer per round."""
    cfg = row["config"]
    params = {k: v for k, v in cfg["algorithm"].items() if k != "name"}
    out = [
        f"### {row['algo']}: {setting(row)}",
        "",
        f"- rayfl options: {json.dumps(params) if params else 'defaults'}; {peer} "
        f"flags: `{' '.join(row[key + '_flags'])}`; {peer} commit "
        f"`{row[key + '_commit'][:7]}`; seed {row['seed']}.",
    ]
    if row.get("command"):
        out.append(f"- Command: `{row['command']}`.")
    if row.get("note"):
        out.append(f"- {row['note']}")
    if row.get("rayfl_failed"):
        out.append(f"- rayfl stopped: {row['rayfl_failed']}")
    if row.get("superseded"):
        out.append(f"- Superseded (left out of the summaries over seeds): {row['superseded']}")
    out.append("")
    ours, theirs = row["rayfl"], row[key]
    body = []
    for r in range(max(len(ours), len(theirs))):
        a = ours[r] if r < len(ours) else None
        b = theirs[r] if r < len(theirs) else None
        cells = [f"{100 * v:.1f}" if v is not None and v == v else "-" for v in (a, b)]
        d = delta(a, b)
        cells.append("-" if d is None else f"{d:+.1f}" + ("" if abs(d) <= TOLERANCE else " (over)"))
        body.append([str(r + 1), *cells])
    out += [f"| round | rayfl (%) | {peer} (%) | Δ (points) |", "|---|---|---|---|"]
    out += ["| " + " | ".join(cells) + " |" for cells in body]
    out.append("")
    return out


def group_key(row: Mapping[str, Any], key: str) -> str:
    """Rows that differ only in their seed."""
    cfg = {k: v for k, v in row["config"].items() if k not in ("seed", "name")}
    init = row.get(key + "_rayfl_init")  # the peer started from rayfl's draw: a diagnosis
    return json.dumps(
        [row["algo"], cfg, row[key + "_flags"], row[key + "_commit"], init is not None],
        sort_keys=True,
    )


def seeds_summary(rows: Sequence[Mapping[str, Any]], key: str, peer: str) -> list[str]:
    """Per (algorithm, setting) run over several seeds: the rayfl - peer difference per round,
    mean ± sample std over the seeds, and each seed's."""
    groups: dict[str, list[Mapping[str, Any]]] = {}
    for row in rows:
        if row.get("superseded"):  # an earlier rayfl code's run, kept for the record
            continue
        groups.setdefault(group_key(row, key), []).append(row)
    lines = []
    for members in groups.values():
        seeds = sorted({m["seed"] for m in members})
        if len(seeds) < 2:
            continue
        members = sorted(members, key=lambda m: m["seed"])
        first = members[0]
        rounds = min(min(len(m["rayfl"]), len(m[key])) for m in members)
        cells = []
        for r in range(rounds):
            ds = [delta(m["rayfl"][r], m[key][r]) for m in members]
            ok = [d for d in ds if d is not None]
            if not ok:  # a round only one side scores (FedBABU's before PFLlib's fine-tuning)
                cells.append("-")
                continue
            mean = statistics.mean(ok)
            std = statistics.stdev(ok) if len(ok) > 1 else float("nan")
            flag = "" if abs(mean) <= TOLERANCE else " (over)"
            cells.append(f"{mean:+.1f} ± {std:.1f}{flag} ({', '.join(f'{d:+.1f}' for d in ok)})")
        drawn = "" if first.get(key + "_rayfl_init") is None else f"; {peer} from rayfl's draw"
        lines.append(
            f"| {first['algo']} | {setting(first)}; {peer} `{first[key + '_commit'][:7]}`{drawn} | "
            f"{', '.join(map(str, seeds))} | " + " | ".join(cells) + " |"
        )
    if not lines:
        return []
    width = max(line.count("|") - 4 for line in lines)
    head = "| algorithm | setting | seeds | " + " | ".join(f"Δ round {r + 1}" for r in range(width))
    return [
        f"### Over seeds: rayfl - {peer} per round (points, mean ± std, then each seed's)",
        "",
        "The same comparison on the partitions of several seeds (rayfl's seed draws the "
        f"partition and rayfl's initial models; {peer} seeds torch with 0 before building "
        "every client, so its initial models are the same draw in every row). `local` (every "
        "client trains alone, no algorithm) measures what the two libraries' shared protocol "
        "alone leaves between them.",
        "",
        head + " |",
        "|---|---|---|" + "---|" * width,
        *lines,
        "",
    ]


def pfllib_section(rows: Sequence[Mapping[str, Any]]) -> list[str]:
    """Markdown lines: the PFLlib peer checks, as `section` renders HtFLlib's."""
    if not rows:
        return []
    out = [
        "## Peer checks against PFLlib",
        "",
        "rayfl and PFLlib's unmodified code (TsingZ0/PFLlib, commit below) on the same "
        "partition (rayfl's, converted to PFLlib's dataset folder with the same normalised "
        "tensors), one architecture for every client (rayfl's `cnn5`, CNN-5 of the pFedES "
        "code; for FedPer, FedRep, FedROD PFLlib's main.py splits it into base and head), "
        "plain SGD lr 0.01, batch 10, one local epoch, every client every round; accuracy = "
        "correct / samples over every client's local test split of the personalized models "
        "after each round (PFLlib's `evaluate` at the start of the next round, after the "
        "server's models are sent; Ditto's `evaluate_personalized`; rayfl's deployed protocol "
        "`personal/acc`). Model initialisations differ (PFLlib seeds torch with 0) and PFLlib "
        "drops each epoch's last incomplete batch, so runs agree in distribution only; "
        f"the target is {TOLERANCE} points at the same round.",
        "",
        f"- Setup: `{PFLLIB_COMMAND}`.",
        "",
    ]
    out += seeds_summary(rows, "pfllib", "PFLlib")
    for row in rows:
        out += row_table(row, "pfllib", "PFLlib")
    return out


def sections(folder: Path) -> list[str]:
    """Both peers' sections from `folder` (docs/results/peers), those whose rows exist."""
    out: list[str] = []
    if (folder / "htfllib.jsonl").is_file():
        out += section(read_rows(folder / "htfllib.jsonl"))
    if (folder / "htfllib_inits.jsonl").is_file():
        out += inits_section(read_rows(folder / "htfllib_inits.jsonl"))
    if (folder / "rayfl_inits.jsonl").is_file():
        out += rayfl_inits_section(read_rows(folder / "rayfl_inits.jsonl"))
    if (folder / "pfllib.jsonl").is_file():
        out += pfllib_section(read_rows(folder / "pfllib.jsonl"))
    return out


def inits_section(rows: Sequence[Mapping[str, Any]]) -> list[str]:
    """HtFLlib's accuracy on one partition with other initial draws (a diagnosis)."""
    if not rows:
        return []
    out = [
        "### HtFLlib's initial draw (diagnosis)",
        "",
        "HtFLlib seeds torch with 0 before building every client (`clientbase.py:20`), so all "
        "its rows above start from one draw of initial models. Here a copy of HtFLlib with that "
        "seed set to S (the one-line change in `patch`; not a peer check) runs on the partition "
        "of the rows above with the given seed (the rows' settings: Local and FedL2G 3,000 "
        "training images, FML 1,500; FML's rows also seed main.py's `torch.manual_seed(0)`, "
        "which draws the shared model, with S). Patches: "
        + "; ".join(f"`{p}`" for p in dict.fromkeys(row["patch"] for row in rows))
        + ".",
        "",
        "| algorithm | partition seed | HtFLlib init seed | accuracy (%) after rounds 1.. of "
        "training | command |",
        "|---|---|---|---|---|",
    ]
    for row in rows:
        accs = ", ".join(f"{100 * v:.1f}" for v in row["after_training_rounds"])
        out.append(
            f"| {row['algo']} | {row['partition_seed']} | {row['htfllib_init_seed']} | {accs} | "
            f"`{row['command']}` |"
        )
    out.append("")
    return out


def rayfl_inits_section(rows: Sequence[Mapping[str, Any]]) -> list[str]:
    """rayfl's accuracy on one partition with other initial draws (a diagnosis)."""
    if not rows:
        return []
    out = [
        "### rayfl's initial draw (diagnosis)",
        "",
        "rayfl's seed draws both the partition and the initial models. Here the streams of the "
        "initial models (`Purpose.INIT`, `Purpose.SERVER`) take seed + 1000 x offset while the "
        "partition, the splits and the batch order keep the row's seed "
        "(`experiments/peers/diagnose.py init`; offset 0 is the compare row itself). "
        "`torch seed K`: the server's initial models are drawn right after "
        "`torch.manual_seed(K)` instead (`--torch-seed K`; K 0 is PFLlib's draw).",
        "",
        "| algorithm | partition seed | initial models | accuracy (%) after rounds 1.. | command |",
        "|---|---|---|---|---|",
    ]
    for row in rows:
        accs = ", ".join(f"{100 * v:.1f}" for v in row["rayfl"])
        torch_seed = row.get("rayfl_init_torch_seed")
        init = (
            f"offset {row['rayfl_init_offset']}"
            if torch_seed is None
            else f"torch seed {torch_seed}"
        )
        out.append(
            f"| {row['algo']} | {row['partition_seed']} | {init} | {accs} | `{row['command']}` |"
        )
    out.append("")
    return out
