"""LG-FedAvg: Liang et al., "Think Locally, Act Globally: Federated Learning with Local and Global
Representations" (NeurIPS 2019 workshop; arXiv 2001.01523).

Each client learns its own representation (any architecture) and the federation learns one
global head on top of it; this needs every architecture to emit features of one size.

Shares: the head (`model.head`, a linear map feature_dim -> classes), both ways.
Keeps local: the feature extractor (`model.encoder`); the personalized model is the extractor
with the head as fine-tuned this round.
Server: sample-weighted average of the client heads.
"""

from __future__ import annotations

import copy

from rayfl.algorithms.base import (
    ALGORITHMS,
    Algorithm,
    AveragingServer,
    ModelClient,
    NoParams,
    Payload,
    RoundContext,
    ServerContext,
    load_numpy,
    to_numpy,
)
from rayfl.models import build_model


class LGFedAvgClient(ModelClient[NoParams]):
    def receive(self, payload: Payload, rnd: RoundContext) -> None:
        # The global head replaces the local one; the private extractor is left as it was.
        load_numpy(self.model.head, payload)

    def upload(self) -> Payload:
        return to_numpy(self.model.head.state_dict())


class LGFedAvgServer(AveragingServer[NoParams]):
    name = "head"
    scored = False  # a head alone classifies no images

    def __init__(self, ctx: ServerContext, params: NoParams) -> None:
        # Any architecture's head has the shape every client's has (needs_common_feature_dim).
        model = build_model(ctx.architectures[0], ctx.in_shape, ctx.num_classes)
        super().__init__(ctx, params, copy.deepcopy(model.head))


ALGORITHMS.add(
    "lg_fedavg",
    Algorithm(
        "lg_fedavg",
        NoParams,
        LGFedAvgClient,
        LGFedAvgServer,
        needs_common_feature_dim=True,
        summary="global head averaged over private feature extractors",
    ),
)
