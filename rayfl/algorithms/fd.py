"""FD (federated distillation): Jeong et al., "Communication-Efficient On-Device Machine Learning:
Federated Distillation and Augmentation under Non-IID Private Data" (NeurIPS 2018 workshop;
arXiv 1811.11479).

Clients share no weights, only their per-class mean logits; the regularizer pulls each sample's
logits towards the federation's mean logits of its label:

    loss = CE(f(x), y) + gamma * MSE(f(x), G[y])

(`MSE` over the classes whose global entry exists; unseen classes contribute zero, see
`rayfl.algorithms.protos.masked_class_mse`).

What rayfl does and why: the paper distils with a KL on the global logits and excludes each
client's own contribution. HtFLlib (`clientfd.py`, run as `FedDistill -lam 1` in `total.sh`)
takes a cross-entropy against the averaged logits of the label: at commit ca3e29a the raw
averaged logits are the target "distribution" (`CE(output, global_logits[y])`, no softmax),
which is unbounded below and diverges; a later commit (17f851e) softmaxes them first. rayfl
uses neither: it regresses the logits onto the label's global mean logits with the squared
distance (bounded, and a function of the averaged logits alone), with the plain global average
(the client's own contribution included). `gamma` defaults to 1, HtFLlib's `-lam 1` for FD.

Logits have `num_classes` entries whatever the architecture, so unlike prototype methods FD does
*not* need a common feature size (`needs_common_feature_dim=False`): any family whose models
share the label space works.

Shares: per-class mean logits and per-class sample counts up (`C x (C + 1)` floats); the global
per-class logits down.
Keeps local: the whole model (the personalized model).
Server: per-class average of the clients' mean logits, weighted by their class counts.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from rayfl.algorithms import protos
from rayfl.algorithms.base import (
    Algorithm,
    ClientContext,
    Payload,
    RoundContext,
    ServerContext,
)
from rayfl.errors import require
from rayfl.registry import ALGORITHMS


@dataclass(frozen=True)
class FDParams:
    gamma: float = 1.0  # weight of the distance to the global class logits (HtFLlib -lam 1)

    def __post_init__(self) -> None:
        require(self.gamma >= 0, "algorithm.gamma", f"must be >= 0 (got {self.gamma})")


class FDClient(protos.ClassStatsClient[FDParams]):
    deployed_uses_payload = False  # deploys its local model

    def __init__(self, ctx: ClientContext, params: FDParams) -> None:
        super().__init__(ctx, params)
        self.global_logits = torch.zeros(ctx.num_classes, ctx.num_classes)
        self.global_counts = torch.zeros(ctx.num_classes)

    def receive(self, payload: Payload, rnd: RoundContext) -> None:
        self.global_logits, self.global_counts = protos.stats_tensors(payload, self.ctx.device)

    def training_step(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        logits = self.model(x)
        loss = F.cross_entropy(logits, y)
        if self.params.gamma > 0:
            loss = loss + self.params.gamma * protos.masked_class_mse(
                logits, y, self.global_logits, self.global_counts
            )
        return loss

    def statistic(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(x)  # the logits


class FDServer(protos.ClassTableServer[FDParams]):
    prefix = "fd"

    def __init__(self, ctx: ServerContext, params: FDParams) -> None:
        super().__init__(ctx, params, dim=ctx.num_classes)


ALGORITHMS.add(
    "fd",
    Algorithm(
        "fd",
        FDParams,
        FDClient,
        FDServer,
        summary="federated distillation of per-class mean logits",
    ),
)
