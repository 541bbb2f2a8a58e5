"""Peer checks against PFLlib (TsingZ0/PFLlib): rayfl and PFLlib's unmodified code on the same
partition, one architecture and the same hyperparameters, compared round by round.

Subcommands (`python experiments/peers/pfllib.py SUBCOMMAND -h` for their options):

    install GIT_DIR DEST [--commit C]
        unpack `system/` of a fetched PFLlib snapshot (a bare git directory) into DEST, a
        throwaway folder outside rayfl (e.g. /tmp/peers/pfl). Nothing of PFLlib enters rayfl.
    pfllib --dest DEST --dataset NAME --algo A --arch ARCH [--rayfl-init S] -- [main.py flags]
        (run with a Python that has PFLlib's requirements: `h5py`, `scikit-learn`) run one
        PFLlib algorithm (its server class, unmodified, as `system/main.py` would) on
        `DEST/dataset/NAME` with one rayfl architecture; prints the per-round accuracy as JSON.
        `--rayfl-init S` (a diagnosis) starts PFLlib from the initial model rayfl's server
        draws with seed S (its `Purpose.SERVER` stream) instead of main.py's torch seed 0;
        `diagnose.py init --torch-seed 0` is the converse.
    compare --algo fedper --dest DEST --python VENV_PYTHON ...
        one rayfl run (serial, deployed protocol) on a fresh partition, its conversion to
        PFLlib's dataset folder (the format HtFLlib reads too: `htfllib.py convert`) and the
        PFLlib run on it; writes `{"rayfl": [...], "pfllib": [...]}` per round.

How PFLlib runs here: its arguments are the ones `system/main.py`'s own parser gives (the parser
block of main.py is executed as written, then the flags given are applied); `args.model` is a
rayfl architecture wrapped as `RayflNet` (encoder + `fc` head), and for the algorithms whose
main.py branch splits the model (FedPer, FedRep, FedBABU, FedROD) the split is main.py's:
`fc` copied out as the head, replaced by `nn.Identity`, both wrapped in `BaseHeadSplit`.
PFLlib seeds torch with 0 at import (main.py) and before building every client
(`clientbase.py:18`) and deep-copies one global model into every client, so all clients start
alike, as rayfl's clients start from their server's model.

Protocol differences that stay (both libraries' own choices): PFLlib drops the last incomplete
batch (`clientbase.py:59`, `drop_last=True`), rayfl keeps it; model initialisations are
different draws. PFLlib evaluates at the start of each round, after the server's models are
sent (`serverper.py:27-33`), so its entry r is after r rounds of training; rayfl's deployed
protocol scores after each round with the new server state, the same point.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
import htfllib  # noqa: E402  (the shared converter and installer)

ROOT = Path(__file__).resolve().parents[2]

# PFLlib's name, server module and class, flags; rayfl options that match them
ALGOS: dict[str, tuple[str, str, str, list[str], dict[str, Any]]] = {
    "local": ("Local", "serverlocal", "Local", [], {}),
    "fedavg": ("FedAvg", "serveravg", "FedAvg", [], {}),
    "fedper": ("FedPer", "serverper", "FedPer", [], {}),
    "fedrep": ("FedRep", "serverrep", "FedRep", ["--plocal_epochs", "1"], {"head_epochs": 1}),
    "fedrod": ("FedROD", "serverrod", "FedROD", [], {}),
    # PFLlib's Ditto pull is its generic -mu (default 0: no pull); rayfl's lam 1.0 = -mu 1
    "ditto": ("Ditto", "serverditto", "Ditto", ["--mu", "1", "--plocal_epochs", "1"], {}),
    # PFLlib's alpha default is 1.0; rayfl's (FL-bench's) 0.5
    "apfl": ("APFL", "serverapfl", "APFL", ["--alpha", "0.5"], {}),
    "fedala": ("FedALA", "serverala", "FedALA", [], {}),
    # PFLlib fine-tunes the whole model once, after the last round (serverbabu.py:60-63); rayfl
    # every round: only the last round is compared, at PFLlib's 10 epochs on both sides
    "fedbabu": (
        "FedBABU",
        "serverbabu",
        "FedBABU",
        ["--fine_tuning_epochs", "10"],
        {"finetune_epochs": 10},
    ),
}
SPLIT = {"FedPer", "FedRep", "FedBABU", "FedROD", "FedAvg"}  # main.py's head-splitting branches


def install(git_dir: Path, dest: Path, commit: str = "HEAD") -> Path:
    return htfllib.install(git_dir, dest, commit)


# -- the PFLlib side (runs in PFLlib's environment) -----------------------------------------


class RayflNet(nn.Module):
    """A rayfl architecture with its head as `fc`, where PFLlib's main.py looks for it."""

    def __init__(self, arch: str, in_shape: tuple[int, ...], num_classes: int) -> None:
        super().__init__()
        from rayfl.models import build_model

        model = build_model(arch, in_shape, num_classes)
        self.encoder, self.fc = model.encoder, model.head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.encoder(x))


