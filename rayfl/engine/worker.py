"""Client execution: `ClientRunner` trains batches of virtual clients; `ClientWorker` is its Ray
actor.

A runner caches one client half per architecture and loads each client's state into it in place,
so hundreds of clients cost memory for their state, not a process each. The serial executor
uses the same runner in-process, which is why both executors give the same numbers.
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import ray
import torch

from rayfl.algorithms import ALGORITHMS
from rayfl.algorithms.base import Client, Payload, Reply
from rayfl.algorithms.functional import payload_nbytes
from rayfl.data.federated import Federation
from rayfl.engine.spec import (
    RunSpec,
    keep_tensor_memory,
    resolve_device,
    seed_torch,
    torch_threads,
)
from rayfl.engine.training import ArrayBatches, LocalTrainer, evaluate_client
from rayfl.models.base import place
from rayfl.seeding import Purpose, seed_of, words

ClientMetrics = dict[str, Any]
BASELINE = "baseline/"  # prefix of the local-only shadow's keys in a client's state
# prefix of the no-federation control's keys in a client's state (eval.federation_control); its
# accuracy after its last local training is kept there too, under CONTROL_ACC
CONTROL = "control/"
CONTROL_ACC = CONTROL + "@acc"


class ClientRunner:
    """Trains and evaluates virtual clients one after another on one device."""

    def __init__(self, spec: RunSpec, federation: Federation, device: torch.device) -> None:
        keep_tensor_memory()  # for the process it trains in: an actor's, or the serial driver
        self.spec = spec
        self.federation = federation
        self.device = device
        self._algo = spec.algo
        # one cached instance per architecture of each kind: the run's clients, their
        # local-only shadows (eval.local_baseline), their no-federation controls
        self._cache: dict[str, dict[str, Client]] = {"clients": {}, "shadows": {}, "controls": {}}
        self._initial: dict[str, Payload] | None = None  # the first broadcast, per architecture
        self._public: ArrayBatches | None = None

    def _public_batches(self) -> ArrayBatches:
        if self._public is None:
            self._public = ArrayBatches(
                self.federation.dataset, self.federation.public, self.device
            )
        return self._public

    def _fresh_client(self, arch: str, client_id: int, kind: str = "clients") -> Client:
        # A client's initial weights depend only on (seed, client id), never on which worker
        # builds it; the new instance then serves as this worker's cached one of its `kind` for
        # the architecture (a shadow is `local`'s client; a control is built like the client).
        seed_torch(seed_of(words(Purpose.INIT, self.spec.seed, client=client_id)))
        context = self.spec.client_context(arch, self.device)
        if kind == "shadows":
            local = ALGORITHMS.get("local")
            client = local.client(context, local.params())
        else:
            client = self._algo.client(context, self.spec.params)
        self._cache[kind][arch] = client
        for module in client.modules():
            place(module, self.device)
        return client

    def _loaded(self, kind: str, cid: int, state: Payload | None) -> Client:
        """`cid`'s client half of `kind` with `state` loaded: a fresh one (the client's initial
        weights) without a state, else this worker's cached instance of its architecture."""
        arch = self.spec.archs[cid]
        if state is None:
            return self._fresh_client(arch, cid, kind)
        client = self._cache[kind].get(arch) or self._fresh_client(arch, cid, kind)
        client.load_state_dict(state)
        return client

    def _trainer(self, round_idx: int, cid: int, purpose: Purpose = Purpose.TRAIN) -> LocalTrainer:
        """The client's data with this round's seeded shuffling; also seeds torch's global RNG."""
        seed = seed_of(words(purpose, self.spec.seed, round_idx, cid))
        seed_torch(seed)
        split = self.federation.clients[cid]
        return LocalTrainer(
            self.federation.dataset,
            split.train,
            split.test,
            self.spec.train,
            self.device,
            torch.Generator().manual_seed(seed),
            public=self._public_batches,
            val_idx=split.val,
        )

    def evaluate(
        self,
        round_idx: int,
        client_ids: Sequence[int],
        payloads: Mapping[str, Payload],
        states: Sequence[Payload | None],
    ) -> list[ClientMetrics]:
        """Score each client's deployed model (`Client.deployed_model`) given `payloads`, the
        server's broadcast after round `round_idx`'s step, on its test split (and, with
        `eval.local_baseline`, its local-only shadow). States are read, never written back:
        evaluation leaves every client as it was."""
        rnd = self.spec.round_context(round_idx)
        with torch_threads(self.spec.num_threads):
            rows: list[ClientMetrics] = []
            for cid, state in zip(client_ids, states):
                arch = self.spec.archs[cid]
                client = self.client_for(cid, state)
                trainer = self._trainer(round_idx, cid, purpose=Purpose.EVAL)
                model = client.deployed_model(payloads.get(arch, {}), rnd)
                row: ClientMetrics = {"client": cid, "arch": arch}
                row.update(evaluate_client(client, trainer, model))
                if self.spec.local_baseline:
                    row["baseline_acc"] = evaluate_client(self._shadow_for(cid, state), trainer)[
                        "acc"
                    ]
                if self.spec.federation_control:
                    row["control_acc"] = self._control_score(cid, state, trainer)
                rows.append(row)
            return rows

    def fit(
        self,
        round_idx: int,
        client_ids: Sequence[int],
        payloads: Mapping[str, Payload],
        states: Sequence[Payload | None],
        evaluate: bool,
    ) -> tuple[list[ClientMetrics], list[Reply], list[Payload]]:
        """Run one round for `client_ids`: load state, receive, fit, upload, evaluate, save state."""
        metrics: list[ClientMetrics] = []
        replies: list[Reply] = []
        new_states: list[Payload] = []
        with torch_threads(self.spec.num_threads):
            for cid, state in zip(client_ids, states):
                client = self.client_for(cid, state)
                row, reply, new_state = self.client_round(
                    client, cid, round_idx, payloads, evaluate, state=state
                )
                metrics.append(row)
                replies.append(reply)
                new_states.append(new_state)
        return metrics, replies, new_states

    def client_for(self, cid: int, state: Payload | None) -> Client:
        """The client half for `cid` with its state loaded: a fresh one for a new client, else
        the cached instance of its architecture."""
        return self._loaded("clients", cid, state)

    def client_round(
        self,
        client: Client,
        cid: int,
        round_idx: int,
        payloads: Mapping[str, Payload],
        evaluate: bool,
        state: Payload | None = None,
    ) -> tuple[ClientMetrics, Reply, Payload]:
        """One client's round: receive, fit, upload, evaluate, save state (`state`: the one it
        started from, for the local-only shadow)."""
        arch = self.spec.archs[cid]
        trainer = self._trainer(round_idx, cid)
        client.receive(payloads.get(arch, {}), self.spec.round_context(round_idx))
        start = time.perf_counter()
        train_metrics = client.fit(trainer)
        train_s = time.perf_counter() - start
        payload = client.upload()
        if self.spec.privacy is not None:  # clip / mask before anything leaves the client
            payload = self.spec.privacy.protect(
                payload, payloads.get(arch, {}), round_idx, cid, trainer.num_samples
            )
        row: ClientMetrics = {
            "client": cid,
            "arch": arch,
            "num_train": trainer.num_samples,
            "train_s": train_s,
            "bytes_up": payload_nbytes(payload),
            **{f"train/{k}": v for k, v in train_metrics.items()},
        }
        if evaluate:
            row.update(evaluate_client(client, trainer))
        new_state = client.state_dict()
        if self.spec.local_baseline:
            row["train_s"] += self._fit_baseline(round_idx, cid, state, new_state, row, evaluate)
        if self.spec.federation_control:
            row["train_s"] += self._fit_control(round_idx, cid, state, new_state, row, evaluate)
        return row, Reply(cid, arch, trainer.num_samples, payload, dict(train_metrics)), new_state

    def _shadow_for(self, cid: int, state: Payload | None) -> Client:
        """The client's local-only shadow with its part (`baseline/`) of the client's state."""
        return self._loaded("shadows", cid, _part(state, BASELINE) or None)

    def _fit_baseline(
        self,
        round_idx: int,
        cid: int,
        state: Payload | None,
        new_state: Payload,
        row: ClientMetrics,
        evaluate: bool,
    ) -> float:
        """Train the client's local-only shadow exactly as `algorithm.name=local` would (same
        initial weights, seeds and batches); its state travels in the client's own state under
        `baseline/`, and `row["baseline_acc"]` gets its accuracy. Returns the seconds it took."""
        shadow = self._shadow_for(cid, state)
        trainer = self._trainer(round_idx, cid)
        start = time.perf_counter()
        shadow.fit(trainer)
        seconds = time.perf_counter() - start
        if evaluate:
            row["baseline_acc"] = evaluate_client(shadow, trainer)["acc"]
        new_state.update({BASELINE + k: v for k, v in shadow.state_dict().items()})
        return seconds

    # -- the no-federation control (eval.federation_control) ------------------------------------
    def _initial_payload(self, arch: str) -> Payload:
        """The server's first broadcast for `arch`: a fresh server half built exactly as the
        run's (`ServerRunner`: same seed), asked once per worker. It never changes, so the
        control's client receives the federation's untrained starting point every round."""
        if self._initial is None:
            seed_torch(seed_of(words(Purpose.SERVER, self.spec.seed)))
            server = self._algo.server(self.spec.server_context(self.device), self.spec.params)
            rnd = self.spec.round_context(1)
            self._initial = {a: server.broadcast(a, rnd) for a in sorted(set(self.spec.archs))}
        return self._initial[arch]

    def _control_for(self, cid: int, state: Payload | None) -> Client:
        """The client's no-federation control with its part (`control/`) of the client's state."""
        own = _part(state, CONTROL)
        own.pop(CONTROL_ACC[len(CONTROL) :], None)  # its score, kept beside its state
        return self._loaded("controls", cid, own or None)

    def _control_score(self, cid: int, state: Payload | None, trainer: LocalTrainer) -> float:
        """The control's accuracy: the one after its last local training, kept in the state;
        a client never trained scores what it would deploy given the first broadcast."""
        if state is not None and CONTROL_ACC in state:
            return float(state[CONTROL_ACC])
        control = self._control_for(cid, state)
        initial = self._initial_payload(self.spec.archs[cid])
        model = control.deployed_model(initial, self.spec.round_context(1))
        return float(evaluate_client(control, trainer, model)["acc"])

    def _fit_control(
        self,
        round_idx: int,
        cid: int,
        state: Payload | None,
        new_state: Payload,
        row: ClientMetrics,
        evaluate: bool,
    ) -> float:
        """Run the algorithm's own client cut off from the federation: the same initial weights,
        seeds and batches, but every round it receives the server's first (untrained) broadcast
        instead of this round's, and its upload goes nowhere. What the algorithm gains over it
        is what the federation brought, not what its local regularizers do. Its state travels in
        the client's own state under `control/`; its accuracy right after training is kept there
        and reported as `row["control_acc"]`. Returns the seconds it took."""
        arch = self.spec.archs[cid]
        initial = self._initial_payload(arch)
        control = self._control_for(cid, state)
        trainer = self._trainer(round_idx, cid)
        start = time.perf_counter()
        control.receive(initial, self.spec.round_context(round_idx))
        control.fit_cut_off(trainer)
        seconds = time.perf_counter() - start
        acc = evaluate_client(control, trainer)["acc"]
        if evaluate:
            row["control_acc"] = acc
        new_state.update({CONTROL + k: v for k, v in control.state_dict().items()})
        new_state[CONTROL_ACC] = np.array(acc, dtype=np.float64)
        return seconds


