"""Sharing within architecture groups: the common base of the personalization staples (FedPer,
FedRep, FedBABU, FedRoD, FedBN, Ditto, APFL, FedALA).

Each of these methods shares one declared part of a model (the whole model, the feature
extractor, everything but the BatchNorm layers) and averages it over the clients. In a
federation of several architectures a part of one architecture cannot be averaged with another's,
so the server keeps one model per architecture and averages each group's uploads separately
(`functional.grouped_average`): clients of one architecture share what the method shares, and
nothing crosses architectures. This grouping is rayfl's extension; with one architecture it is
the published method.

Both halves declare the part they share by name (`PARTS`: a function `model -> {state key:
tensor}`), so the server broadcasts and averages exactly the entries the clients load and upload.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import ClassVar

import numpy as np
import torch
from torch import nn

from rayfl.algorithms.base import (
    ClientContext,
    ModelClient,
    P,
    Payload,
    Reply,
    RoundContext,
    Server,
    ServerContext,
    load_numpy,
    to_numpy,
)
from rayfl.algorithms.functional import grouped_average
from rayfl.models import build_model

Part = Callable[[nn.Module], dict[str, torch.Tensor]]


def whole(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every entry of the model's state (FedAvg's share)."""
    return dict(model.state_dict())


def extractor(model: nn.Module) -> dict[str, torch.Tensor]:
    """The feature extractor of a `SplitModel` (`encoder.*`): FedPer's, FedRep's, FedBABU's share."""
    return {k: v for k, v in model.state_dict().items() if k.startswith("encoder.")}


def without_batchnorm(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every entry but those of BatchNorm layers (weights, biases, running statistics): FedBN's."""
    local = {
        f"{name}.{key}" if name else key
        for name, module in model.named_modules()
        if isinstance(module, nn.modules.batchnorm._BatchNorm)
        for key in module.state_dict()
    }
    return {k: v for k, v in model.state_dict().items() if k not in local}


PARTS: dict[str, Part] = {"whole": whole, "extractor": extractor, "no_batchnorm": without_batchnorm}


def load_part(model: nn.Module, payload: Mapping[str, np.ndarray]) -> None:
    """Load a part (a subset of the model's entries) in place; the other entries are kept."""
    unknown = sorted(set(payload) - set(model.state_dict()))
    if unknown:
        raise KeyError(f"the payload holds entries the model lacks: {unknown[:3]}")
    load_numpy(model, payload, strict=False)


@contextmanager
def frozen(*modules: nn.Module) -> Iterator[None]:
    """Within the block, the parameters of `modules` take no gradient (so the engine's loop
    neither computes nor steps them); their previous flags come back after it."""
    params = [p for m in modules for p in m.parameters()]
    flags = [p.requires_grad for p in params]
    for p in params:
        p.requires_grad_(False)
    try:
        yield
    finally:
        for p, flag in zip(params, flags):
            p.requires_grad_(flag)


class Flag(nn.Module):
    """A yes/no kept in a client's state, such as whether the client has trained yet."""

    value: torch.Tensor

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("value", torch.zeros((), dtype=torch.int64))

    def is_set(self) -> bool:
        return bool(self.value)

    def set(self) -> None:
        self.value.fill_(1)


class GroupClient(ModelClient[P]):
    """A client that loads the received part into `shared_model()` and uploads that part of it
    (default: its personal model `self.model`, as FedPer, FedRep and FedBN do)."""

    part: ClassVar[str] = "whole"  # a key of PARTS: what is loaded and uploaded

    def shared_model(self) -> nn.Module:
        return self.model

    def receive(self, payload: Payload, rnd: RoundContext) -> None:
        load_part(self.shared_model(), payload)

    def upload(self) -> Payload:
        return to_numpy(PARTS[self.part](self.shared_model()))


class GlobalCopyClient(GroupClient[P]):
    """A group client with two models of its architecture: the personal `self.model` it keeps,
    and `self.global_model`, a transient copy that takes the broadcast, trains and is uploaded
    (Ditto, APFL, FedBABU)."""

    def __init__(self, ctx: ClientContext, params: P) -> None:
        super().__init__(ctx, params)
        self.global_model = copy.deepcopy(self.model)

    def shared_model(self) -> nn.Module:
        return self.global_model


class GroupServer(Server[P]):
    """One model per architecture, built at its initialization; clients of an architecture get
    `down` of that model and their uploads of `part` are sample-weighted averaged into it.

    `scored`: the server models classify on their own (the shared part is the whole model, or
    FedBABU's body with its fixed head) and are scored as `global/acc` (one architecture) or
    `global_<arch>/acc`.
    """

    part: ClassVar[str] = "whole"  # a key of PARTS: what the clients upload and get averaged
    down: ClassVar[str | None] = None  # what is broadcast (None: `part`)
    scored: ClassVar[bool] = True
    # The privacy hook combines all uploads into one, across groups: not this server's sum.
    sum_form = None

    def __init__(self, ctx: ServerContext, params: P) -> None:
        super().__init__(ctx, params)
        self.models = {
            arch: build_model(arch, ctx.in_shape, ctx.num_classes).to(ctx.device)
            for arch in ctx.architectures
        }

    def broadcast(self, arch: str, rnd: RoundContext) -> Payload:
        return to_numpy(PARTS[self.down or self.part](self.models[arch]))

    def aggregate(self, replies: Sequence[Reply], rnd: RoundContext) -> dict[str, float]:
        groups = grouped_average(
            [r.payload for r in replies],
            [r.num_samples for r in replies],
            [r.arch for r in replies],
        )
        for arch, avg in groups.items():
            load_part(self.models[arch], avg)
        return {}

    def eval_models(self) -> dict[str, nn.Module]:
        if not self.scored:
            return {}
        if len(self.models) == 1:
            return {"global": next(iter(self.models.values()))}
        return {f"global_{arch}": m for arch, m in self.models.items()}

    def state_modules(self) -> dict[str, nn.Module]:
        return {f"model_{arch}": m for arch, m in self.models.items()}