def main_py_args(system: Path, flags: list[str]) -> argparse.Namespace:
    """The namespace `system/main.py`'s parser gives for `flags` (its parser block, run as is)."""
    src = (system / "main.py").read_text()
    start = src.index("    parser = argparse.ArgumentParser()")
    stop = src.index("    args = parser.parse_args()")
    block = "\n".join(line[4:] for line in src[start:stop].splitlines())
    scope: dict[str, Any] = {"argparse": argparse}
    exec(block, scope)  # noqa: S102  (PFLlib's own parser definition)
    return scope["parser"].parse_args(flags)


def run_pfllib(
    dest: Path, dataset: str, algo: str, arch: str, flags: list[str], rayfl_init: int | None = None
) -> list[float]:
    """Run PFLlib's server of `algo` on `dest/dataset/<dataset>`; per-round test accuracy of
    the personalized models (entry r: after r rounds). `rayfl_init`: start from the model
    rayfl's server draws with that seed instead of main.py's."""
    info = json.loads((dest / "dataset" / dataset / "config.json").read_text())
    in_shape, num_classes = tuple(info["in_shape"]), int(info["num_classes"])
    system = dest / "system"
    os.chdir(system)  # PFLlib reads ../dataset/<name> and writes ../results
    sys.path.insert(0, str(system))
    name, module, cls, _, _ = ALGOS[algo]
    args = main_py_args(system, flags)
    args.algorithm, args.dataset, args.num_classes = name, dataset, num_classes
    args.num_clients, args.device = info["num_clients"], "cpu"
    if rayfl_init is None:
        torch.manual_seed(0)  # as main.py at import
    else:  # as rayfl's ServerRunner before its server builds the model
        from rayfl.seeding import Purpose, seed_of, words

        torch.manual_seed(seed_of(words(Purpose.SERVER, rayfl_init)))
    args.model = RayflNet(arch, in_shape, num_classes)
    if name in SPLIT:  # main.py's branch for these algorithms
        import copy

        from flcore.trainmodel.models import BaseHeadSplit

        args.head = copy.deepcopy(args.model.fc)
        args.model.fc = nn.Identity()
        args.model = BaseHeadSplit(args.model, args.head)
    server_cls = getattr(__import__(f"flcore.servers.{module}", fromlist=[cls]), cls)
    server = server_cls(args, 0)
    server.train()
    accs = [float(a) for a in server.rs_test_acc]
    if name == "Ditto":  # evaluate() (global) then evaluate_personalized() each round
        accs = accs[1::2]
    return accs


# -- compare ------------------------------------------------------------------------------------


def rayfl_config(a: argparse.Namespace) -> dict[str, Any]:
    """The rayfl run of the comparison (PFLlib's optimizer: plain SGD, no clipping)."""
    data: dict[str, Any] = {
        "dataset": a.dataset,
        "num_clients": a.clients,
        "partition": {"name": "dirichlet", "alpha": a.alpha, "min_samples": 10},
        "test_fraction": 0.2,
        "train_samples": a.train_samples,
    }
    matched = ALGOS[a.algo][4]
    return {
        "name": f"peer_pfl_{a.algo}",
        "seed": a.seed,
        "data": data,
        "model": {"architectures": [a.arch]},
        "algorithm": {"name": a.algo, **matched, **json.loads(a.params)},
        "train": {"local_epochs": 1, "batch_size": 10, "lr": a.lr, "momentum": 0.0},
        "engine": {"rounds": a.rounds, "executor": "serial", "checkpoint_every": 0},
        "eval": {"protocol": "deployed"},
        "tracking": {"backend": "none"},
    }


