"""Standalone training: every client trains its own model on its own data, nothing is shared.

The lower bound every personalized method must beat.

Shares: nothing.
Keeps local: the whole model.
Server: nothing.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from rayfl.algorithms.base import Algorithm, Client, ClientContext, NoParams, Server
from rayfl.models import build_model
from rayfl.registry import ALGORITHMS


class LocalClient(Client):
    def __init__(self, ctx: ClientContext, params: NoParams) -> None:
        super().__init__(ctx, params)
        self.model = build_model(ctx.arch, ctx.in_shape, ctx.num_classes)
        self.persistent = {"model": self.model}

    def training_step(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(self.model(x), y)


ALGORITHMS.add(
    "local",
    Algorithm(
        "local", NoParams, LocalClient, Server, summary="standalone local training, no sharing"
    ),
)
