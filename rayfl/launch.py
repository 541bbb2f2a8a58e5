"""One simulation from a config, the road `rayfl run`, suites, sweeps and benchmarks take, and
the final table `rayfl run` prints. Ray and the engine are imported only when a run starts.
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from contextlib import suppress
from pathlib import Path
from typing import Any

from rayfl.errors import UserError
from rayfl.resources import check_local
from rayfl.schema import RunConfig
from rayfl.tables import text_table


def default_run_dir(cfg: RunConfig) -> Path:
    stamp = time.strftime("%Y%m%d-%H%M%S")
    return Path("runs") / f"{cfg.name}-{cfg.algorithm.name}-s{cfg.seed}-{stamp}"


def simulate(
    cfg: RunConfig,
    run_dir: str | Path,
    *,
    progress: bool = True,
    resume: bool = False,
    parent_run_id: str | None = None,
    extra_callbacks: Sequence[Any] = (),
    existing: str = "refuse",
) -> Any:
    """Run one simulation with the standard callbacks (run directory, checkpoints, tracker,
    progress). Before any data or Ray: the workers must fit this machine, the run directory is
    made, checked writable and locked, and a resume's checkpoint verified (it continues the
    MLflow run recorded there). A run already in `run_dir` is refused, moved aside (`existing=
    "archive"`, `--force`) or replaced (a suite's or sweep's own rerun)."""
    import ray

    from rayfl.engine.callbacks import ProgressBar, RunDirectory, TrackerCallback
    from rayfl.engine.checkpoint import Checkpoint
    from rayfl.engine.loop import Simulation
    from rayfl.engine.rundir import (
        RunLock,
        archive,
        check_mlflow_ref,
        check_writable,
        is_run,
        read_mlflow_run,
        write_mlflow_run,
    )
    from rayfl.tracking import make_tracker
    from rayfl.tracking.provenance import run_name_for

    if cfg.engine.executor == "ray" and not ray.is_initialized():
        check_local(cfg.engine)  # a private Ray: what this machine cannot place, refused first
    run_dir = Path(run_dir)
    created = not os.path.lexists(run_dir)
    try:
        if not resume and existing != "replace" and is_run(run_dir):
            if existing != "archive":
                raise UserError(
                    f"--out {run_dir}: holds a run already; choose another --out, continue it "
                    "with --resume, or pass --force to move it aside first"
                )
            archive(run_dir)
        check_writable(run_dir)
        with RunLock(run_dir):
            checkpoint = Checkpoint(run_dir, cfg.engine.checkpoint_every, resume=resume, cfg=cfg)
            if resume:  # every resume (CLI, Python API, a suite's runs) goes through the gate
                check_mlflow_ref(run_dir, cfg)
                checkpoint.verify(cfg)
            sim = Simulation(cfg, run_dir)
            out = RunDirectory(run_dir)
            previous = read_mlflow_run(run_dir) if resume else None
            tracker = make_tracker(
                cfg.tracking.backend,
                experiment=cfg.tracking.experiment,
                run_name=cfg.tracking.run_name or run_name_for(cfg),
                tracking_uri=cfg.tracking.uri,
                parent_run_id=parent_run_id,
                run_id=previous["run_id"] if previous else None,
            )
            run_id = getattr(tracker, "run_id", None)
            if cfg.tracking.backend == "mlflow" and run_id:
                write_mlflow_run(run_dir, run_id, getattr(tracker, "tracking_uri", "") or "")
            sim.callbacks = [checkpoint, out, *extra_callbacks, TrackerCallback(tracker, out)]
            if progress:
                sim.callbacks.append(ProgressBar())
            result = sim.run()
            result.run_dir = run_dir
            result.tracker_run_id = run_id
            return result
    except UserError:
        if created:  # a refused run leaves nothing behind
            with suppress(OSError):
                run_dir.rmdir()
        raise


def final_table(result: Any, wall_s: float) -> str:
    cfg: RunConfig = result.config
    final = result.final
    rows: list[tuple[str, str]] = accuracy_rows(final, cfg.eval.targets)
    if "baseline/local_acc" in final:
        rows.append(("local-only acc, same partition", f"{final['baseline/local_acc']:.4f}"))
        rows.append(("gain over local (points)", f"{final['baseline/gain_points']:+.2f}"))
    if "baseline/control_acc" in final:
        rows.append(("no-federation control acc", f"{final['baseline/control_acc']:.4f}"))
        gain = final["baseline/federated_gain_points"]
        rows.append(("federated gain over control (points)", f"{gain:+.2f}"))
    for key in (
        "proxy/acc",
        "global/acc",
        "pfedes/kl_local_proxy",
        "fedfd/distill_loss",
        "privacy/epsilon",
    ):
        if key in final:
            chance = final.get("proxy/chance") if key == "proxy/acc" else None
            note = "" if chance is None else f"  (chance {chance:.4f})"
            rows.append((key, f"{final[key]:.4f}{note}"))
    rounds = max(1, len(result.history))
    up, down = final.get("comm/bytes_up_total", 0), final.get("comm/bytes_down_total", 0)
    per_round = f"{up / rounds / 1e6:.3f} / {down / rounds / 1e6:.3f}"
    rows.append(("comm MB up / down per round", per_round))
    rows.append(("comm MB up / down total", f"{up / 1e6:.2f} / {down / 1e6:.2f}"))
    rows.append(("rounds", f"{len(result.history)}"))
    rejected, replies = rejected_replies(result.history)
    rows.append(("server/rejected", f"{rejected:g} of {replies:g} replies"))
    mean_round = sum(r["time/round_s"] for r in result.history) / rounds
    rows.append(("seconds per round (mean)", f"{mean_round:.2f}"))
    rows.append(("wall time s", f"{wall_s:.1f}"))
    title = (
        f"{cfg.name}: {cfg.algorithm.name} on {cfg.data.dataset}, {cfg.data.num_clients} clients, "
        f"seed {cfg.seed}, status {result.status}"
    )
    from rayfl.engine.callbacks import proxy_health

    warning = proxy_health(cfg, result.history)
    lines = [title, *text_table(rows[0], rows[1:])]
    return "\n".join(lines) + (f"\n  {warning}" if warning else "")


def accuracy_rows(final: dict[str, float], targets: Sequence[float]) -> list[tuple[str, str]]:
    """The final table's accuracy lines: the last round's (client mean, 95% CI, statistics,
    per architecture), at the round chosen on validation (never on test data), and the rounds,
    bytes and seconds to each `eval.targets` accuracy."""
    from rayfl.engine.metrics import AT_BEST_VAL, target_key

    def num(key: str, prefix: str = "") -> str:
        value = final.get(prefix + key)
        return "-" if value is None else f"{value:.4f}"

    rows = [("last round: personal/acc", num("personal/acc"))]
    if "personal/acc_ci95" in final:
        rows.append(
            ("  client mean ± 95% CI", f"{num('personal/acc_mean')} ± {num('personal/acc_ci95')}")
        )
    for key in ("personal/acc_std", "personal/acc_worst10", "personal/loss"):
        if key in final:
            rows.append((f"  {key}", num(key)))
    for key in ("personal/val_acc", "personal/val_loss"):
        if key in final:
            rows.append((f"  {key} (validation)", num(key)))
    for key in sorted(k for k in final if k.startswith("personal/acc/arch=")):
        rows.append((f"  {key}", num(key)))
    if AT_BEST_VAL + "round" in final:
        chosen = int(final[AT_BEST_VAL + "round"])
        label = f"at best validation round ({chosen}): personal/acc"
        ci = final.get(AT_BEST_VAL + "personal/acc_ci95")
        mean = f"  (client mean {num('personal/acc_mean', AT_BEST_VAL)} ± {ci:.4f})" if ci else ""
        rows.append((label, num("personal/acc", AT_BEST_VAL) + mean))
    for t in targets:
        rounds, reached = final.get(target_key("rounds", t)), "not reached"
        if rounds is not None:
            mb, secs = final[target_key("bytes", t)] / 1e6, final[target_key("seconds", t)]
            reached = f"round {rounds:g}, {mb:.2f} MB, {secs:.1f} s"
        rows.append((f"to personal/acc {t:g}", reached))
    return rows


def rejected_replies(history: Sequence[dict[str, float]]) -> tuple[float, float]:
    """Replies the server rejected (non-finite or empty) and replies received, over the run."""
    rejected = sum(r.get("server/rejected", 0.0) for r in history)
    replies = sum(r.get("clients", 0.0) for r in history)
    return rejected, replies
