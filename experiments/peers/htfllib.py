"""Peer checks against HtFLlib (TsingZ0/HtFLlib): rayfl and HtFLlib's unmodified code on the same
partition, the same architectures and the same hyperparameters, compared round by round.

Subcommands (run `python experiments/peers/htfllib.py SUBCOMMAND -h` for their options):

    convert RUN_DIR OUT
        rayfl's `partition.parquet` of a run directory (and the dataset its `config.yaml` names)
        -> HtFLlib's dataset folder: `OUT/train/<client>.npz` and `OUT/test/<client>.npz`, each
        `{"data": {"x": float32 (N, C, H, W), "y": int64 (N,)}}` (what HtFLlib's
        `utils/data_utils.py` `read_data` loads). The inputs are normalised as rayfl normalises
        them, so both libraries train on the same tensors.
    install GIT_DIR DEST [--commit C]
        unpack `system/` of a fetched HtFLlib snapshot (a bare git directory; its commit C,
        default HEAD) into DEST, a throwaway folder outside rayfl (e.g. under /tmp). Nothing of
        HtFLlib enters rayfl.
    htfllib --dest DEST --dataset NAME ...
        (run with a Python that has HtFLlib's requirements, e.g. a venv with `h5py`) run one
        HtFLlib algorithm (its server class, unmodified, as `system/main.py` would) on
        `DEST/dataset/NAME` with rayfl's architectures, and print the per-round accuracy as JSON.
    compare --algo fml --dest DEST --python VENV_PYTHON ...
        one rayfl run (serial, deployed protocol) on a fresh partition, its conversion, and the
        HtFLlib run on it; writes `{"rayfl": [...], "htfllib": [...]}` per evaluation round.

How HtFLlib runs here: `system/main.py` picks architectures from a fixed list of families, so the
`htfllib` subcommand builds the args namespace `main.py`'s parser would (its defaults, plus the
flags given) and sets `args.models` to rayfl's family, client k getting architecture k mod m as in
both libraries; the models enter HtFLlib's `flcore.trainmodel.models` namespace as `RayflNet`,
whose encoder and `fc` head are a rayfl model's, so `BaseHeadSplit` splits them where rayfl does.
HtFLlib pickles whole modules with `torch.save`; `TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD=1` lets the
torch versions that default to weights-only loading read them back.

Protocol differences that stay (both libraries' own choices): HtFLlib iterates each client's data
in a fixed order and drops the last incomplete batch (`clientbase.py:56`), rayfl reshuffles every
epoch and keeps it; model initialisations are different draws. So runs agree in distribution, not
number for number.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

ROOT = Path(__file__).resolve().parents[2]

# HtFLlib names and flags of the algorithms checked (system/main.py, system/total.sh)
ALGOS = {
    # local training alone: the two libraries' shared protocol, no algorithm on top
    "local": ("Local", []),
    "fml": ("FML", ["--alpha", "0.5", "--beta", "0.5"]),
    "fedkd": ("FedKD", ["--mentee_learning_rate", "0.01"]),
    "fd": ("FD", ["--lamda", "1"]),
    "fedproto": ("FedProto", ["--lamda", "1"]),
    "fedgen": (
        "FedGen",
        ["--noise_dim", "32", "--generator_learning_rate", "0.1", "--hidden_dim", "512"]
        + ["--server_epochs", "100"],
    ),
    "fedmrl": ("FedMRL", []),
    "fedl2g": (
        "FedL2G-feat",
        ["--server_learning_rate", "0.01", "--meta_study_batches", "1"]
        + ["--meta_quiz_batches", "1"],
    ),
}
# main.py's parser defaults for the fields the servers and clients of ALGOS read
HTFLLIB_DEFAULTS: dict[str, Any] = {
    "goal": "test",
    "device": "cpu",
    "num_classes": 10,
    "batch_size": 10,
    "local_learning_rate": 0.01,
    "learning_rate_decay": False,
    "global_rounds": 2000,
    "top_cnt": 100,
    "local_epochs": 1,
    "join_ratio": 1.0,
    "random_join_ratio": False,
    "num_clients": 2,
    "prev": 0,
    "times": 1,
    "eval_gap": 1,
    "save_folder_name": "temp",
    "auto_break": False,
    "feature_dim": 512,
    "models_folder_name": "",
    "few_shot": 0,
    "client_drop_rate": 0.0,
    "train_slow_rate": 0.0,
    "send_slow_rate": 0.0,
    "time_select": False,
    "time_threthold": 10000,
    "lamda": 1.0,
    "alpha": 1.0,
    "beta": 1.0,
    "mentee_learning_rate": 0.01,
    "T_start": 0.95,
    "T_end": 0.98,
    "noise_dim": 512,
    "generator_learning_rate": 0.005,
    "hidden_dim": 512,
    "server_epochs": 100,
    "sub_feature_dim": 128,
    "server_learning_rate": 0.01,
    "meta_study_batches": 1,
    "meta_quiz_batches": 1,
    "warm_up_rounds": 50,
}


# -- convert ------------------------------------------------------------------------------------


def convert(run_dir: Path, out: Path) -> dict[str, Any]:
    """Write HtFLlib's dataset folder for the partition of `run_dir`; returns its summary."""
    from rayfl.config import read_yaml
    from rayfl.data.datasets import load_dataset
    from rayfl.data.federated import load_partition

    data = read_yaml(run_dir / "config.yaml")["data"]
    ds = load_dataset(data["dataset"], **dict(data.get("options") or {}))
    part = load_partition(run_dir)
    sizes = []
    for cid, split in sorted(part["clients"].items()):
        for name in ("train", "test"):
            idx = getattr(split, name)
            x = ds.as_tensor(ds.x_train[idx]).numpy().astype(np.float32)
            y = ds.y_train[idx].astype(np.int64)
            (out / name).mkdir(parents=True, exist_ok=True)
            with open(out / name / f"{cid}.npz", "wb") as f:
                np.savez_compressed(f, data={"x": x, "y": y})
        sizes.append((len(split.train), len(split.test)))
    summary = {
        "num_clients": len(sizes),
        "num_classes": ds.num_classes,
        "in_shape": list(ds.in_shape),
        "train_test_sizes": sizes,
    }
    (out / "config.json").write_text(json.dumps(summary) + "\n")
    return summary


