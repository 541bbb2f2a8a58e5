"""Cross-cutting concerns of a run, as callbacks (`rayfl.engine.hooks.Callback`): progress bar,
run directory, tracker; checkpoints are `rayfl.engine.checkpoint.Checkpoint`."""

from __future__ import annotations

import logging
import os
import platform
import sys
import time
from collections.abc import Sequence
from importlib import metadata
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import yaml

from rayfl.data.federated import save_partition
from rayfl.engine.hooks import Callback
from rayfl.engine.rundir import read_summary
from rayfl.gate import write as write_atomic
from rayfl.schema import RunConfig, to_dict
from rayfl.tables import read_table, strict_json, write_table
from rayfl.tracking.plots import plot_run
from rayfl.tracking.provenance import git_commit
from rayfl.version import __version__

if TYPE_CHECKING:
    from rayfl.engine.loop import Simulation
    from rayfl.tracking.base import Tracker

log = logging.getLogger(__name__)


HEALTH_MARGIN = 0.05  # a proxy within this much accuracy of chance has not learned


def proxy_health(cfg: RunConfig, history: Sequence[dict[str, float]]) -> str:
    """One warning line when the shared proxy's server accuracy (`proxy/acc`) is still within
    `HEALTH_MARGIN` of chance (`proxy/chance`) after `eval.proxy_health_rounds` rounds ('' when
    it has risen, is not scored, or the check is off). The pFedES design document calls this
    accuracy the health barometer of knowledge transfer; the line names its troubleshooting order."""
    after = cfg.eval.proxy_health_rounds
    scored = [r for r in history if r.get("proxy/acc") == r.get("proxy/acc") and "proxy/acc" in r]
    if not after or not scored or len(history) < after:
        return ""
    last = scored[-1]
    chance = last.get("proxy/chance")
    if chance is None or max(r["proxy/acc"] for r in scored) >= chance + HEALTH_MARGIN:
        return ""
    return (
        f"warning: proxy/acc {last['proxy/acc']:.4f} has not risen above chance ({chance:.2f}) "
        f"after {len(history)} rounds: the federation's knowledge is not reaching the proxy; "
        "check, in the design document's order, that train/pfedes/kd_loss falls, then T (3-5), "
        "then alpha / proxy_lr, then the EMA (docs/algorithms.md, pFedES)"
    )


