"""The server half's runner: broadcast, reply validation, aggregation, server update, evaluation.

`ServerRunner` is used in-process by the serial executor and by the Ray executor when the server
runs in the driver (`engine.server_in`), and wrapped by the `ServerActor` Ray actor (with its own
CPU/GPU share) otherwise.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np
import ray
import torch
from torch import nn

from rayfl.algorithms.base import Batch, Payload, Reply
from rayfl.algorithms.functional import payload_nbytes
from rayfl.data.federated import Federation
from rayfl.engine.spec import (
    RunSpec,
    keep_tensor_memory,
    resolve_device,
    seed_torch,
    torch_threads,
)
from rayfl.engine.training import (
    ArrayBatches,
    Step,
    eval_batch_size,
    fit_tensors,
    score,
    stat_batches,
)
from rayfl.errors import UserError
from rayfl.models.base import place
from rayfl.models.sbn import batch_independent
from rayfl.schema import TrainConfig
from rayfl.seeding import Purpose, seed_of, server_data_words, words

log = logging.getLogger(__name__)


PRIVACY_STATE = "rayfl/privacy"  # the privacy hook's entry in the server's checkpointed state


class RoundFailed(UserError):
    """Too few valid replies for a round."""


class EngineServerData:
    """`rayfl.algorithms.base.ServerData`: the public split and the server test set; for scoring
    only, every client's validation split (`val`) and, for batch-norm statistics, every client's
    training split (`stat_batches`)."""

    def __init__(self, federation: Federation, device: torch.device, settings: TrainConfig):
        self.device = device
        self.settings = settings
        self._federation = federation
        size = eval_batch_size(settings, device)
        self._sizes = {"public": settings.batch_size, "test": size, "val": size}
        self.has_val = federation.has_val
        self._cache: dict[str, ArrayBatches] = {}
        self.generator = torch.Generator()

    def _data(self, split: str) -> ArrayBatches:
        if split not in self._cache:
            fed = self._federation
            if split == "public":
                self._cache[split] = ArrayBatches(fed.dataset, fed.public, self.device)
            elif split == "test":
                self._cache[split] = ArrayBatches(fed.dataset, None, self.device, test=True)
            elif split in ("clients", "val"):
                part = "train" if split == "clients" else "val"
                union = np.sort(np.concatenate([getattr(c, part) for c in fed.clients]))
                self._cache[split] = ArrayBatches(fed.dataset, union, self.device)
            else:
                raise ValueError(f"unknown server split {split!r}")
        return self._cache[split]

    def run(
        self,
        step: Step,
        modules: Sequence[nn.Module],
        epochs: int | None = None,
        steps: int | None = None,
        params: Iterable[nn.Parameter] | None = None,
        settings: TrainConfig | None = None,
        split: str = "public",
        data: tuple[torch.Tensor, torch.Tensor] | None = None,
        batch_size: int | None = None,
    ) -> dict[str, float]:
        if data is None:
            arrays = self._data(split)
            data = (arrays.x, arrays.y)
        # generator None: the global torch RNG, which the runner seeds before every server update
        return fit_tensors(
            step,
            modules,
            *data,
            settings or self.settings,
            epochs=epochs,
            steps=steps,
            params=params,
            batch_size=batch_size,
        )

    def stat_batches(self) -> Iterator[torch.Tensor]:
        """The clients' training inputs, for a server model's batch-norm statistics
        (`rayfl.models.sbn`): HeteroFL's sBN, where the server queries the clients for them."""
        return stat_batches(self._data("clients"), self.settings.batch_size)

    def num_samples(self, split: str = "public") -> int:
        if split == "public":
            return len(self._federation.public)
        return len(self._federation.dataset.y_test)

    def batches(
        self, split: str = "public", batch_size: int | None = None, shuffle: bool = False
    ) -> Iterator[Batch]:
        size = batch_size or self._sizes[split]
        return self._data(split).iterate(size, self.generator if shuffle else None)


def is_finite(payload: Any) -> bool:
    for v in payload.values():
        if (
            isinstance(v, np.ndarray)
            and np.issubdtype(v.dtype, np.floating)
            and not np.isfinite(v).all()
        ):
            return False
        if isinstance(v, dict) and not is_finite(v):
            return False
    return True


