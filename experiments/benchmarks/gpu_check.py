"""The GPU path, for real: run on a machine with a CUDA GPU.

    python experiments/benchmarks/gpu_check.py --out gpu-check

1. Placement: 4 Ray workers share one GPU (`num_gpus: 0.25`); prints each worker's Ray GPU ids,
   CUDA_VISIBLE_DEVICES and torch device.
2. Real CUDA training: a short FedAvg run (Fashion-MNIST, cnn_small) on those 4 workers, with the
   peak GPU memory of each worker (`torch.cuda.max_memory_allocated` inside the worker).
3. Throughput: clients per second for 100 cnn_small clients, one process on the GPU (serial
   executor) against 4 Ray workers sharing it.
4. Per-architecture shares (`engine.resources_by_arch`): a pFedES run on the three `seed3`
   architectures whose workers reserve 0.5 (resnet_small), 0.25 (cnn_small) and 0.125 (mlp) of
   the GPU; checks that every client trained on a worker of its architecture's share, on CUDA.

Writes `<out>/gpu_check.json` and prints a table, in one run. Without a GPU it stops at once with
exit code 2 and says so. `--cpu-smoke` runs the same code on the CPU with tiny settings and Ray's
logical GPUs (it checks the script, it measures nothing; `tests/test_gpu_check.py` runs it).

The workers' details are read after the last round, before the run ends: a run closes its
executor (and its actors) while the callbacks' `on_run_end` runs.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any


def settings(cpu_smoke: bool) -> dict[str, Any]:
    raw: dict[str, Any] = {
        "name": "gpu_check",
        "seed": 0,
        "data": {
            "dataset": "fmnist",
            "num_clients": 100,
            "partition": {"name": "dirichlet", "alpha": 0.5, "min_samples": 20},
        },
        "model": {"architectures": ["cnn_small"]},
        "algorithm": {"name": "fedavg"},
        "train": {"local_epochs": 1, "batch_size": 64, "lr": 0.05, "momentum": 0.9},
        "engine": {"rounds": 3, "checkpoint_every": 0, "eval_every": 100, "device": "cuda"},
        "tracking": {"backend": "none"},
    }
    if cpu_smoke:
        raw["data"] = {
            "dataset": "synthetic",
            "num_clients": 8,
            "partition": {"name": "iid"},
            "options": {"num_samples": 800, "num_test": 200, "shape": [1, 28, 28]},
        }
        raw["engine"]["rounds"] = 2
        raw["engine"]["device"] = "cpu"
    return raw


SHARES = {"resnet_small": 0.5, "cnn_small": 0.25, "mlp": 0.125}


def per_arch_check(raw: dict[str, Any], run_dir: Path, cpu_smoke: bool) -> dict[str, Any]:
    """Step 4: every client on a worker with its architecture's GPU share."""
    shares = {"tiny_a": 0.5, "tiny_b": 0.25} if cpu_smoke else SHARES
    raw = {**raw, "algorithm": {"name": "pfedes"}}
    raw["model"] = {"family": "tiny2"} if cpu_smoke else {"family": "seed3"}
    pools = ", ".join(f"{a}: {{num_cpus: 1, num_gpus: {g}}}" for a, g in shares.items())
    overrides = [
        "engine.executor=ray",
        f"engine.resources_by_arch={{{pools}}}",
        "engine.clients_per_call=4",
        "engine.rounds=2",
    ]
    result, infos, placements = run(raw, overrides, run_dir, with_placements=True)
    from rayfl.models.families import family_from_config

    archs = family_from_config(raw["model"]["family"]).assign(raw["data"]["num_clients"])
    wrong = [
        c
        for c, w in placements.items()
        if infos[w]["resources"].get("GPU", 0.0) != shares[archs[c]]
    ]
    if wrong:
        raise RuntimeError(f"clients {wrong} trained on a worker of another architecture's share")
    return {
        "workers": [
            {k: i[k] for k in ("pid", "resources", "device", "cuda_max_memory_mb")} for i in infos
        ],
        "clients_placed": len(placements),
        "personal_acc": result.final.get("personal/acc"),
    }