class ProgressBar(Callback):
    """Progress over rounds with elapsed time and the current personalized accuracy: one tqdm bar
    on a terminal, or one plain line per round when `stream` is not a terminal or reports zero
    columns (CI logs, some IDE consoles), where a bar would vanish or smear.

    On a terminal the bar also moves inside a round: it registers itself as the executor's
    progress listener and shows the phase and the clients done, `r4 fit 12/20`, `r4 server`,
    `r4 eval 37/50` (redrawn at most every `redraw_s` seconds, and at the end of each phase)."""

    def __init__(
        self, stream: Any = None, plain: bool | None = None, redraw_s: float = 0.2
    ) -> None:
        self.stream = stream
        self.plain = plain
        self.redraw_s = redraw_s
        self.bar: Any = None
        self._start = 0.0
        self._round = 0
        self._phase = ""
        self._post: dict[str, str] = {}
        self._drawn = 0.0
        self._warned = False  # the proxy-health warning is printed once

    @staticmethod
    def wants_plain(stream: Any) -> bool:
        """No terminal, or a terminal that reports zero columns."""
        try:
            if not stream.isatty():
                return True
            return os.get_terminal_size(stream.fileno()).columns <= 0
        except (AttributeError, OSError, ValueError):
            return True

    def on_run_start(self, sim: Simulation) -> None:
        stream = self.stream or sys.stderr
        self.stream = stream
        self._start = time.perf_counter()
        if self.plain is None:
            self.plain = self.wants_plain(stream)
        if self.plain:
            return
        from tqdm.auto import tqdm

        self.bar = tqdm(
            total=sim.cfg.engine.rounds,
            initial=sim.start_round - 1,
            desc=sim.cfg.algorithm.name,
            unit="round",
            file=stream,
            dynamic_ncols=True,
        )
        self._round = sim.start_round - 1
        if sim.executor is not None:
            sim.executor.progress = self.on_progress

    def on_progress(self, phase: str, done: int, total: int) -> None:
        """The executor's report after a batch of clients: `phase` ("fit" or "eval"), clients
        done of `total` in this round's phase. A finished fit means the server step runs now."""
        if phase == "fit" and self._phase != "fit":
            self._round += 1  # a round starts with its fit phase
        finished = done >= total
        self._phase = "server" if phase == "fit" and finished else phase
        now = time.monotonic()
        if self.bar is None or (not finished and now - self._drawn < self.redraw_s):
            return
        self._drawn = now
        where = "server" if self._phase == "server" else f"{phase} {done}/{total}"
        self.bar.set_postfix({"now": f"r{self._round} {where}", **self._post}, refresh=True)

    @staticmethod
    def _fields(round_idx: int, metrics: dict[str, float]) -> dict[str, str]:
        post = {"round": str(round_idx)}
        for key, short in (
            ("personal/acc", "acc"),
            ("baseline/local_acc", "local"),
            ("baseline/control_acc", "control"),
            ("proxy/acc", "proxy"),
            ("proxy/chance", "chance"),
            ("global/acc", "global"),
        ):
            if key in metrics and metrics[key] == metrics[key]:  # NaN: not evaluated this round
                post[short] = f"{metrics[key]:.4f}"
        post["s/round"] = f"{metrics['time/round_s']:.1f}"
        return post

    def on_round_end(self, sim: Simulation, round_idx: int, metrics: dict[str, float]) -> None:
        post = self._fields(round_idx, metrics)
        warning = "" if self._warned else proxy_health(sim.cfg, sim.result.history)
        if warning:
            self._warned = True
            log.warning(warning)
            if self.bar is not None:
                self.bar.write(warning, file=self.stream)
            else:
                print(warning, file=self.stream, flush=True)
        if self.bar is None:
            del post["round"]
            elapsed = time.perf_counter() - self._start
            text = "  ".join(f"{k} {v}" for k, v in post.items())
            print(
                f"{sim.cfg.algorithm.name} round {round_idx}/{sim.cfg.engine.rounds}  {text}  elapsed {elapsed:.0f}s",
                file=self.stream,
                flush=True,
            )
            return
        self._post = {k: v for k, v in post.items() if k != "round"}
        self.bar.set_postfix(post, refresh=False)
        self.bar.update(1)

    def on_run_end(self, sim: Simulation, status: str) -> None:
        if self.bar is not None:
            self.bar.close()


def versions() -> dict[str, str]:
    return {
        "rayfl": __version__,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "ray": metadata.version("ray"),  # read without importing Ray (`rayfl validate`)
        "numpy": np.__version__,
    }


CLIENTS_FILE = "clients.parquet"


class RunDirectory(Callback):
    """Writes the run directory: config.yaml and the partition's Parquet files at the start,
    metrics.parquet and clients.parquet (one row per client and evaluated round,
    `rayfl.engine.metrics.per_client_rows`) after every round (so a crash loses no measured
    round), summary.json and the plots at the end."""

    def __init__(self, run_dir: str | Path) -> None:
        self.run_dir = Path(run_dir)
        self.artifacts: list[Path] = []
        self._opened = False
        self._clients_before: list[dict[str, Any]] = []  # a resumed run's earlier rounds
        self._commits: list[str] = []  # the git commits of the run's pieces, in order

    def on_run_start(self, sim: Simulation) -> None:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self._opened = True
        if sim.start_round > 1 and (self.run_dir / CLIENTS_FILE).is_file():
            self._clients_before = [
                r for r in read_table(self.run_dir / CLIENTS_FILE) if r["round"] < sim.start_round
            ]
        earlier = read_summary(self.run_dir).get("commits") if sim.start_round > 1 else None
        earlier = [c for c in earlier if isinstance(c, str)] if isinstance(earlier, list) else []
        here = git_commit()
        self._commits = [*earlier, *([here] if here and here not in earlier else [])]
        config_path = self.run_dir / "config.yaml"
        write_atomic(config_path, yaml.safe_dump(to_dict(sim.cfg), sort_keys=False).encode())
        # RUNNING until the end of the run: a directory left RUNNING without its lock was killed.
        self.write_summary(sim, "RUNNING")
        self.artifacts = [config_path, *save_partition(sim.federation, self.run_dir)]

    def on_round_end(self, sim: Simulation, round_idx: int, metrics: dict[str, float]) -> None:
        write_metrics(sim.result.history, self.run_dir / "metrics.parquet")
        if sim.result.clients and sim.result.clients[-1]["round"] == round_idx:
            write_table(self._clients_before + sim.result.clients, self.run_dir / CLIENTS_FILE)

    def write_summary(self, sim: Simulation, status: str) -> None:
        """summary.json as strict JSON (NaN and inf written as null), replaced atomically.
        `wall_s` sums the pieces of a resumed run; `error` is what ended a FAILED run."""
        history = sim.result.history
        summary = {
            "status": status,
            "name": sim.cfg.name,
            "seed": sim.cfg.seed,
            "rounds": len(history),
            "wall_s": sim.wall_s(),
            "final": sim.result.final,
            "config": to_dict(sim.cfg),
            "versions": versions(),
            "commits": self._commits,  # rayfl's code in each piece of a resumed run (in a repo)
        }
        if sim.result.error is not None:
            summary["error"] = sim.result.error
        write_atomic(self.run_dir / "summary.json", strict_json(summary, indent=2).encode())

    def on_run_end(self, sim: Simulation, status: str) -> None:
        """summary.json, then the plots: the label distribution, the learning curves and the
        accuracy per architecture (`rayfl.tracking.plots.plot_run`)."""
        if not self._opened:
            # the run failed before it started (e.g. a refused resume): leave the directory as it was
            return
        history = sim.result.history
        self.write_summary(sim, status)
        self.artifacts.append(self.run_dir / "summary.json")
        try:
            self.artifacts += plot_run(
                self.run_dir,
                history,
                sim.federation.class_counts("train"),
                sim.federation.dataset.name,
                sim.cfg.name,
            )
        except Exception:  # the run's results are written: a plot must not fail the run
            log.exception("could not draw the run's plots")
        if history:
            # metrics.parquet is already current: on_round_end rewrites it after every round.
            self.artifacts.append(self.run_dir / "metrics.parquet")
            if (self.run_dir / CLIENTS_FILE).is_file():
                self.artifacts.append(self.run_dir / CLIENTS_FILE)