def compare(a: argparse.Namespace) -> dict[str, Any]:
    raw = rayfl_config(a)
    work, ours, failed = htfllib.run_rayfl(raw, a.dest, a.algo)
    dataset = f"rayfl_{a.algo}_{a.dataset}_s{a.seed}"
    htfllib.convert(work / "rayfl", a.dest / "dataset" / dataset)  # overwrites an earlier one
    # PFLlib's loop trains global_rounds + 1 times and evaluates before each training; FedBABU's
    # last entry follows all of them (serverbabu.py:24, 60-63), so it runs one round fewer
    rounds = a.rounds - 1 if a.algo == "fedbabu" else a.rounds
    flags = ALGOS[a.algo][3] + ["--global_rounds", str(rounds)]
    flags += ["--local_learning_rate", str(a.lr), "--batch_size", "10", "--local_epochs", "1"]
    flags += a.pfllib_flags
    cmd = [a.python, __file__, "pfllib", "--dest", str(a.dest), "--dataset", dataset]
    cmd += ["--algo", a.algo, "--arch", a.arch, "--", *flags]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if done.returncode:
        sys.stderr.write(done.stdout[-4000:] + done.stderr[-4000:])
        raise SystemExit(f"PFLlib's run failed ({done.returncode})")
    theirs = json.loads(done.stdout.strip().splitlines()[-1])
    # entry 0: the untrained models; FedBABU's last: the fine-tuned ones after the last round
    babu = [None] * (a.rounds - 1) + theirs[-1:]
    return {
        "algo": a.algo,
        "dataset": a.dataset,
        "seed": a.seed,
        "command": "python3 experiments/peers/pfllib.py " + " ".join(sys.argv[1:]),
        "config": raw,
        "pfllib_flags": flags,
        "pfllib_commit": (a.dest / "COMMIT").read_text().strip(),
        "rayfl": ours,
        "pfllib": theirs[1 : a.rounds + 1] if a.algo != "fedbabu" else babu,
        "rayfl_failed": failed,
        "pfllib_all": theirs,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    i = sub.add_parser("install", help="unpack PFLlib's system/ from a snapshot")
    i.add_argument("git_dir", type=Path)
    i.add_argument("dest", type=Path)
    i.add_argument("--commit", default="HEAD")
    h = sub.add_parser("pfllib", help="run PFLlib on a converted folder")
    h.add_argument("--dest", type=Path, required=True)
    h.add_argument("--dataset", required=True)
    h.add_argument("--algo", choices=sorted(ALGOS), required=True)
    h.add_argument("--arch", required=True)
    h.add_argument("--rayfl-init", type=int, help="start from rayfl's server draw of this seed")
    h.add_argument("flags", nargs="*", help="after --: main.py flags")
    p = sub.add_parser("compare", help="rayfl and PFLlib on the same partition")
    p.add_argument("--algo", choices=sorted(ALGOS), required=True)
    p.add_argument("--dest", type=Path, required=True, help="PFLlib install (see install)")
    p.add_argument("--python", default=sys.executable, help="Python of PFLlib's environment")
    p.add_argument("--dataset", default="fmnist")
    p.add_argument("--arch", default="cnn5", help="every client's architecture")
    p.add_argument("--clients", type=int, default=10)
    p.add_argument("--alpha", type=float, default=0.1, help="Dirichlet concentration")
    p.add_argument("--train-samples", type=int, default=3000)
    p.add_argument("--lr", type=float, default=0.01)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--params", default="{}", help="JSON of rayfl algorithm options")
    p.add_argument("--out", type=Path, help="append the JSON row to this file")
    a, unknown = ap.parse_known_args()
    if a.cmd == "compare":
        a.pfllib_flags = unknown  # main.py flags, e.g. --mu 1 (they look like options)
    elif unknown and a.cmd != "pfllib":
        ap.error(f"unrecognized arguments: {' '.join(unknown)}")
    if a.cmd == "install":
        print(install(a.git_dir, a.dest, a.commit))
    elif a.cmd == "pfllib":
        accs = run_pfllib(a.dest, a.dataset, a.algo, a.arch, a.flags + unknown, a.rayfl_init)
        print(json.dumps(accs))
    else:
        row = compare(a)
        if a.out:
            with open(a.out, "a") as f:
                f.write(json.dumps(row) + "\n")
        print(json.dumps({k: row[k] for k in ("algo", "dataset", "rayfl", "pfllib")}))


if __name__ == "__main__":
    main()
