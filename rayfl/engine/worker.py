"""Client execution: `ClientRunner` trains batches of virtual clients; `ClientWorker` is its Ray actor.

A runner caches one client half per architecture and loads each client's state into it in place,
so hundreds of clients cost memory for their state, not a process each. The serial executor
uses the same runner in-process, which is why both executors give the same numbers.
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping, Sequence
from typing import Any

import ray
import torch

from rayfl.algorithms.base import Client, Payload, Reply, payload_nbytes
from rayfl.data.federated import Federation
from rayfl.engine.spec import INIT, TRAIN, RunSpec, derive_seed, resolve_device, torch_threads
from rayfl.engine.training import ArrayBatches, LocalTrainer, evaluate_client

ClientMetrics = dict[str, Any]


class ClientRunner:
    """Trains and evaluates virtual clients one after another on one device."""

    def __init__(self, spec: RunSpec, federation: Federation, device: torch.device) -> None:
        self.spec = spec
        self.federation = federation
        self.device = device
        self._algo = spec.algo
        self._clients: dict[str, Client] = {}
        self._public: ArrayBatches | None = None

    def _public_batches(self) -> ArrayBatches:
        if self._public is None:
            self._public = ArrayBatches(
                self.federation.dataset, self.federation.public, self.device
            )
        return self._public

    def _fresh_client(self, arch: str, client_id: int) -> Client:
        # A client's initial weights depend only on (seed, client id), never on which worker
        # builds it; the new instance then serves as this worker's cache for the architecture.
        torch.manual_seed(derive_seed(self.spec.seed, client_id, INIT))
        client = self._algo.client(self.spec.client_context(arch, self.device), self.spec.params)
        for module in client.modules():
            module.to(self.device)
        self._clients[arch] = client
        return client

    def fit(
        self,
        round_idx: int,
        client_ids: Sequence[int],
        payloads: Mapping[str, Payload],
        states: Sequence[Payload | None],
        evaluate: bool,
    ) -> tuple[list[ClientMetrics], list[Reply], list[Payload]]:
        """Run one round for `client_ids`: load state, receive, fit, upload, evaluate, save state."""
        with torch_threads(self.spec.num_threads):
            return self._fit(round_idx, client_ids, payloads, states, evaluate)

    def _fit(
        self,
        round_idx: int,
        client_ids: Sequence[int],
        payloads: Mapping[str, Payload],
        states: Sequence[Payload | None],
        evaluate: bool,
    ) -> tuple[list[ClientMetrics], list[Reply], list[Payload]]:
        metrics: list[ClientMetrics] = []
        replies: list[Reply] = []
        new_states: list[Payload] = []
        for cid, state in zip(client_ids, states):
            arch = self.spec.archs[cid]
            if state is None:
                client = self._fresh_client(arch, cid)
            else:
                client = self._clients.get(arch) or self._fresh_client(arch, cid)
                client.load_state_dict(state)
            seed = derive_seed(self.spec.seed, round_idx, cid, TRAIN)
            torch.manual_seed(seed)
            client.receive(payloads.get(arch, {}), self.spec.round_context(round_idx))
            split = self.federation.clients[cid]
            trainer = LocalTrainer(
                self.federation.dataset,
                split.train,
                split.test,
                self.spec.train,
                self.device,
                torch.Generator().manual_seed(seed),
                public=self._public_batches,
            )
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
            metrics.append(row)
            replies.append(Reply(cid, arch, trainer.num_samples, payload, dict(train_metrics)))
            new_states.append(client.state_dict())
        return metrics, replies, new_states


class ClientWorker:
    """Ray actor around a `ClientRunner`; created with `ray.remote(ClientWorker).options(...)`."""

    def __init__(self, spec: RunSpec, federation: Federation) -> None:
        # `federation` arrives resolved from the object store: its numpy arrays are zero-copy.
        self.runner = ClientRunner(spec, federation, resolve_device(spec.device, ray.get_gpu_ids()))

    def fit(
        self,
        round_idx: int,
        client_ids: list[int],
        payload_refs: dict[str, Any],
        evaluate: bool,
        *states: Payload | None,
    ) -> tuple[Any, ...]:
        keys = list(payload_refs)
        values = ray.get([payload_refs[k] for k in keys]) if keys else []
        metrics, replies, new_states = self.runner.fit(
            round_idx, client_ids, dict(zip(keys, values)), list(states), evaluate
        )
        return (metrics, replies, *new_states)

    def info(self) -> dict[str, Any]:
        ctx = ray.get_runtime_context()
        return {
            "pid": os.getpid(),
            "node_id": ctx.get_node_id(),
            "gpu_ids": [str(g) for g in ray.get_gpu_ids()],
            "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
            "device": str(self.runner.device),
            "torch_threads": torch.get_num_threads(),
        }
