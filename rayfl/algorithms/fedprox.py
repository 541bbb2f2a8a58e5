"""FedProx: Li et al., "Federated Optimization in Heterogeneous Networks" (MLSys 2020; arXiv 1812.06127).

FedAvg plus a proximal term that keeps each local model near the global one it started from:
`loss = CE + mu/2 * ||w - w_global||^2` over the trainable parameters.

Shares: the whole model (homogeneous families only).
Keeps local: the fine-tuned copy scored as the personalized model (overwritten next round).
Server: sample-weighted average of the client models (FedAvg's server).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from rayfl.algorithms.base import (
    ALGORITHMS,
    Algorithm,
    CheckedParams,
    ClientContext,
    Payload,
    RoundContext,
)
from rayfl.algorithms.fedavg import FedAvgClient, FedAvgServer
from rayfl.schema import setting


@dataclass(frozen=True)
class FedProxParams(CheckedParams):
    mu: float = setting(
        0.01, "proximal weight; 0 is FedAvg (the paper tunes it in {0.001, 0.01, 0.1, 1})"
    )


def proximal_term(
    params: Sequence[nn.Parameter], anchors: Sequence[torch.Tensor], mu: float
) -> torch.Tensor:
    """`mu/2 * sum_i ||params_i - anchors_i||^2` (anchors are constants)."""
    total = sum(((p - a.detach()) ** 2).sum() for p, a in zip(params, anchors))
    return 0.5 * mu * torch.as_tensor(total)


class FedProxClient(FedAvgClient[FedProxParams]):
    def __init__(self, ctx: ClientContext, params: FedProxParams) -> None:
        super().__init__(ctx, params)
        self.anchors: list[torch.Tensor] = []

    def receive(self, payload: Payload, rnd: RoundContext) -> None:
        super().receive(payload, rnd)
        # The global weights of this round, frozen: the proximal term pulls towards them.
        self.anchors = [p.detach().clone() for p in self.model.parameters()]

    def training_step(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = F.cross_entropy(self.model(x), y)
        if self.params.mu > 0 and self.anchors:
            loss = loss + proximal_term(list(self.model.parameters()), self.anchors, self.params.mu)
        return loss


ALGORITHMS.add(
    "fedprox",
    Algorithm(
        "fedprox",
        FedProxParams,
        FedProxClient,
        FedAvgServer,
        needs_homogeneous=True,
        summary="FedAvg with a proximal term mu/2 ||w - w_global||^2 (homogeneous families)",
    ),
)
