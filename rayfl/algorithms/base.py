"""The two halves of a federated algorithm and what passes between them.

An algorithm is one module holding a `Client` half and a `Server` half plus a frozen `Params`
dataclass, registered as an `Algorithm`. The engine owns the round loop, the minibatch loop,
sampling, placement and evaluation; the halves say *what* is trained and shared through the
hooks below. Nothing here imports Ray, MLflow or the engine.

Payloads are `{name: np.ndarray}` dicts: numpy arrays come back from Ray's object store
zero-copy, and their byte size is the communication cost.
"""

from __future__ import annotations

import dataclasses
import typing
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, Generic, Protocol, TypeVar

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from rayfl.algorithms.functional import (  # the payload helpers, exported here too
    load_numpy,
    to_numpy,
    unprefixed,
    weighted_average,
)
from rayfl.errors import require
from rayfl.models import build_model
from rayfl.models.base import SplitModel
from rayfl.registry import Registry
from rayfl.schema import Range, TrainConfig, range_of

Payload = dict[str, np.ndarray]
Batch = tuple[torch.Tensor, torch.Tensor]
P = TypeVar("P")  # an algorithm's frozen hyperparameter dataclass


@dataclass(frozen=True)
class RoundContext:
    """Where the federation is in its schedule, handed to every round hook of both halves.

    `index` runs from 1 to `total` (`engine.rounds`), so a schedule is a plain function of it,
    e.g. a proximal weight decaying with the round: `mu * (1 - (rnd.index - 1) / rnd.total)`.
    """

    index: int
    total: int

    @property
    def fraction(self) -> float:
        """How far the run is after this round, in (0, 1]: `index / total`."""
        return self.index / self.total


@dataclass(frozen=True)
class ClientContext:
    """Everything a client half may know about where it runs."""

    arch: str
    in_shape: tuple[int, ...]
    num_classes: int
    device: torch.device
    train: TrainConfig
    family_archs: tuple[str, ...] = ()


@dataclass(frozen=True)
class ServerContext:
    """Everything a server half may know: the architectures in the federation and its device."""

    architectures: tuple[str, ...]
    arch_counts: Mapping[str, int]
    in_shape: tuple[int, ...]
    num_classes: int
    device: torch.device
    train: TrainConfig
    seed: int
    num_clients: int


@dataclass
class Reply:
    """What one client sends back after a round."""

    client_id: int
    arch: str
    num_samples: int
    payload: Payload
    metrics: dict[str, float] = field(default_factory=dict)


class Trainer(Protocol):
    """The engine's minibatch loop over one client's data (implemented in `rayfl.engine.training`)."""

    num_samples: int
    device: torch.device

    def run(
        self,
        step: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
        modules: Sequence[nn.Module],
        epochs: int | None = None,
        params: Iterable[nn.Parameter] | None = None,
        lr: float | None = None,
        split: str = "train",
        targets: torch.Tensor | None = None,
        module_lrs: Sequence[float | None] | None = None,
    ) -> dict[str, float]:
        """Train `modules` (set to train mode) for `epochs` over shuffled batches of `split` with
        `step(x, y)`'s loss. With `targets`, the first `len(targets)` samples of the split are
        used, each paired with its row of `targets` as `y` (distillation to per-sample scores).
        `module_lrs`, aligned with `modules`, gives a module its own learning rate (None: `lr`).
        With `train.grad_clip`, each module's gradient is clipped on its own."""
        ...

    def batches(self, split: str = "train", shuffle: bool = False) -> Iterator[Batch]:
        """Batches of this client's `train` or `test` split, or the labelled `public` split shared
        by every client (FedMD's public set), on the device."""
        ...


class ServerData(Protocol):
    """Data the server may use and the engine's minibatch loop over it (implemented by the engine)."""

    device: torch.device

    def run(
        self,
        step: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
        modules: Sequence[nn.Module],
        epochs: int | None = None,
        steps: int | None = None,
        params: Iterable[nn.Parameter] | None = None,
        settings: TrainConfig | None = None,
        split: str = "public",
        data: tuple[torch.Tensor, torch.Tensor] | None = None,
        batch_size: int | None = None,
    ) -> dict[str, float]:
        """`Trainer.run` for the server: train `modules` with `step(x, y)`'s loss over shuffled
        minibatches of `split` (or of the tensors `data = (x, y)`, e.g. uploaded prototypes) for
        `epochs` passes or exactly `steps` minibatches. The optimizer is `settings`' (default:
        the run's `train:`); shuffling uses the server's round-seeded torch RNG."""
        ...

    def batches(
        self, split: str = "public", batch_size: int | None = None, shuffle: bool = False
    ) -> Iterator[Batch]:
        """Batches of the `public` (distillation) split or the server `test` set."""
        ...

    def num_samples(self, split: str = "public") -> int: ...


