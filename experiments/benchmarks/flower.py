"""rayfl against Flower's simulation engine on one workload, end to end, side by side.

    python3 experiments/benchmarks/flower.py [--rounds 20] [--repeat 2] [--out DIR]

The workload is `fedavg_cnn_small.yaml` in this folder: Fashion-MNIST (60,000 images), 20
clients, Dirichlet 0.5, `cnn_small` for every client, FedAvg over all clients every round,
1 local epoch, batch 64, plain SGD at 0.05, 2 workers of 1 CPU (one torch thread each), every
client evaluated on its test split with the global model in the last round only.

Steps:
1. Flower (`flwr[simulation]`, pinned below, with the Ray it pins) is installed into a
   throwaway virtual environment, `DIR/flwr-env`, that sees this interpreter's torch and
   numpy (`--system-site-packages`). None of Flower's code enters rayfl.
2. This interpreter builds the benchmark's federation with rayfl (same config, same seed) and
   writes what Flower's clients need to `DIR/federation.npz`: the images (uint8), labels,
   normalisation and each client's train and test indices. This is not timed.
3. Each repetition runs, as processes timed from their start to their exit: `rayfl run` of the
   benchmark config, and this script's `flower` mode in the throwaway environment (Flower's
   `run_simulation` on its Ray backend: a `ServerApp` with Flower's own `FedAvg` strategy and a
   `ClientApp` that trains and evaluates the same model with the same loop shape). The order
   alternates between repetitions.
4. It prints each side's end-to-end seconds per repetition and the ratio Flower / rayfl, and
   writes `DIR/flower.json`.

What differs and why: Flower's client reads its data from the `.npz` (once per Ray worker
process) where rayfl reads the dataset files and puts the arrays in Ray's object
store; Flower's data preparation is therefore not in its time, rayfl's is. Numbers differ
between the two (different random streams for initialisation and batches); the work per round
is the same. Measure on a quiet machine (`uptime` load average < 0.5).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
CONFIG = HERE / "fedavg_cnn_small.yaml"
FLOWER = "flwr[simulation]==1.42.0"


def install(env: Path) -> Path:
    """The throwaway environment's interpreter, with Flower installed once."""
    python = env / "bin" / "python"
    if not python.exists():
        subprocess.run(
            [sys.executable, "-m", "venv", "--system-site-packages", str(env)], check=True
        )
    probe = subprocess.run([str(python), "-c", "import flwr"], capture_output=True)
    if probe.returncode != 0:
        pip = [str(python), "-m", "pip", "install", "-q", FLOWER]
        done = subprocess.run(pip, capture_output=True, text=True)
        if done.returncode != 0:
            sys.exit(f"installing {FLOWER} failed:\n{done.stdout}{done.stderr}")
    return python


def run_config(out: Path, rounds: int) -> tuple[Path, list[str]]:
    """The benchmark config without its `bench:` section, and the overrides of this comparison."""
    import yaml

    raw = yaml.safe_load(CONFIG.read_text())
    raw.pop("bench", None)
    path = out / "fedavg_cnn_small.yaml"
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    return path, [f"engine.rounds={rounds}", f"engine.eval_every={rounds}"]


def export(config: Path, overrides: list[str], target: Path) -> dict[str, Any]:
    """Write the benchmark's federation, as rayfl builds it, for Flower's clients."""
    import numpy as np

    from rayfl.config import load_config
    from rayfl.data.federated import prepare_federation

    cfg = load_config(config, overrides)
    fed = prepare_federation(cfg)
    ds = fed.dataset
    arrays: dict[str, Any] = {
        "x": ds.x_train,
        "y": ds.y_train,
        "mean": np.asarray(ds.mean, dtype=np.float32),
        "std": np.asarray(ds.std, dtype=np.float32),
        "scale": np.float32(ds.scale),
    }
    for i, c in enumerate(fed.clients):
        arrays[f"train{i}"] = c.train
        arrays[f"test{i}"] = c.test
    np.savez(target, **arrays)
    t = cfg.train
    return {
        "clients": fed.num_clients,
        "num_classes": ds.num_classes,
        "batch_size": t.batch_size,
        "lr": t.lr,
        "local_epochs": t.local_epochs,
        "workers": cfg.engine.num_workers,
        "rounds": cfg.engine.rounds,
        "seed": cfg.seed,
    }


