"""The one round loop.

    sample clients (seeded) -> server.broadcast -> executor.fit (workers train batches of clients)
    -> server step (aggregate, server update, evaluate) -> evaluation phase -> metrics -> callbacks

The evaluation phase follows `eval.protocol`: `deployed` (default) broadcasts the server's new
state to every client's architecture and has the workers score every client's deployed model
(`Client.deployed_model`), participants or not; `after_fit` scores the participants inside
`executor.fit`, right after their local training.

Everything else (what is trained and shared) is the algorithm's; where it runs is the executor's.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rayfl.algorithms import ALGORITHMS
from rayfl.algorithms.base import Algorithm
from rayfl.checks import check_algorithm_fits
from rayfl.data.federated import Federation, prepare_federation
from rayfl.engine.checkpoint import Restored
from rayfl.engine.devices import Devices, RoundPlan, check_arch_names
from rayfl.engine.executor import SerialExecutor
from rayfl.engine.hooks import Callback
from rayfl.engine.metrics import (
    SCORE_KEYS,
    at_best_val,
    per_client_rows,
    reached_targets,
    summarize_clients,
)
from rayfl.engine.ray_executor import RayExecutor
from rayfl.engine.spec import RunSpec
from rayfl.engine.startup import StartupClock, spill_dir
from rayfl.engine.worker import ClientMetrics
from rayfl.errors import UserError
from rayfl.models.families import family_from_config
from rayfl.privacy import hook_for
from rayfl.sampling import sample_clients
from rayfl.schema import RunConfig, clients_per_round

log = logging.getLogger(__name__)


@dataclass
class RunResult:
    config: RunConfig
    history: list[dict[str, float]] = field(default_factory=list)
    status: str = "FINISHED"
    run_dir: Path | None = None
    tracker_run_id: str | None = None
    # one row per client and evaluated round (`client_rows`): written as clients.parquet
    clients: list[dict[str, Any]] = field(default_factory=list)
    error: str | None = None  # what ended a FAILED run (`error_text`)

    @property
    def final(self) -> dict[str, float]:
        """The last value of every metric over the run, and the round chosen on validation
        (`at_best_val`) when the clients have a validation split."""
        out: dict[str, float] = {}
        for row in self.history:
            out.update(row)
        out.update(at_best_val(self.history))
        return out


def error_text(exc: BaseException) -> str:
    """One line naming what ended a run: the error's type and the first line of its message
    (a user error raised inside a Ray actor is named as itself)."""
    cause = getattr(exc, "cause", None)
    if isinstance(cause, UserError):
        exc = cause
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[0]}" if lines else type(exc).__name__


def make_spec(cfg: RunConfig, archs: list[str], federation: Federation) -> RunSpec:
    e, t = cfg.engine, cfg.train
    threads = e.num_threads or max(1, int(e.worker_resources.num_cpus))
    return RunSpec(
        algorithm=cfg.algorithm.name,
        params=cfg.algorithm.params,
        train=t,
        seed=cfg.seed,
        archs=tuple(archs),
        in_shape=tuple(federation.dataset.in_shape),
        num_classes=federation.dataset.num_classes,
        device=e.device,
        num_threads=threads,
        server_threads=e.server_threads or max(1, os.cpu_count() or 1),
        engine=e,
        per_round=clients_per_round(cfg),
        local_baseline=cfg.eval.local_baseline,
        federation_control=cfg.eval.federation_control,
        privacy=hook_for(ALGORITHMS.get(cfg.algorithm.name), cfg),
    )


class Simulation:
    """One federated simulation: data, executor and the round loop, driven by callbacks.

    Building one checks the config against the algorithm and loads the data; `run` starts the
    executor (Ray, when it runs on Ray), runs the rounds and shuts the executor down."""

    def __init__(
        self,
        cfg: RunConfig,
        run_dir: str | Path,
        callbacks: list[Callback] | None = None,
        *,
        clock: StartupClock | None = None,
    ) -> None:
        self.cfg = cfg
        self.run_dir = Path(run_dir)
        self.callbacks = list(callbacks or [])
        self.clock = clock or StartupClock()
        self.started = time.time()  # this piece of the run: a resume adds its earlier pieces
        self.algo: Algorithm = ALGORITHMS.get(cfg.algorithm.name, key="algorithm.name")
        family = family_from_config(cfg.model.family, cfg.model.architectures)
        self.archs = family.assign(cfg.data.num_clients, cfg.model.proportions)
        self.per_round = clients_per_round(cfg)
        check_algorithm_fits(self.algo, cfg, self.archs)  # the checks that need no data, first
        check_arch_names(cfg, self.archs)
        self.clock.mark("imports")
        with self.clock.phase("data_load"):
            self.federation = prepare_federation(cfg)
        dataset = self.federation.dataset
        dims = None
        if self.algo.needs_common_feature_dim:
            dims = family.feature_dims(dataset.in_shape, dataset.num_classes)
        check_algorithm_fits(self.algo, cfg, self.archs, dims, len(self.federation.public))
        self.spec = make_spec(cfg, self.archs, self.federation)
        sizes = [len(c.train) for c in self.federation.clients]
        self.devices = None
        if cfg.devices.enabled:
            self.devices = Devices(cfg, self.archs, sizes, dataset.in_shape, dataset.num_classes)
        self.result = RunResult(cfg)
        self.start_round = 1
        self.wall_before = 0.0  # the wall time of the pieces before a resume
        self.last_clients: list[int] = []
        self.executor: SerialExecutor | RayExecutor | None = None
        self._pending: _Pending | None = None
        self._stop = False
        # client -> (digest of the payload it was scored with, its evaluation row)
        self._scores: dict[int, tuple[str, ClientMetrics]] = {}

    def wall_s(self) -> float:
        """Wall time of the run so far, summed over its pieces when it was resumed."""
        return self.wall_before + time.time() - self.started

    def run(self) -> RunResult:
        """Run the rounds. The result's `status` is FINISHED, KILLED (Ctrl-C, re-raised) or
        FAILED (the error is re-raised; its text is the result's `error`); the callbacks' end
        hooks run in every case, then the executor shuts down."""
        cfg = self.cfg
        status = "FAILED"
        try:
            if self.spec.engine.executor == "serial":
                with self.clock.phase("executor"):
                    self.executor = SerialExecutor(self.spec, self.federation)
            else:  # a Ray it starts spills objects under the run directory
                self.executor = RayExecutor(
                    self.spec, self.federation, self.clock, spill_dir(self.run_dir)
                )
            for cb in self.callbacks:
                restored = cb.resume_state(cfg)
                if restored is not None:
                    self.restore(restored)
            for cb in self.callbacks:
                cb.on_run_start(self)
            final = self.result.final  # a resumed run's totals go on
            comm = {"virtual": final.get("time/virtual_s", 0.0)}
            comm["up"] = final.get("comm/bytes_up_total", 0.0)
            comm["down"] = final.get("comm/bytes_down_total", 0.0)
            self.clock.mark("first_round_at")
            log.info("start-up: %s", self.clock.describe())
            for rnd in range(self.start_round, cfg.engine.rounds + 1):
                if self.run_round(rnd, comm) is None or self._stop:
                    break
            self._finish_pending()
            status = "FINISHED"
        except KeyboardInterrupt:
            status = "KILLED"
            raise
        except BaseException as exc:
            self.result.error = error_text(exc)
            raise
        finally:
            if status != "FINISHED" and self._pending is not None:
                try:  # the last finished round still gets its row
                    self._finish_pending()
                except Exception:
                    log.exception("the last round's evaluation failed")
            self.result.status = status
            failed: list[Exception] = []
            for cb in self.callbacks:
                try:
                    cb.on_run_end(self, status)
                except Exception as exc:  # a failing callback must not hide the run's own error
                    failed.append(exc)
                    name = type(cb).__name__
                    log.info("callback %s failed at the end of the run", name, exc_info=True)
            if self.executor is not None:
                self.executor.close()
            if failed and status == "FINISHED":  # the run's only error: the caller's to report
                raise failed[0]
        return self.result

    def restore(self, restored: Restored) -> None:
        """Continue after a checkpoint: server and client states, history, next round."""
        assert self.executor is not None
        self.executor.load_server_state(restored.server_state)
        for cid, state in restored.client_states():
            self.executor.load_client_state(cid, state)
        self.result.history = list(restored.history)
        self.start_round = restored.round + 1
        if restored.history:
            self.wall_before = float(restored.history[-1].get("time/wall_s", 0.0))
        log.info("resumed after round %d", restored.round)

    def _sample(self, rnd: int) -> list[int]:
        """This round's clients. A held-out domain's clients (`Federation.eval_only`) are never
        drawn: the draw is over the others, by position, at most all of them."""
        cfg, held = self.cfg, set(self.federation.eval_only)
        pool = [c for c in range(cfg.data.num_clients) if c not in held]
        k = min(self.per_round, len(pool))
        return [pool[i] for i in sample_clients(cfg.seed, rnd, len(pool), k, cfg.engine.sampling)]

    def run_round(self, rnd: int, comm: dict[str, float]) -> dict[str, float] | None:
        """One round. Its row reaches the history and the callbacks once its server evaluation
        is in: with `engine.pipeline_eval` that is after the next round's clients have trained
        (the last round's: after the run, scored by the server while the clients evaluate).
        Returns None when a callback stopped the run meanwhile (this round is then dropped)."""
        assert self.executor is not None
        cfg, ex = self.cfg, self.executor
        start = time.perf_counter()
        evaluate = rnd % cfg.engine.eval_every == 0 or rnd == cfg.engine.rounds
        clients = self._sample(rnd)
        archs = sorted({self.archs[c] for c in clients})
        sizes, payloads = ex.broadcast(rnd, archs)
        received = clients  # who downloaded the broadcast
        devices, plan = self.devices, None
        if devices is not None:  # who trains, by availability, dropout and deadline
            plan = devices.plan(rnd, clients, sizes)
            received = sorted([*plan.participants, *plan.dropped_out, *plan.stragglers])
            clients = plan.participants
        bytes_down = float(sum(sizes[self.archs[c]] for c in received))
        if plan is not None and len(clients) < cfg.engine.min_replies:
            comm["down"] += bytes_down
            return self._skip_round(rnd, plan, comm, start)
        fit_start = time.perf_counter()
        deployed = cfg.eval.protocol == "deployed"
        client_rows, replies = ex.fit(rnd, clients, payloads, evaluate and not deployed)
        fit_end = time.perf_counter()
        if devices is not None and plan is not None and devices.cfg.work == "measured":
            devices.measured(plan, {r["client"]: r["train_s"] for r in client_rows}, sizes)
        if self._finish_pending():
            return None
        server_start = time.perf_counter()
        if cfg.engine.pipeline_eval:
            final = rnd == cfg.engine.rounds
            server_metrics, handle = ex.server_step_deferred(rnd, replies, evaluate, final)
        else:
            server_metrics, handle = ex.server_step(rnd, replies, evaluate), None
        server_s = time.perf_counter() - server_start
        eval_rows: list[ClientMetrics] | None = None
        eval_start = time.perf_counter()
        for fitted in client_rows:  # their states were replaced: their last scores are stale
            self._scores.pop(fitted["client"], None)
        if evaluate and deployed:
            # the broadcast after round rnd's server step: what every client would act on now
            _, new_payloads = ex.broadcast(rnd, sorted(set(self.archs)))
            eval_rows = self._evaluate_deployed(rnd, new_payloads, client_rows)
        eval_s = time.perf_counter() - eval_start
        comm["up"] += server_metrics.get("comm/bytes_up", 0.0)
        comm["down"] += bytes_down
        row: dict[str, float] = {"round": float(rnd), "clients": float(len(client_rows))}
        row.update(summarize_clients(client_rows, eval_rows, self.federation.client_domain))
        row.update(server_metrics)
        if rnd == self.start_round:
            row.update(self.clock.metrics())
        row["comm/bytes_down"] = bytes_down
        row.update({"comm/bytes_up_total": comm["up"], "comm/bytes_down_total": comm["down"]})
        row.update(
            {"time/fit_s": fit_end - fit_start, "time/server_s": server_s, "time/eval_s": eval_s}
        )
        if plan is not None:
            row.update(self._clock_metrics(rnd, plan, comm))
        row["time/round_s"] = time.perf_counter() - start
        view = ex.snapshot() if handle is not None else ex
        scored = eval_rows if eval_rows is not None else [r for r in client_rows if "acc" in r]
        self._pending = _Pending(rnd, row, handle, view, clients, client_rows, scored)
        if handle is None:
            self._finish_pending()
        return row

    def _clock_metrics(self, rnd: int, plan: RoundPlan, comm: dict[str, float]) -> dict[str, float]:
        """The virtual clock's row entries (`rayfl.engine.devices`)."""
        assert self.devices is not None
        comm["virtual"] = comm.get("virtual", 0.0) + plan.round_s
        out = {**self.devices.round_metrics(plan), "time/virtual_s": comm["virtual"]}
        if rnd == self.start_round:
            out.update(self.devices.describe())
        return out

    def _skip_round(
        self, rnd: int, plan: RoundPlan, comm: dict[str, float], start: float
    ) -> dict[str, float] | None:
        """A round in which fewer devices than `engine.min_replies` can train: no training and no
        server step; the clock still runs (the server waited)."""
        assert self.executor is not None
        n, least = len(plan.participants), self.cfg.engine.min_replies
        log.warning(
            "round %d: %d devices can train (engine.min_replies=%d): skipped", rnd, n, least
        )
        if self._finish_pending():
            return None
        row = {"round": float(rnd), "clients": 0.0, "devices/skipped": 1.0}
        row.update(self._clock_metrics(rnd, plan, comm))
        row.update({"comm/bytes_up_total": comm["up"], "comm/bytes_down_total": comm["down"]})
        row["time/round_s"] = time.perf_counter() - start
        self._pending = _Pending(rnd, row, None, self.executor, [], [], [])
        self._finish_pending()
        return row

    def _evaluate_deployed(
        self, rnd: int, payloads: dict[str, Any], fitted: list[ClientMetrics]
    ) -> list[ClientMetrics]:
        """Every registered client's score of its deployed model given `payloads`.

        A client that has not trained since its last score keeps that score when its deployed
        model cannot have changed either: its algorithm deploys the client's own model, or its
        architecture's payload is the same as then (`Client.deployed_model` depends on the state
        and the payload, not on the round). Where the payload does not matter, the diagnostics
        against it (e.g. `pfedes/proxy_acc`) are kept only for the round's participants
        (`fitted`), so that the numbers never depend on what this process scored before."""
        assert self.executor is not None
        uses_payload = self.spec.algo.client.deploys_payload(self.spec.params)
        if uses_payload:
            digests = self.executor.payload_digests(payloads)
        else:  # one key for every payload: only a new state makes a client's score stale
            digests = dict.fromkeys(payloads, "")
        kept = [row for digest, row in self._scores.values() if digests[row["arch"]] == digest]
        known = {row["client"] for row in kept}
        todo = [c for c in range(self.cfg.data.num_clients) if c not in known]
        fresh = self.executor.evaluate(rnd, todo, payloads) if todo else []
        log.info("round %d: %d clients scored, %d kept their score", rnd, len(fresh), len(kept))
        participants = {row["client"] for row in fitted}
        rows = list(kept)
        for row in fresh:
            score = row if uses_payload else {k: v for k, v in row.items() if k in SCORE_KEYS}
            self._scores[row["client"]] = (digests[row["arch"]], score)
            rows.append(row if row["client"] in participants else score)
        return rows

    def _finish_pending(self) -> bool:
        """Complete the waiting round's row with its server evaluation, record it and run the
        callbacks on it, in round order. Returns whether a callback asked to stop."""
        pending, self._pending = self._pending, None
        if pending is None:
            return self._stop
        assert self.executor is not None
        wait = time.perf_counter()
        pending.row.update(self.executor.collect_eval(pending.handle))
        if pending.handle is not None:
            pending.row["time/eval_wait_s"] = time.perf_counter() - wait
        pending.row.update(reached_targets(self.cfg.eval.targets, pending.row, self.result.history))
        pending.row["time/wall_s"] = self.wall_s()
        self.result.history.append(pending.row)
        self.result.clients += per_client_rows(self.federation, pending.round, pending.scored)
        self.last_clients = pending.clients
        for cb in self.callbacks:
            cb.on_round_state(
                self.cfg, pending.round, pending.clients, pending.view, self.result.history
            )
        for cb in self.callbacks:
            cb.on_round_end(self, pending.round, pending.row)
        self._stop = any(cb.should_stop for cb in self.callbacks)
        return self._stop


@dataclass
class _Pending:
    """A finished round whose row waits for its server evaluation."""

    round: int
    row: dict[str, float]
    handle: Any  # Executor.collect_eval's handle; None: the row is complete
    view: Any  # the states at the end of the round (Executor.snapshot), for checkpoints
    clients: list[int]
    client_rows: list[ClientMetrics]
    scored: list[ClientMetrics]  # the round's evaluation rows (none when it did not evaluate)