# what a run needs of HtFLlib (its generative-model folders hold large binaries a snapshot lacks)
PATHS = ("system/main.py", "system/flcore", "system/utils")


def install(git_dir: Path, dest: Path, commit: str = "HEAD") -> Path:
    """Unpack the snapshot's `system/` code (PATHS) into `dest` (refused inside rayfl's tree)."""
    dest = dest.resolve()
    if dest == ROOT or ROOT in dest.parents:
        raise SystemExit(f"{dest} is inside rayfl's tree; install HtFLlib elsewhere (e.g. /tmp)")
    dest.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        archive = Path(tmp) / "system.tar"
        subprocess.run(
            ["git", "--git-dir", str(git_dir), "archive", "-o", str(archive), commit, *PATHS],
            check=True,
        )
        with tarfile.open(archive) as tar:
            tar.extractall(dest, filter="data")
    commit = subprocess.run(
        ["git", "--git-dir", str(git_dir), "rev-parse", commit],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    (dest / "COMMIT").write_text(commit + "\n")
    return dest


# -- the HtFLlib side (runs in HtFLlib's environment) -----------------------------------------


class RayflNet(nn.Module):
    """A rayfl architecture with its head as `fc`, where HtFLlib's BaseHeadSplit looks for it.
    Module-level: HtFLlib pickles whole models."""

    def __init__(self, arch: str, in_shape: tuple[int, ...], num_classes: int) -> None:
        super().__init__()
        from rayfl.models import build_model

        model = build_model(arch, in_shape, num_classes)
        self.encoder, self.fc = model.encoder, model.head
        self.feature_dim = model.feature_dim

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.encoder(x))


def run_htfllib(
    dest: Path, dataset: str, algo: str, family: list[str], flags: dict[str, Any]
) -> list[float]:
    """Run HtFLlib's server of `algo` on `dest/dataset/<dataset>`; per-round test accuracy."""
    info = json.loads((dest / "dataset" / dataset / "config.json").read_text())
    in_shape, num_classes = tuple(info["in_shape"]), int(info["num_classes"])
    os.chdir(dest / "system")  # HtFLlib reads ../dataset/<name> and writes ../results
    sys.path.insert(0, str(dest / "system"))
    import flcore.trainmodel.models as htfl_models

    htfl_models.RayflNet = RayflNet  # type: ignore[attr-defined]
    name, _ = ALGOS[algo]
    module, cls = {
        "Local": ("serverlocal", "Local"),
        "FML": ("serverfml", "FML"),
        "FedKD": ("serverkd", "FedKD"),
        "FD": ("serverfd", "FD"),
        "FedProto": ("serverproto", "FedProto"),
        "FedGen": ("servergen", "FedGen"),
        "FedMRL": ("servermrl", "FedMRL"),
        "FedL2G-feat": ("serverl2g_feat", "FedL2G"),
    }[name]
    server_cls = getattr(__import__(f"flcore.servers.{module}", fromlist=[cls]), cls)
    dims = {RayflNet(a, in_shape, num_classes).feature_dim for a in family}
    if len(dims) != 1:
        raise SystemExit(f"HtFLlib needs one feature size; {family} has {sorted(dims)}")
    args = argparse.Namespace(**{**HTFLLIB_DEFAULTS, **flags})
    args.algorithm, args.dataset, args.num_classes = name, dataset, num_classes
    args.num_clients, args.feature_dim = info["num_clients"], dims.pop()
    shape = f"{in_shape!r}, {num_classes}"
    args.models = [f"RayflNet({a!r}, {shape})" for a in family]
    if algo in (
        "fml",
        "fedkd",
        "fedmrl",
    ):  # the shared model: rayfl's default, the family's smallest
        from rayfl.algorithms.fml import shared_arch

        meme = shared_arch(None, family, in_shape, num_classes)
        args.global_model = f"RayflNet({meme!r}, {shape})"
        if algo == "fedmrl" and "sub_feature_dim" not in flags:  # rayfl's default: its own size
            args.sub_feature_dim = RayflNet(meme, in_shape, num_classes).feature_dim
    args.save_folder_name = "temp"  # main.py's default: system/temp/..., deleted at the end
    # as main.py; HTFL_INIT_SEED (a diagnosis, `diagnose.py`) draws the shared model otherwise
    torch.manual_seed(int(os.environ.get("HTFL_INIT_SEED", "0")))
    server = server_cls(args, 0)
    server.train()
    return [float(a) for a in server.rs_test_acc]