def _part(state: Payload | None, prefix: str) -> Payload:
    """The entries of `state` under `prefix`, with the prefix taken off."""
    return {k[len(prefix) :]: v for k, v in (state or {}).items() if k.startswith(prefix)}


class ClientWorker:
    """Ray actor around a `ClientRunner`; created with `ray.remote(ClientWorker).options(...)`
    (`rayfl.engine.pool.start_workers`).

    Every call carries `setup`, `[ObjectRef of the RunSpec, ObjectRef of the Federation]` (in a
    list, so Ray does not resolve them for each call): an actor that Ray restarted after a
    crash (`max_restarts`) comes back without its runner and builds it from them before it
    re-runs the call (`max_task_retries`). The client states travel with the call, so the
    re-run gives the same numbers."""

    runner: ClientRunner

    def setup(self, setup: list[Any]) -> None:
        """Build the runner from `setup` unless it is built."""
        if getattr(self, "runner", None) is not None:
            return
        spec, federation = ray.get(setup)
        # `federation` arrives resolved from the object store: its numpy arrays are zero-copy.
        self.runner = ClientRunner(spec, federation, resolve_device(spec.device, ray.get_gpu_ids()))

    def fit(
        self,
        setup: list[Any],
        round_idx: int,
        client_ids: list[int],
        payload_refs: dict[str, Any],
        evaluate: bool,
        *states: Payload | None,
    ) -> tuple[Any, ...]:
        self.setup(setup)
        keys = list(payload_refs)
        values = ray.get([payload_refs[k] for k in keys]) if keys else []
        metrics, replies, new_states = self.runner.fit(
            round_idx, client_ids, dict(zip(keys, values)), list(states), evaluate
        )
        return (metrics, replies, *new_states)

    def evaluate(
        self,
        setup: list[Any],
        round_idx: int,
        client_ids: list[int],
        payload_refs: dict[str, Any],
        *states: Payload | None,
    ) -> list[ClientMetrics]:
        self.setup(setup)
        keys = list(payload_refs)
        values = ray.get([payload_refs[k] for k in keys]) if keys else []
        return self.runner.evaluate(round_idx, client_ids, dict(zip(keys, values)), list(states))

    def info(self, setup: list[Any]) -> dict[str, Any]:
        self.setup(setup)
        ctx = ray.get_runtime_context()
        return {
            "pid": os.getpid(),
            "node_id": ctx.get_node_id(),
            "gpu_ids": [str(g) for g in ray.get_gpu_ids()],
            "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
            "device": str(self.runner.device),
            "torch_threads": torch.get_num_threads(),
            "resources": dict(ctx.get_assigned_resources()),
            # peak GPU memory this worker's training allocated (0 on the CPU)
            "cuda_max_memory_mb": (
                torch.cuda.max_memory_allocated(self.runner.device) / 2**20
                if self.runner.device.type == "cuda"
                else 0.0
            ),
        }