class Client(Generic[P]):
    """Client half. Subclasses build their modules in `__init__` and register the persistent ones.

    One instance per architecture is cached on a worker and reused for every virtual client of
    that architecture: the engine loads a client's state in place, calls `receive`, `fit`,
    `upload`, and stores `state_dict()` again. Whatever is not in `persistent` is transient.
    """

    # Whether the model `deployed_model` returns depends on the received payload. False (the
    # client deploys its own local model, e.g. pFedES, FML, FedKD, FD): under the `deployed`
    # protocol a client that has not trained since its last score keeps that score whatever the
    # server broadcasts. True (the safe default: FedAvg's global model, LG-FedAvg's head...):
    # it keeps it only while its architecture's payload is unchanged.
    deployed_uses_payload: ClassVar[bool] = True

    @classmethod
    def deploys_payload(cls, params: P) -> bool:
        """`deployed_uses_payload` of the class `cls(ctx, params)` builds (a factory such as
        `PFedESClient` answers for the variant `params` choose)."""
        return cls.deployed_uses_payload

    def __init__(self, ctx: ClientContext, params: P) -> None:
        self.ctx = ctx
        self.params: P = params
        self.persistent: dict[str, nn.Module] = {}

    # -- exchange -------------------------------------------------------------------------------
    def receive(self, payload: Payload, rnd: RoundContext) -> None:
        """Take the server's broadcast for round `rnd` (default: nothing is received)."""

    def upload(self) -> Payload:
        """What travels to the server after local training (default: nothing)."""
        return {}

    # -- training -------------------------------------------------------------------------------
    def fit(self, trainer: Trainer) -> dict[str, float]:
        """Local training. Default: the engine's loop over `training_step` for all persistent modules."""
        return trainer.run(self.training_step, list(self.persistent.values()))

    def fit_cut_off(self, trainer: Trainer) -> dict[str, float]:
        """`fit` for the no-federation control (`eval.federation_control`), whose upload goes
        nowhere: it may skip training that serves only the upload, never change what is kept."""
        return self.fit(trainer)

    def training_step(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    # -- evaluation -----------------------------------------------------------------------------
    def eval_model(self) -> nn.Module:
        """The personalized model the engine scores on the client's test split."""
        return self.persistent["model"]

    def eval_metrics(self, x: torch.Tensor, y: torch.Tensor) -> dict[str, float]:
        """Extra per-batch metrics (means over the batch), averaged by the engine."""
        return {}

    def deployed_model(self, payload: Payload, rnd: RoundContext) -> nn.Module:
        """The model this client would deploy now, given the server's latest broadcast.

        Used by the `deployed` evaluation protocol: after the server step, the engine loads the
        client's stored state, calls this with the new broadcast, scores the result on the
        client's test split and discards the loaded state (it is never stored back). Default:
        take the payload as at the start of a round (`receive`), then `eval_model()`; e.g.
        LG-FedAvg and FedGH deploy their own extractor with the received global head. `rnd` is
        the round whose server step produced `payload`.
        """
        self.receive(payload, rnd)
        return self.eval_model()

    # -- state ----------------------------------------------------------------------------------
    def state_dict(self) -> Payload:
        return {
            f"{name}.{k}": v.detach().cpu().numpy().copy()
            for name, module in self.persistent.items()
            for k, v in module.state_dict().items()
        }

    def load_state_dict(self, state: Payload) -> None:
        for name, module in self.persistent.items():
            load_numpy(module, unprefixed(state, f"{name}."))

    def modules(self) -> list[nn.Module]:
        """Every module this half owns (the engine moves them to the device and re-initializes them)."""
        return [m for m in vars(self).values() if isinstance(m, nn.Module)]


class ModelClient(Client[P]):
    """A client whose personal model is one `SplitModel` of its architecture (`self.model`),
    trained with cross-entropy unless a subclass says otherwise."""

    def __init__(self, ctx: ClientContext, params: P) -> None:
        super().__init__(ctx, params)
        self.model = self.make_model()
        self.persistent = {"model": self.model}

    def make_model(self) -> SplitModel:
        """The personal model (default: the registered architecture `ctx.arch`)."""
        return build_model(self.ctx.arch, self.ctx.in_shape, self.ctx.num_classes)

    def training_step(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(self.model(x), y)


class Server(Generic[P]):
    """Server half: what goes down, how replies are combined, and any server-side training."""

    # How `aggregate` depends on the uploads when it is a function of their SUM, which is all
    # that secure aggregation and DP-FedAvg let through (`rayfl.privacy`): "weighted_mean"
    # (sample-weighted average of array payloads) or "class_means" (per-class tables averaged
    # by count). None: the server needs each upload on its own, and privacy refuses it.
    sum_form: ClassVar[str | None] = None
    # Attributes outside any module that are part of the state: arrays, dicts of them, or None.
    state_attrs: ClassVar[tuple[str, ...]] = ()

    def __init__(self, ctx: ServerContext, params: P) -> None:
        self.ctx = ctx
        self.params: P = params

    def broadcast(self, arch: str, rnd: RoundContext) -> Payload:
        """The payload for clients of architecture `arch` in round `rnd` (default: nothing)."""
        return {}

    def aggregate(self, replies: Sequence[Reply], rnd: RoundContext) -> dict[str, float]:
        """Combine the round's valid replies, sorted by client id (default: nothing to combine)."""
        return {}

    def update(self, data: ServerData, rnd: RoundContext) -> dict[str, float]:
        """Server-side training after aggregation (e.g. distillation). Default: none."""
        return {}

    def eval_models(self) -> dict[str, nn.Module]:
        """Server models the engine scores on the server test set, as `<name>/acc`."""
        return {}

    def state_modules(self) -> dict[str, nn.Module]:
        """Modules that make up the server's state for checkpoints (default: the scored ones)."""
        return self.eval_models()

    def state_dict(self) -> dict[str, Any]:
        state = {name: to_numpy(m.state_dict()) for name, m in self.state_modules().items()}
        return {**state, **{a: _copied(getattr(self, a)) for a in self.state_attrs}}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        for name, module in self.state_modules().items():
            load_numpy(module, state[name])
        for a in self.state_attrs:
            setattr(self, a, _copied(state[a]))


def _copied(value: Any) -> Any:
    """A copy of a server's state attribute: an array, a dict of arrays, or None."""
    if isinstance(value, Mapping):
        return {k: np.array(v) for k, v in value.items()}
    return None if value is None else np.array(value)


class AveragingServer(Server[P]):
    """Broadcasts one shared module and replaces it by the sample-weighted average of the clients'
    uploads of it: FedAvg's model, FML's meme, LG-FedAvg's head. `name` keys its state and, when
    `scored`, its accuracy (`<name>/acc`)."""

    name = "global"
    scored = True
    sum_form = "weighted_mean"

    def __init__(self, ctx: ServerContext, params: P, shared: nn.Module) -> None:
        super().__init__(ctx, params)
        self.shared = shared.to(ctx.device)

    def broadcast(self, arch: str, rnd: RoundContext) -> Payload:
        return to_numpy(self.shared.state_dict())

    def aggregate(self, replies: Sequence[Reply], rnd: RoundContext) -> dict[str, float]:
        avg = weighted_average([r.payload for r in replies], [r.num_samples for r in replies])
        load_numpy(self.shared, avg)
        return {}

    def eval_models(self) -> dict[str, nn.Module]:
        return {self.name: self.shared} if self.scored else {}

    def state_modules(self) -> dict[str, nn.Module]:
        return {self.name: self.shared}


@dataclass(frozen=True)
class Algorithm(Generic[P]):
    """A registered algorithm: its halves, hyperparameters and what it needs of the federation.

    Generic over its hyperparameter type `P`: both halves receive a `P` as `self.params`, so a
    type checker sees `self.params.mu` and catches a misspelt field.
    """

    name: str
    params: type[P]
    client: type[Client[P]]
    server: type[Server[P]]
    needs_homogeneous: bool = False  # one architecture for every client (fedavg, fedprox)
    needs_common_feature_dim: bool = False  # shares heads or prototypes (lg_fedavg, fedgh...)
    needs_public: bool = False  # uses the held-out public split (fedmd, feddf, fedfd)
    summary: str = ""
    # Extra check of the clients' architectures against the params (raises ConfigError); cheap,
    # it builds no model, so `rayfl validate` can run it before any data is loaded.
    check_archs: Callable[[Sequence[str], P], None] | None = None


ALGORITHMS: Registry[Algorithm[Any]] = Registry("algorithm", group="rayfl.algorithms")


@dataclass(frozen=True)
class NoParams:
    """For algorithms without hyperparameters of their own."""


class CheckedParams:
    """Base of an algorithm's frozen Params dataclass: `check_params` runs when they are built
    (a subclass with checks of its own calls `super().__post_init__()`)."""

    def __post_init__(self) -> None:
        check_params(self)


def check_params(params: Any) -> None:
    """What loading a config checks of `algorithm.*` keys, for Params built in code too (see
    `CheckedParams`): every number >= 0 and within the range its `setting` declares, every
    `Literal` one of its choices."""
    hints = typing.get_type_hints(type(params))
    for f in dataclasses.fields(params):
        value, key = getattr(params, f.name), f"algorithm.{f.name}"
        choices = [c for t in (hints[f.name], *typing.get_args(hints[f.name])) for c in _literal(t)]
        if choices and value is not None:
            require(value in choices, key, f"must be one of {', '.join(choices)} (got {value!r})")
        if isinstance(value, int | float) and not isinstance(value, bool):
            rng = range_of(f) or Range(lo=0)
            require(rng.contains(value), key, f"{rng.describe()} (got {value})")


def _literal(tp: Any) -> tuple[str, ...]:
    return typing.get_args(tp) if typing.get_origin(tp) is typing.Literal else ()


def reply_weights(replies: Sequence[Reply], weighting: str) -> list[float]:
    """Aggregation weights of the replies: 1 each (`uniform`) or their training samples."""
    return [1.0 if weighting == "uniform" else float(r.num_samples) for r in replies]