# -- compare ------------------------------------------------------------------------------------


def rayfl_config(a: argparse.Namespace) -> dict[str, Any]:
    """The rayfl run of the comparison (HtFLlib's optimizer: plain SGD, clipping for FML/FedKD)."""
    options: dict[str, Any] = {}
    if a.dataset == "synthetic":
        options = {
            "num_samples": a.train_samples,
            "num_test": 100,
            "num_classes": a.num_classes,
            "shape": [1, a.side, a.side],
        }
    data: dict[str, Any] = {
        "dataset": a.dataset,
        "num_clients": a.clients,
        "partition": {"name": "dirichlet", "alpha": a.alpha, "min_samples": 10},
        "test_fraction": 0.2,
        "options": options,
    }
    if a.dataset != "synthetic":
        data["train_samples"] = a.train_samples
    clip = 10.0 if a.algo in ("fml", "fedkd") else None  # clientfml.py:55, clientkd.py:76
    # FedL2G: one warm-up round on both sides (HtFLlib's 50 would leave a short run untrained)
    defaults = {"warm_up_rounds": 1} if a.algo == "fedl2g" else {}
    return {
        "name": f"peer_{a.algo}",
        "seed": a.seed,
        "data": data,
        "model": {"family": a.family},
        "algorithm": {"name": a.algo, **defaults, **json.loads(a.params)},
        "train": {
            "local_epochs": 1,
            "batch_size": 10,
            "lr": 0.01,
            "momentum": 0.0,
            "grad_clip": clip,
        },
        "engine": {"rounds": a.rounds, "executor": "serial", "checkpoint_every": 0},
        "eval": {"protocol": "deployed"},
        "tracking": {"backend": "none"},
    }


def run_rayfl(raw: dict[str, Any], dest: Path, algo: str) -> tuple[Path, list[float], str | None]:
    """rayfl's side of a peer check: run `raw` in a fresh folder under `dest` and leave there
    what a CLI run's directory holds for `convert` (partition and config). Returns the folder,
    `personal/acc` per evaluated round and the error a run that failed ended with (None)."""
    from rayfl.config import build_config
    from rayfl.data.federated import save_partition
    from rayfl.engine.loop import Simulation

    work = Path(tempfile.mkdtemp(prefix=f"peer-{algo}-", dir=dest))
    sim = Simulation(build_config(raw), work / "rayfl")
    failed = None
    try:
        sim.run()
    except Exception as exc:  # e.g. a diverging loss: every reply non-finite
        failed = f"{type(exc).__name__}: {exc}"
    save_partition(sim.federation, work / "rayfl")
    (work / "rayfl" / "config.yaml").write_text(json.dumps(raw))  # JSON is YAML
    return work, [h["personal/acc"] for h in sim.result.history if "personal/acc" in h], failed


