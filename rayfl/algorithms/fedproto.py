"""FedProto: Tan et al., "FedProto: Federated Prototype Learning across Heterogeneous Clients"
(AAAI 2022; arXiv 2105.00243).

Clients share class prototypes (mean representations) instead of weights; each client's
representation of a sample is pulled towards the federation's prototype of its label:

    loss = CE(f(x), y) + lambda * MSE(features(x), P[y])

`MSE` is a mean over the batch and the feature dimensions, as `nn.MSELoss` in the official code
(classes without a global prototype contribute zero, see `protos.masked_class_mse`). Prototypes
are compared across architectures, so every model must have the same feature size.

Shares: per-class mean features and per-class counts up (`C x (D + 1)` floats); the global
prototypes down.
Keeps local: the whole model. It deploys its own head (`predict: head`) or, as in the paper,
the class of the nearest global prototype (`predict: prototype`).
Server: per-class average of the client prototypes, weighted by their class counts.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from rayfl.algorithms import protos
from rayfl.algorithms.base import (
    Algorithm,
    ClientContext,
    Payload,
    RoundContext,
    ServerContext,
)
from rayfl.errors import require
from rayfl.models import build_model
from rayfl.registry import ALGORITHMS


@dataclass(frozen=True)
class FedProtoParams:
    lam: float = 1.0  # weight of the prototype distance (the paper's lambda; official default 1)
    # what the client deploys: its own head, or the nearest global prototype (the paper's and
    # the official code's inference; HtFLlib scores FedProto this way)
    predict: Literal["head", "prototype"] = "head"

    def __post_init__(self) -> None:
        require(self.lam >= 0, "algorithm.lam", f"must be >= 0 (got {self.lam})")


class FedProtoClient(protos.ClassStatsClient[FedProtoParams]):
    def __init__(self, ctx: ClientContext, params: FedProtoParams) -> None:
        super().__init__(ctx, params)
        self.global_protos = torch.zeros(ctx.num_classes, self.model.feature_dim)
        self.global_counts = torch.zeros(ctx.num_classes)

    def receive(self, payload: Payload, rnd: RoundContext) -> None:
        self.global_protos, self.global_counts = protos.stats_tensors(payload, self.ctx.device)

    def training_step(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        features = self.model.features(x)
        loss = F.cross_entropy(self.model.head(features), y)
        if self.params.lam > 0:
            loss = loss + self.params.lam * protos.masked_class_mse(
                features, y, self.global_protos, self.global_counts
            )
        return loss

    def eval_model(self) -> nn.Module:
        if self.params.predict == "prototype":
            return protos.NearestPrototype(self.model, self.global_protos, self.global_counts)
        return self.model


class FedProtoServer(protos.ClassTableServer[FedProtoParams]):
    prefix = "fedproto"

    def __init__(self, ctx: ServerContext, params: FedProtoParams) -> None:
        dim = build_model(ctx.architectures[0], ctx.in_shape, ctx.num_classes).feature_dim
        super().__init__(ctx, params, dim=dim)


ALGORITHMS.add(
    "fedproto",
    Algorithm(
        "fedproto",
        FedProtoParams,
        FedProtoClient,
        FedProtoServer,
        needs_common_feature_dim=True,
        summary="federated prototype learning (per-class mean features)",
    ),
)
