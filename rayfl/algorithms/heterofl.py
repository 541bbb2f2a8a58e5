"""HeteroFL: Diao et al., "HeteroFL: Computation and Communication Efficient Federated Learning
for Heterogeneous Clients" (ICLR 2021).

Every client model is a width-scaled slice of one global model (family `resnet_widths`): a client
of width rate r holds the leading `round(c * r)` channels of every layer. Clients train their
slice with cross-entropy, using static batch norm (batch statistics, no running buffers) and the
scaler (activations divided by r in training) so that all widths stay comparable.

Shares: the client's slice of the global model (down), the trained slice (up).
Keeps local: nothing; the slice arrives fresh every round.
Server: every entry of the global model becomes the average over the clients whose slice holds
it (`weighting=uniform`, the paper's `1/M sum W_m`, or by sample count); entries nobody holds
keep their value. Differences from the official code (diaoenmao/HeteroFL-...-Heterogeneous-
Clients, `src/models/resnet.py`): its label-masked classifier (lines 152-155) is not
implemented; its ResNet is pre-activation (lines 44-50, 148) where `resnet_widths` is the CIFAR
ResNet-18 of the FedFD paper; it rounds channels up (`ceil(c * r)`, line 164) where rayfl rounds
to nearest; its scaler sits before each normalisation with rate width / global width (lines 45,
48, 165), rayfl's after each conv with the absolute width (the same for a full-width global
model). docs/algorithms.md has the table. FedFD and FedDF reuse both halves
(`rayfl.algorithms.fedfd`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal, TypeVar

import numpy as np
import torch
from torch import nn

from rayfl.algorithms.base import (
    ALGORITHMS,
    Algorithm,
    CheckedParams,
    ClientContext,
    ModelClient,
    Payload,
    Reply,
    RoundContext,
    Server,
    ServerContext,
    Trainer,
    load_numpy,
    reply_weights,
    to_numpy,
)
from rayfl.errors import ConfigError, require
from rayfl.models.base import SplitModel
from rayfl.models.resnet import ResNet18, resnet_width
from rayfl.models.slicing import aggregate_sliced, slice_state, state_shapes
from rayfl.schema import setting


def _is_width_arch(arch: str) -> bool:
    try:
        resnet_width(arch)
    except ConfigError:
        return False
    return True


@dataclass(frozen=True)
class HeteroFLParams(CheckedParams):
    """HeteroFL hyperparameters."""

    global_arch: str = setting(
        "resnet18",
        "the server's model; every client architecture must be a width-scaled ResNet-18 no wider than it (`resnet18` is width 1.0)",
    )
    static_bn: bool = setting(True, "batch norm without running statistics (HeteroFL's static BN)")
    scaler: bool = setting(
        True, "divide activations by the width rate during training (HeteroFL's scaler)"
    )
    weighting: Literal["uniform", "samples"] = setting(
        "uniform",
        "per-entry average over the clients holding the entry, `uniform` (the paper) or weighted by each client's sample count (`samples`)",
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        require(
            _is_width_arch(self.global_arch),
            "algorithm.global_arch",
            f"{self.global_arch!r} is not a width-scaled ResNet-18; use resnet18 or resnet18_w1..w10",
        )


# HeteroFL's halves serve FedFD too, with FedFD's larger params.
HP = TypeVar("HP", bound=HeteroFLParams)


def build_width_model(
    arch: str, in_shape: Sequence[int], num_classes: int, params: HeteroFLParams
) -> ResNet18:
    """The width-scaled ResNet-18 named `arch`, with HeteroFL's static BN and scaler per `params`
    (a ConfigError for an architecture outside `resnet_widths` or an input that is no image)."""
    check_width_family([arch], HeteroFLParams())
    if len(in_shape) != 3:
        raise ConfigError(
            f"model {arch!r} needs image inputs (C, H, W), got in_shape {tuple(in_shape)}; pick an image dataset"
        )
    return ResNet18(
        int(in_shape[0]),
        int(num_classes),
        resnet_width(arch),
        static_bn=params.static_bn,
        scaler=params.scaler,
    )


def check_width_family(archs: Sequence[str], params: HeteroFLParams) -> None:
    """Refuse client architectures that are not width slices of `params.global_arch`; cheap (no
    model is built), so the engine can call it before any data is loaded."""
    global_width = resnet_width(params.global_arch)
    for arch in archs:
        if not _is_width_arch(arch):
            raise ConfigError(
                f"model {arch!r}: width-sliced algorithms (heterofl, fedfd, feddf) need width-scaled "
                "ResNet-18 clients; use model.family=resnet_widths or model.architectures=[resnet18_w1, ...]"
            )
        if resnet_width(arch) > global_width:
            raise ConfigError(
                f"client model {arch!r} (width {resnet_width(arch):g}) is wider than algorithm.global_arch="
                f"{params.global_arch} (width {global_width:g}); use a wider global_arch (e.g. resnet18)"
            )


def _meta_model(arch: str, ctx: ServerContext, params: HeteroFLParams) -> ResNet18:
    # Shapes and feature sizes only: the meta device allocates nothing and draws no random numbers.
    with torch.device("meta"):
        return build_width_model(arch, ctx.in_shape, ctx.num_classes, params)


def _as_tensors(payload: Mapping[str, np.ndarray]) -> dict[str, torch.Tensor]:
    # np.array copies: payloads from Ray's object store are read-only.
    return {k: torch.from_numpy(np.array(v)) for k, v in payload.items()}


class HeteroFLClient(ModelClient[HP]):
    """Trains the received width slice of the global model with cross-entropy."""

    def __init__(self, ctx: ClientContext, params: HP) -> None:
        super().__init__(ctx, params)
        # The whole model is overwritten by the broadcast every round: no per-client state to store.
        self.persistent = {}

    def make_model(self) -> SplitModel:
        return build_width_model(
            self.ctx.arch, self.ctx.in_shape, self.ctx.num_classes, self.params
        )

    def receive(self, payload: Payload, rnd: RoundContext) -> None:
        load_numpy(self.model, payload)

    def fit(self, trainer: Trainer) -> dict[str, float]:
        return trainer.run(self.training_step, [self.model])

    def upload(self) -> Payload:
        return to_numpy(self.model.state_dict())

    def eval_model(self) -> nn.Module:
        return self.model


class HeteroFLServer(Server[HP]):
    """Holds the global model, slices it per width level and averages every entry over its holders."""

    def __init__(self, ctx: ServerContext, params: HP) -> None:
        super().__init__(ctx, params)
        self.model = build_width_model(
            params.global_arch, ctx.in_shape, ctx.num_classes, params
        ).to(ctx.device)
        check_width_family(ctx.architectures, params)
        self.shapes: dict[str, dict[str, torch.Size]] = {}
        self.feature_dims: dict[str, int] = {}
        for arch in ctx.architectures:
            meta = _meta_model(arch, ctx, params)
            self.shapes[arch] = state_shapes(meta.state_dict())
            self.feature_dims[arch] = meta.feature_dim

    def broadcast(self, arch: str, rnd: RoundContext) -> Payload:
        return to_numpy(slice_state(self.model.state_dict(), self.shapes[arch]))

    def aggregate(self, replies: Sequence[Reply], rnd: RoundContext) -> dict[str, float]:
        subs = [_as_tensors(r.payload) for r in replies]
        state = aggregate_sliced(
            self.model.state_dict(), subs, reply_weights(replies, self.params.weighting)
        )
        self.model.load_state_dict(state)
        return {}

    def eval_models(self) -> dict[str, nn.Module]:
        return {"global": self.model}


ALGORITHMS.add(
    "heterofl",
    Algorithm(
        "heterofl",
        HeteroFLParams,
        HeteroFLClient,
        HeteroFLServer,
        summary="width-sliced sub-models of one global model, per-entry averaging",
        check_archs=check_width_family,
    ),
)