def compare(a: argparse.Namespace) -> dict[str, Any]:
    from rayfl.models.families import get_family

    raw = rayfl_config(a)
    work, ours, failed = run_rayfl(raw, a.dest, a.algo)
    dataset = f"rayfl_{a.algo}_{a.dataset}_s{a.seed}"
    convert(work / "rayfl", a.dest / "dataset" / dataset)
    family = list(get_family(a.family).architectures)
    name, flags = ALGOS[a.algo]
    if a.algo == "fedl2g":  # both sides warm up for the same number of rounds
        flags = flags + ["--warm_up_rounds", str(raw["algorithm"]["warm_up_rounds"])]
    cmd = [a.python, __file__, "htfllib", "--dest", str(a.dest), "--dataset", dataset]
    cmd += ["--algo", a.algo, "--family", *family, "--", "--global_rounds", str(a.rounds)]
    cmd += flags + a.htfllib_flags
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD": "1"}
    done = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if done.returncode:
        sys.stderr.write(done.stdout[-4000:] + done.stderr[-4000:])
        raise SystemExit(f"HtFLlib's run failed ({done.returncode})")
    theirs = json.loads(done.stdout.strip().splitlines()[-1])
    # HtFLlib evaluates before each round: entry r is after r rounds of training (entry 0:
    # untrained); FedL2G's server starts evaluating after its warm-up rounds
    # (`serverl2g_feat.py:42`), rayfl scores after every round, so rayfl's first `warm` entries
    # are before any training and its entry warm + r - 1 is after r rounds of training
    warm = raw["algorithm"]["warm_up_rounds"] if a.algo == "fedl2g" else 0
    row = {
        "algo": a.algo,
        "dataset": a.dataset,
        "seed": a.seed,
        "command": "python3 experiments/peers/htfllib.py " + " ".join(sys.argv[1:]),
        "config": raw,
        "htfllib_flags": flags + a.htfllib_flags,
        "htfllib_commit": (a.dest / "COMMIT").read_text().strip(),
        "rayfl": ours[warm:],
        "htfllib": theirs[1 : a.rounds - warm + 1],
        "rayfl_failed": failed,
        "rayfl_all": ours,  # every round's score, as recorded
        "htfllib_all": theirs,
    }
    return row


def parse_flags(extra: list[str]) -> dict[str, Any]:
    """`--name value` pairs (main.py's long option names) as typed values."""
    flags: dict[str, Any] = {}
    for key, value in zip(extra[::2], extra[1::2]):
        name = key.lstrip("-")
        default = HTFLLIB_DEFAULTS.get(name)
        flags[name] = type(default)(value) if default is not None else value
    return flags


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("convert", help="rayfl partition -> HtFLlib dataset folder")
    c.add_argument("run_dir", type=Path)
    c.add_argument("out", type=Path)
    i = sub.add_parser("install", help="unpack HtFLlib's system/ from a snapshot")
    i.add_argument("git_dir", type=Path)
    i.add_argument("dest", type=Path)
    i.add_argument("--commit", default="HEAD", help="the snapshot's commit to unpack")
    h = sub.add_parser("htfllib", help="run HtFLlib on a converted folder")
    h.add_argument("--dest", type=Path, required=True)
    h.add_argument("--dataset", required=True)
    h.add_argument("--algo", choices=sorted(ALGOS), required=True)
    h.add_argument("--family", nargs="+", required=True)
    h.add_argument("flags", nargs="*", help="after --: main.py flags, e.g. --global_rounds 5")
    p = sub.add_parser("compare", help="rayfl and HtFLlib on the same partition")
    p.add_argument("--algo", choices=sorted(ALGOS), required=True)
    p.add_argument("--dest", type=Path, required=True, help="HtFLlib install (see install)")
    p.add_argument("--python", default=sys.executable, help="Python of HtFLlib's environment")
    p.add_argument("--dataset", default="fmnist")
    p.add_argument("--family", default="cnn5")
    p.add_argument("--clients", type=int, default=10)
    p.add_argument("--alpha", type=float, default=0.1, help="Dirichlet concentration")
    p.add_argument("--train-samples", type=int, default=3000)
    p.add_argument("--num-classes", type=int, default=100, help="synthetic only")
    p.add_argument("--side", type=int, default=16, help="synthetic only: image side")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--params", default="{}", help="JSON of rayfl algorithm options")
    p.add_argument("--htfllib-flags", nargs="*", default=[], help="extra main.py flags")
    p.add_argument("--out", type=Path, help="append the JSON row to this file")
    a, unknown = ap.parse_known_args()
    if unknown and a.cmd != "compare":
        ap.error(f"unrecognized arguments: {' '.join(unknown)}")
    if (
        unknown
    ):  # main.py flags after --htfllib-flags, e.g. --T_start 0.9999 (they look like options)
        a.htfllib_flags = a.htfllib_flags + unknown
    if a.cmd == "convert":
        print(json.dumps(convert(a.run_dir, a.out)))
    elif a.cmd == "install":
        print(install(a.git_dir, a.dest, a.commit))
    elif a.cmd == "htfllib":
        accs = run_htfllib(a.dest, a.dataset, a.algo, a.family, parse_flags(a.flags))
        print(json.dumps(accs))
    else:
        row = compare(a)
        line = json.dumps(row)
        if a.out:
            with open(a.out, "a") as f:
                f.write(line + "\n")
        print(json.dumps({k: row[k] for k in ("algo", "dataset", "rayfl", "htfllib")}))


if __name__ == "__main__":
    main()