def timed(cmd: list[str], log: Path, env: dict[str, str] | None = None) -> float:
    """Seconds from the command's start to its exit; its output goes to `log`."""
    start = time.perf_counter()
    with log.open("w") as f:
        code = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=env).returncode
    seconds = time.perf_counter() - start
    if code != 0:
        sys.exit(f"{' '.join(cmd[:3])} ... failed (exit {code}); see {log}")
    return seconds


def compare(args: argparse.Namespace) -> int:
    load = os.getloadavg()  # before anything of the comparison runs
    out = Path(args.out or tempfile.mkdtemp(prefix="rayfl-flower-"))
    out.mkdir(parents=True, exist_ok=True)
    python = install(out / "flwr-env")
    config, overrides = run_config(out, args.rounds)
    data = out / "federation.npz"
    spec = export(config, overrides, data)
    (out / "spec.json").write_text(json.dumps(spec))
    rayfl = shutil.which("rayfl")
    if rayfl is None:
        sys.exit("the `rayfl` command is not on PATH: install rayfl first (README)")
    rayfl_cmd = [rayfl, "run", str(config), *overrides, "--no-progress"]
    flower_cmd = [str(python), __file__, "flower", str(out / "spec.json"), str(data)]
    # Flower's env must not see a PYTHONPATH that puts another Ray in front of its own.
    flower_env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    rows = []
    for rep in range(args.repeat):
        sides = [("rayfl", rayfl_cmd, None), ("flower", flower_cmd, flower_env)]
        if rep % 2:
            sides.reverse()
        row: dict[str, float] = {}
        for name, cmd, env in sides:
            extra = ["--out", str(out / f"rayfl-run{rep}")] if name == "rayfl" else []
            row[name] = timed(cmd + extra, out / f"{name}{rep}.log", env)
            print(f"repetition {rep}: {name} {row[name]:.1f} s", flush=True)
        row["flower_over_rayfl"] = row["flower"] / row["rayfl"]
        rows.append(row)
    ratios = [r["flower_over_rayfl"] for r in rows]
    summary = {
        "workload": str(CONFIG.relative_to(HERE.parent.parent)),
        "rounds": args.rounds,
        "flower": FLOWER,
        "repetitions": rows,
        "median_flower_over_rayfl": statistics.median(ratios),
        "load_average_at_start": load,
    }
    (out / "flower.json").write_text(json.dumps(summary, indent=2))
    print(f"{'rep':>3} {'rayfl s':>8} {'flower s':>9} {'flower/rayfl':>12}")
    for i, r in enumerate(rows):
        print(f"{i:3d} {r['rayfl']:8.1f} {r['flower']:9.1f} {r['flower_over_rayfl']:12.2f}")
    print(f"median flower/rayfl {summary['median_flower_over_rayfl']:.2f}; results in {out}")
    return 0