def write_metrics(history: list[dict[str, float]], path: Path) -> None:
    write_table(history, path, key=lambda k: (k != "round", k))


def dataset_views(sim: Simulation) -> list[tuple[str, str, Any, Any]]:
    """(name, context, inputs, labels) of the data a run uses: every sample some client holds
    (train and local test splits) and the server's test set."""
    fed = sim.federation
    used = np.sort(np.concatenate([np.concatenate([c.train, c.test, c.val]) for c in fed.clients]))
    ds, name = fed.dataset, sim.cfg.data.dataset
    return [
        (f"{name}-clients-{len(used)}", "train", ds.x_train[used], ds.y_train[used]),
        (f"{name}-test-{len(ds.y_test)}", "test", ds.x_test, ds.y_test),
    ]


def _tracked(row: dict[str, float]) -> dict[str, float]:
    """A round's metrics as tracked: `round` is the step and `clients` the count of replies,
    bookkeeping, not results."""
    return {k: v for k, v in row.items() if k not in ("round", "clients")}


class TrackerCallback(Callback):
    """Sends config, per-round metrics and the run directory's artifacts to a `Tracker` (MLflow)."""

    def __init__(self, tracker: Tracker, run_dir: RunDirectory | None = None) -> None:
        self.tracker = tracker
        self.run_dir = run_dir

    def on_run_start(self, sim: Simulation) -> None:
        self.tracker.log_config(to_dict(sim.cfg))
        self.tracker.set_tags(
            {
                "algorithm": sim.cfg.algorithm.name,
                "dataset": sim.cfg.data.dataset,
                "rayfl.config_name": sim.cfg.name,
            }
        )
        log_missing = getattr(self.tracker, "log_missing", None)
        if log_missing is not None and sim.result.history:  # a resume: rounds it may have missed
            log_missing([(int(r["round"]), _tracked(r)) for r in sim.result.history])
        log_dataset = getattr(self.tracker, "log_dataset", None)
        if log_dataset is not None:
            for name, context, x, y in dataset_views(sim):
                log_dataset(name, x, y, context, source=sim.cfg.data.root or sim.cfg.data.dataset)

    def on_round_end(self, sim: Simulation, round_idx: int, metrics: dict[str, float]) -> None:
        self.tracker.log_metrics(_tracked(metrics), step=round_idx)

    def on_run_end(self, sim: Simulation, status: str) -> None:
        if sim.result.error is not None:  # a FAILED run says why (tag `rayfl.error`)
            self.tracker.set_tags({"rayfl.error": sim.result.error})
        if self.run_dir is not None:
            for path in self.run_dir.artifacts:
                if Path(path).exists():
                    self.tracker.log_artifact(path)
        self.tracker.close(status)
