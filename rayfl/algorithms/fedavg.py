"""FedAvg: McMahan et al., "Communication-Efficient Learning of Deep Networks from Decentralized
Data" (AISTATS 2017).

Shares: the whole model (homogeneous families only).
Keeps local: nothing between rounds but the fine-tuned copy scored as the personalized model.
Server: sample-weighted average of the client models.
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn

from rayfl.algorithms import functional as fn
from rayfl.algorithms.base import (
    Algorithm,
    ModelClient,
    NoParams,
    Payload,
    Reply,
    Server,
    ServerContext,
    load_numpy,
    to_numpy,
)
from rayfl.models import build_model
from rayfl.registry import ALGORITHMS


class FedAvgClient(ModelClient):
    def receive(self, payload: Payload) -> None:
        load_numpy(self.model, payload)

    def upload(self) -> Payload:
        return to_numpy(self.model.state_dict())


class FedAvgServer(Server):
    def __init__(self, ctx: ServerContext, params: object) -> None:
        super().__init__(ctx, params)
        self.model = build_model(ctx.architectures[0], ctx.in_shape, ctx.num_classes).to(ctx.device)

    def broadcast(self, arch: str) -> Payload:
        return to_numpy(self.model.state_dict())

    def aggregate(self, replies: Sequence[Reply], round_idx: int) -> dict[str, float]:
        avg = fn.weighted_average([r.payload for r in replies], [r.num_samples for r in replies])
        load_numpy(self.model, avg)
        return {}

    def eval_models(self) -> dict[str, nn.Module]:
        return {"global": self.model}


ALGORITHMS.add(
    "fedavg",
    Algorithm(
        "fedavg",
        NoParams,
        FedAvgClient,
        FedAvgServer,
        needs_homogeneous=True,
        summary="whole-model weighted averaging (homogeneous families)",
    ),
)