def flower(spec_path: str, data_path: str) -> None:
    """Flower's side: run inside the throwaway environment, never imports rayfl."""
    import numpy as np
    import torch
    from flwr.app import ArrayRecord, Context, Message, MetricRecord, RecordDict
    from flwr.clientapp import ClientApp
    from flwr.serverapp import Grid, ServerApp
    from flwr.serverapp.strategy import FedAvg
    from flwr.simulation import run_simulation
    from torch import nn

    spec = json.loads(Path(spec_path).read_text())
    rounds, batch = spec["rounds"], spec["batch_size"]

    def model() -> nn.Module:
        # rayfl's `cnn_small`: two conv blocks (32, 64), a linear encoder to 128, a linear head.
        return nn.Sequential(
            nn.Conv2d(1, 32, 3, padding=1), nn.ReLU(inplace=True), nn.MaxPool2d(2),
            nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(inplace=True), nn.MaxPool2d(2),
            nn.Flatten(), nn.Linear(64 * 7 * 7, 128), nn.ReLU(inplace=True),
            nn.Linear(128, spec["num_classes"]),
        )  # fmt: skip

    def client_data(cid: int, split: str) -> tuple[torch.Tensor, torch.Tensor]:
        # Flower unpickles the ClientApp's functions afresh in its actors, so a closure's dict
        # would not outlive a call: the arrays live on the actor process's `sys` module, read
        # once per process, as a rayfl worker gets the dataset once.
        d = sys.__dict__.setdefault("_rayfl_flower_data", {})
        if not d:
            torch.set_num_threads(1)
            with np.load(data_path) as f:
                d.update({k: f[k] for k in f.files})
        idx = d[f"{split}{cid}"]
        view = (-1, 1, 1)
        x = torch.from_numpy(d["x"][idx].astype(np.float32))
        x = (x / float(d["scale"]) - torch.from_numpy(d["mean"]).view(view)) / torch.from_numpy(
            d["std"]
        ).view(view)
        return x, torch.from_numpy(d["y"][idx].astype(np.int64))

    def received(
        msg: Message, context: Context, split: str
    ) -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
        """The broadcast model and this node's `split` of the data."""
        x, y = client_data(int(context.node_config["partition-id"]), split)
        net = model()
        net.load_state_dict(msg.content["arrays"].to_torch_state_dict())
        return net, x, y

    client = ClientApp()

    @client.train()
    def train(msg: Message, context: Context) -> Message:
        net, x, y = received(msg, context, "train")
        opt = torch.optim.SGD(net.parameters(), lr=spec["lr"])
        loss_fn = nn.CrossEntropyLoss()
        net.train()
        for _ in range(spec["local_epochs"]):
            order = torch.randperm(len(y))
            for s in range(0, len(y), batch):
                i = order[s : s + batch]
                loss = loss_fn(net(x[i]), y[i])
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
        content = RecordDict(
            {
                "arrays": ArrayRecord(net.state_dict()),
                "metrics": MetricRecord({"num-examples": len(y)}),
            }
        )
        return Message(content=content, reply_to=msg)

    @client.evaluate()
    def evaluate(msg: Message, context: Context) -> Message:
        net, x, y = received(msg, context, "test")
        net.eval()
        with torch.no_grad():
            correct = sum(
                int((net(x[s : s + 512]).argmax(1) == y[s : s + 512]).sum())
                for s in range(0, len(y), 512)
            )
        metrics = MetricRecord({"accuracy": correct / max(len(y), 1), "num-examples": len(y)})
        return Message(content=RecordDict({"metrics": metrics}), reply_to=msg)

    class LastRoundEval(FedAvg):
        """FedAvg that evaluates the clients in the last round only, as the rayfl run does."""

        def configure_evaluate(self, server_round, arrays, config, grid):  # type: ignore[no-untyped-def]
            return (
                super().configure_evaluate(server_round, arrays, config, grid)
                if server_round == rounds
                else []
            )

    server = ServerApp()
    n = spec["clients"]

    @server.main()
    def main(grid: Grid, context: Context) -> None:
        torch.manual_seed(spec["seed"])
        strategy = LastRoundEval(min_train_nodes=n, min_evaluate_nodes=n, min_available_nodes=n)
        result = strategy.start(
            grid=grid, initial_arrays=ArrayRecord(model().state_dict()), num_rounds=rounds
        )
        print("flower final evaluation:", result.evaluate_metrics_clientapp.get(rounds))

    run_simulation(
        server_app=server,
        client_app=client,
        num_supernodes=n,
        backend_config={
            "client_resources": {"num_cpus": 1, "num_gpus": 0.0},
            "init_args": {
                "address": "local",
                "num_cpus": spec["workers"],
                "include_dashboard": False,
            },
        },
    )


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["flower"]:
        flower(argv[1], argv[2])
        return 0
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=20, help="rounds of both runs")
    ap.add_argument("--repeat", type=int, default=2, help="repetitions, order alternating")
    ap.add_argument(
        "--out", help="folder for the environment, data and logs (default: a new temp one)"
    )
    return compare(ap.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