class ServerRunner:
    def __init__(self, spec: RunSpec, federation: Federation, device: torch.device) -> None:
        keep_tensor_memory()  # for the process it runs in: an actor's or the driver
        self.spec = spec
        self.device = device
        seed_torch(seed_of(words(Purpose.SERVER, spec.seed)))
        with torch_threads(spec.server_threads):
            self.server = spec.algo.server(spec.server_context(device), spec.params)
        self._sent: dict[str, Payload] = {}
        self.data = EngineServerData(federation, device, spec.train)

    def broadcast(
        self, round_idx: int, archs: Sequence[str]
    ) -> tuple[dict[str, int], list[Payload]]:
        rnd = self.spec.round_context(round_idx)
        payloads = [self.server.broadcast(a, rnd) for a in archs]
        self._sent = dict(zip(archs, payloads))  # the privacy hook decodes against it
        return {a: payload_nbytes(p) for a, p in zip(archs, payloads)}, payloads

    def step(
        self, round_idx: int, reply_lists: Sequence[Sequence[Reply]], evaluate: bool
    ) -> dict[str, float]:
        """Aggregate the round's replies (in client-id order), run the server update, evaluate."""
        with torch_threads(self.spec.server_threads):
            return self._step(round_idx, reply_lists, evaluate)

    def _step(
        self, round_idx: int, reply_lists: Sequence[Sequence[Reply]], evaluate: bool
    ) -> dict[str, float]:
        replies = sorted((r for batch in reply_lists for r in batch), key=lambda r: r.client_id)
        valid = []
        for r in replies:
            if is_finite(r.payload) and r.num_samples > 0:
                valid.append(r)
            else:
                log.warning(
                    "round %d: rejected a non-finite or empty reply from client %d",
                    round_idx,
                    r.client_id,
                )
        min_replies = self.spec.engine.min_replies
        if len(valid) < min_replies:
            raise RoundFailed(
                f"round {round_idx}: only {len(valid)} valid replies, engine.min_replies={min_replies}; "
                "lower train.lr or engine.min_replies"
            )
        metrics: dict[str, float] = {
            "comm/bytes_up": float(sum(payload_nbytes(r.payload) for r in replies)),
            "server/rejected": float(len(replies) - len(valid)),
        }
        if self.spec.privacy is not None:  # unmask / noise the sum: the algorithm sees only it
            valid, privacy_metrics = self.spec.privacy.combine(valid, round_idx, self._sent)
            metrics.update(privacy_metrics)
        rnd = self.spec.round_context(round_idx)
        metrics.update(self.server.aggregate(valid, rnd))
        seed_torch(seed_of(words(Purpose.SERVER, self.spec.seed, round_idx)))
        self.data.generator.manual_seed(seed_of(server_data_words(self.spec.seed, round_idx)))
        metrics.update(self.server.update(self.data, rnd))
        if evaluate:
            metrics.update(self.score(self._scored_copies()))
        return metrics

    def score(self, models: Mapping[str, nn.Module]) -> dict[str, float]:
        """`<name>/acc` of each server model on the server test set, with the step's threads
        (`step`'s own evaluation, or later: same numbers)."""
        with torch_threads(self.spec.server_threads):
            return score_models(models, self.data)

    def step_deferred(
        self, round_idx: int, reply_lists: Sequence[Sequence[Reply]], evaluate: bool
    ) -> tuple[dict[str, float], dict[str, nn.Module]]:
        """The step without its evaluation, and copies (on the CPU) of the models it would have
        scored: whoever scores them later gets the numbers `step` would have returned."""
        metrics = self.step(round_idx, reply_lists, evaluate=False)
        return metrics, self._scored_copies() if evaluate else {}

    def _scored_copies(self) -> dict[str, nn.Module]:
        """Copies (on the CPU) of the models the step scores, for `step` itself and for whoever
        scores them later: scoring places a model in its fastest layout (`score_models`), and
        the server's own models must keep theirs (a changed layout changes the order of later
        sums, and so the numbers)."""
        return {name: copy.deepcopy(m).to("cpu") for name, m in self.server.eval_models().items()}

    def state_dict(self) -> dict[str, Any]:
        state = self.server.state_dict()
        if self.spec.privacy is not None:  # the DP noise's secret, so that a resume is exact
            state = {**state, PRIVACY_STATE: self.spec.privacy.state_dict()}
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        state = dict(state)
        privacy = state.pop(PRIVACY_STATE, None)
        if privacy is not None and self.spec.privacy is not None:
            self.spec.privacy.load_state_dict(privacy)
        self.server.load_state_dict(state)


