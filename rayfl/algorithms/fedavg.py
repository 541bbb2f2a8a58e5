"""FedAvg: McMahan et al., "Communication-Efficient Learning of Deep Networks from Decentralized
Data" (AISTATS 2017).

Shares: the whole model (homogeneous families only).
Keeps local: nothing between rounds but the fine-tuned copy scored as the personalized model.
Server: sample-weighted average of the client models.
"""

from __future__ import annotations

from rayfl.algorithms.base import (
    ALGORITHMS,
    Algorithm,
    AveragingServer,
    ModelClient,
    NoParams,
    P,
    Payload,
    RoundContext,
    ServerContext,
    load_numpy,
    to_numpy,
)
from rayfl.models import build_model


class FedAvgClient(ModelClient[P]):
    def receive(self, payload: Payload, rnd: RoundContext) -> None:
        load_numpy(self.model, payload)

    def upload(self) -> Payload:
        return to_numpy(self.model.state_dict())


class FedAvgServer(AveragingServer[P]):
    def __init__(self, ctx: ServerContext, params: P) -> None:
        super().__init__(
            ctx, params, build_model(ctx.architectures[0], ctx.in_shape, ctx.num_classes)
        )


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