def run(
    raw: dict[str, Any], overrides: list[str], run_dir: Path, with_placements: bool = False
) -> Any:
    from rayfl.config import build_config
    from rayfl.engine.callbacks import Callback
    from rayfl.engine.loop import Simulation

    cfg = build_config(raw, overrides)
    infos: list[dict[str, Any]] = []
    placements: dict[int, int] = {}

    class WorkerInfo(Callback):
        """The workers' placement and peak GPU memory after the last round, while they live."""

        def on_round_end(self, sim: Any, round_idx: int, metrics: dict[str, float]) -> None:
            if round_idx == cfg.engine.rounds and hasattr(sim.executor, "worker_info"):
                infos[:] = sim.executor.worker_info()
                placements.update(sim.executor.placements)

    result = Simulation(cfg, run_dir, [WorkerInfo()]).run()
    if result.status != "FINISHED":
        raise RuntimeError(f"the run {overrides} ended {result.status}")
    return (result, infos, placements) if with_placements else (result, infos)


def clients_per_second(result: Any) -> float:
    rows = result.history[1:] or result.history  # the first round warms up (CUDA, kernels)
    return sum(r["clients"] for r in rows) / sum(r["time/round_s"] for r in rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="folder for gpu_check.json")
    parser.add_argument("--cpu-smoke", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)

    import ray
    import torch

    if not args.cpu_smoke and not torch.cuda.is_available():
        print(
            "gpu_check: error: no CUDA GPU is visible to torch (torch.cuda.is_available() is "
            "False); run this on a GPU machine",
            file=sys.stderr,
        )
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    raw = settings(args.cpu_smoke)
    gpus = 1 if args.cpu_smoke else torch.cuda.device_count()
    # at least 4 (logical) CPUs: one per worker
    cpus = max(4, os.cpu_count() or 1)
    ray.init(
        address="local",
        num_cpus=cpus,
        num_gpus=gpus,
        include_dashboard=False,
        configure_logging=False,
    )
    report: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "device": "cpu (smoke test)" if args.cpu_smoke else torch.cuda.get_device_name(0),
        "torch": torch.__version__,
        "ray": ray.__version__,
    }
    shared = [
        "engine.executor=ray",
        "engine.num_workers=4",
        "engine.worker_resources={num_cpus: 1, num_gpus: 0.25}",
    ]
    try:
        # 1 + 2: placement and real training on 4 workers sharing the GPU, memory per worker
        result, infos = run(raw, [*shared, "engine.clients_per_call=5"], out / "shared")
        if len(infos) != 4:
            raise RuntimeError(f"expected the details of 4 workers, got {len(infos)}")
        report["shared_gpu_workers"] = infos
        report["shared_gpu_run"] = {
            "rounds": len(result.history),
            "train_loss": result.final.get("train/loss"),
            "global_acc": result.final.get("global/acc"),
            "clients_per_s": clients_per_second(result),
        }
        # 3: clients per second, one process against 4 workers sharing the GPU
        n = raw["data"]["num_clients"]
        variants = {
            "serial": ["engine.executor=serial"],
            "ray4": [*shared, f"engine.clients_per_call={max(1, n // 8)}"],
        }
        speeds = {}
        for label, overrides in variants.items():
            res, _ = run(raw, overrides, out / label)
            speeds[label] = clients_per_second(res)
            print(f"  ... {label}: {speeds[label]:.1f} clients/s", file=sys.stderr, flush=True)
        report["clients_per_s"] = speeds
        report["ray4_over_serial"] = speeds["ray4"] / speeds["serial"]
        # 4: a worker pool per architecture, each with its own GPU share
        report["per_arch_shares"] = per_arch_check(raw, out / "per_arch", args.cpu_smoke)
    finally:
        ray.shutdown()
    (out / "gpu_check.json").write_text(json.dumps(report, indent=2, default=str))
    print(f"gpu check on {report['device']} ({report['date']})")
    for info in report["shared_gpu_workers"]:
        print(
            f"  worker pid {info['pid']}: ray gpu ids {info['gpu_ids']}, CUDA_VISIBLE_DEVICES="
            f"{info['cuda_visible_devices']}, device {info['device']}, "
            f"peak GPU memory {info.get('cuda_max_memory_mb', 0.0):.1f} MB"
        )
    print(f"  shared-GPU FedAvg run: {report['shared_gpu_run']}")
    for label, v in report["clients_per_s"].items():
        print(f"  {label:15s} {v:8.1f} clients/s")
    print(f"  4 workers / one process: {report['ray4_over_serial']:.2f}x")
    for info in report["per_arch_shares"]["workers"]:
        print(
            f"  per-arch worker pid {info['pid']}: {info['resources']}, device {info['device']}, "
            f"peak GPU memory {info.get('cuda_max_memory_mb', 0.0):.1f} MB"
        )
    print(f"  written: {out / 'gpu_check.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