def score_models(models: Mapping[str, nn.Module], data: EngineServerData) -> dict[str, float]:
    """`<name>/acc` and `<name>/loss` of each model on the server test set, and `<name>/val_acc`
    and `<name>/val_loss` on the clients' validation splits pooled when they have them (in eval
    mode, batch norm made batch-independent as for the clients, under inference mode). The
    models are moved to the data's device in its fastest layout (`place`): pass copies."""
    out = {}
    for name, model in models.items():
        place(model, data.device)
        # the splits' tensors are cached: made outside inference mode
        splits = {"": data.batches("test")}
        if data.has_val:
            splits["val_"] = data.batches("val")
        with batch_independent(model, data.stat_batches):
            for prefix, batches in splits.items():
                scored = score(model, batches)
                out[f"{name}/{prefix}acc"] = scored["acc"]
                out[f"{name}/{prefix}loss"] = scored["loss"]
    return out


class ServerEvaluator:
    """Ray actor that scores the server's models on the server test set while the next round's
    clients train (`engine.pipeline_eval`): evaluation feeds no broadcast, so it need not hold
    up the round. Same data, batch size and threads as the server: same numbers."""

    def __init__(self, spec: RunSpec, federation: Federation) -> None:
        keep_tensor_memory()
        self.spec = spec
        gpus = ray.get_gpu_ids()
        device = resolve_device("cpu" if spec.device == "cpu" or not gpus else "auto", gpus)
        self.data = EngineServerData(federation, device, spec.train)

    def score(self, models: dict[str, nn.Module]) -> dict[str, float]:
        with torch_threads(self.spec.server_threads):
            return score_models(models, self.data)


class ServerActor:
    """Ray actor around a `ServerRunner`, reserving `engine.server_resources`."""

    runner: ServerRunner

    def __init__(self, spec: RunSpec | None = None, federation: Federation | None = None) -> None:
        if spec is not None and federation is not None:  # else `setup`, once the data is put
            self.setup(spec, federation)

    def setup(self, spec: RunSpec, federation: Federation) -> None:
        self.runner = ServerRunner(spec, federation, resolve_device(spec.device, ray.get_gpu_ids()))

    def broadcast(self, round_idx: int, archs: list[str]) -> tuple[Any, ...]:
        sizes, payloads = self.runner.broadcast(round_idx, archs)
        return (sizes, *payloads)

    def step_deferred(
        self, round_idx: int, evaluate: bool, *reply_lists: list[Reply]
    ) -> tuple[dict[str, float], dict[str, Any], dict[str, nn.Module]]:
        """`step_and_state` without the evaluation, plus the models to score (num_returns=3)."""
        metrics, models = self.runner.step_deferred(round_idx, reply_lists, evaluate)
        return metrics, self.runner.state_dict(), models

    def step_and_state(
        self, round_idx: int, evaluate: bool, *reply_lists: list[Reply]
    ) -> tuple[dict[str, float], dict[str, Any]]:
        """The step's metrics and the server state after it, returned together (call with
        `num_returns=2`): the driver owns the state object, which outlives this actor."""
        metrics = self.runner.step(round_idx, reply_lists, evaluate)
        return metrics, self.runner.state_dict()

    def score(self, models: dict[str, nn.Module]) -> dict[str, float]:
        """Scores `step_deferred`'s models (the last round's: the server has nothing else to do
        while the clients evaluate). Same data and threads as `step`: same numbers."""
        return self.runner.score(models)

    def state_dict(self) -> dict[str, Any]:
        return self.runner.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.runner.load_state_dict(state)

    def device(self) -> str:
        return str(self.runner.device)
