"""FedGH's gap to HtFLlib: does the server header's initialisation matter?

HtFLlib's FedGH server starts its global header from client 0's initial head
(`servergh.py`: `load_item(self.clients[0].role, 'model').head`) and sends it before the first
round; rayfl's server builds a fresh head of the first architecture from the server's own seed.
This script runs both on the same partitions for several seeds and writes the per-round
accuracies to a JSON file:

    nice -n 19 python experiments/paper/fedgh_header_init.py --rounds 6 --train-samples 3000 \
        --out docs/results/fedgh_header_init.json

(or one process per init and seed, `--inits fresh --seeds 1 --out part.json`, then
`--merge part*.json --out ...`).

`client0` reproduces client 0's initial head by building its model from the engine's
initialisation seed for client 0 (`derive_seed(seed, 0, INIT)`, as the worker does).
"""

from __future__ import annotations

import argparse
import copy
import json
import tempfile
from pathlib import Path

import torch

from rayfl.algorithms import ALGORITHMS
from rayfl.algorithms.base import Algorithm, ServerContext
from rayfl.algorithms.fedgh import FedGHClient, FedGHParams, FedGHServer
from rayfl.config import build_config
from rayfl.engine.loop import Simulation
from rayfl.engine.spec import INIT, derive_seed
from rayfl.models import build_model

BASE = {
    "name": "fedgh_header_init",
    "data": {
        "dataset": "fmnist",
        "num_clients": 20,
        "partition": {"name": "dirichlet", "alpha": 0.1, "min_samples": 10},
        "test_fraction": 0.2,
        "train_samples": 6000,
    },
    "model": {"family": "cnn5"},
    "algorithm": {"name": "fedgh"},
    "train": {"local_epochs": 1, "batch_size": 10, "lr": 0.01, "momentum": 0.0},
    "engine": {"rounds": 10, "executor": "serial", "checkpoint_every": 0, "eval_every": 1},
    "eval": {"protocol": "deployed"},
    "tracking": {"backend": "none"},
}


class ClientZeroHeaderServer(FedGHServer):
    """FedGH's server with HtFLlib's initial header: client 0's initial head."""

    def __init__(self, ctx: ServerContext, params: FedGHParams) -> None:
        super().__init__(ctx, params)
        state = torch.get_rng_state()
        torch.manual_seed(derive_seed(ctx.seed, 0, INIT))  # the worker's seed for client 0
        head = build_model(ctx.architectures[0], ctx.in_shape, ctx.num_classes).head
        torch.set_rng_state(state)
        self.header.load_state_dict(head.state_dict())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--train-samples", type=int, default=6000)
    ap.add_argument("--inits", nargs="+", default=["fresh", "client0"])
    ap.add_argument("--merge", type=Path, nargs="+", help="merge these outputs into --out")
    ap.add_argument("--note", default="", help="with --merge: command, commit and date to record")
    args = ap.parse_args()
    if args.merge:  # runs split over processes: one file each
        parts = [json.loads(p.read_text()) for p in args.merge]
        merged: dict[str, dict[str, list[float]]] = {}
        for part in parts:
            for init, seeds in part["acc"].items():
                merged.setdefault(init, {}).update(seeds)
        out = {**parts[0], "acc": merged, **json.loads(args.note or "{}")}
        args.out.write_text(json.dumps(out, indent=1, sort_keys=True) + "\n")
        return
    ALGORITHMS.add(
        "fedgh_client0",
        Algorithm(
            "fedgh_client0",
            FedGHParams,
            FedGHClient,
            ClientZeroHeaderServer,
            needs_common_feature_dim=True,
        ),
    )
    results: dict[str, dict[str, list[float]]] = {}
    names = {"fresh": "fedgh", "client0": "fedgh_client0"}
    for init in args.inits:
        name = names[init]
        for seed in args.seeds:
            raw = copy.deepcopy(BASE)
            raw["seed"] = seed
            raw["algorithm"]["name"] = name
            raw["engine"]["rounds"] = args.rounds
            raw["data"]["train_samples"] = args.train_samples
            with tempfile.TemporaryDirectory() as tmp:
                result = Simulation(build_config(raw), Path(tmp)).run()
            accs = [h["personal/acc"] for h in result.history if "personal/acc" in h]
            results.setdefault(init, {})[str(seed)] = accs
            print(init, seed, [round(a, 4) for a in accs], flush=True)
            config = {**BASE, "rounds": args.rounds, "train_samples": args.train_samples}
            args.out.write_text(json.dumps({"config": config, "acc": results}, indent=1) + "\n")


if __name__ == "__main__":
    main()
