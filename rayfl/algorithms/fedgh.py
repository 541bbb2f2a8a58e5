"""FedGH: Yi et al., "FedGH: Heterogeneous Federated Learning with Generalized Global Header"
(ACM Multimedia 2023; arXiv 2303.13137).

Each client puts the received global header in place of its own head and trains its local model
with CE; it then uploads one prototype (mean representation) per class it holds. The server
trains the global header, a linear map `feature_dim -> classes`, on those (prototype, class)
pairs with its own SGD optimizer (`server_lr`, `server_epochs`, the round's batch size) and sends
it down.

By default the received header is trained along with the extractor (`freeze_header: false`, the
paper's algorithm and the HtFLlib code); the personalized model is the local extractor with that
header. With `freeze_header: true` only the extractor trains and the personalized model is
exactly the extractor plus the global header.

Shares: per-class prototypes and counts up; the global header down.
Keeps local: the feature extractor (and the locally tuned header copy).
Server: trains the global header on the uploaded prototypes (cross-entropy, plain SGD).
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from rayfl.algorithms import protos
from rayfl.algorithms.base import (
    ALGORITHMS,
    Algorithm,
    CheckedParams,
    Payload,
    Reply,
    RoundContext,
    Server,
    ServerContext,
    ServerData,
    TrainConfig,
    Trainer,
    load_numpy,
    to_numpy,
)
from rayfl.algorithms.groups import frozen
from rayfl.models import build_model
from rayfl.schema import setting


@dataclass(frozen=True)
class FedGHParams(CheckedParams):
    server_epochs: int = setting(100, "passes of the header's training over the round's prototypes")
    server_lr: float = setting(0.01, "the header's own SGD learning rate", gt=0)
    freeze_header: bool = setting(
        False, "true: clients train only the extractor under the global header"
    )


class FedGHClient(protos.ClassStatsClient[FedGHParams]):
    def receive(self, payload: Payload, rnd: RoundContext) -> None:
        load_numpy(self.model.head, payload)

    def train(self, trainer: Trainer) -> dict[str, float]:
        # A frozen header takes no gradient at all (so none accumulates on the cached instance).
        with frozen(*[self.model.head] if self.params.freeze_header else []):
            return trainer.run(self.training_step, [self.model])


def train_header(
    header: torch.nn.Module,
    data: ServerData,
    features: torch.Tensor,
    labels: torch.Tensor,
    epochs: int,
    lr: float,
    batch_size: int,
) -> float:
    """Train `header` on (prototype, class) pairs with CE and plain SGD through the engine's
    minibatch loop; returns the last epoch's loss.

    One call per epoch: plain SGD (no momentum, no weight decay) keeps no state between steps,
    so a fresh optimizer per epoch trains exactly as one would.
    """
    sgd = TrainConfig(lr=lr, momentum=0.0, weight_decay=0.0, optimizer="sgd")
    last = float("nan")
    for _ in range(epochs):
        out = data.run(
            lambda x, y: F.cross_entropy(header(x), y),
            [header],
            epochs=1,
            settings=sgd,
            data=(features, labels),
            batch_size=batch_size,
        )
        last = out["loss"]
    return last


class FedGHServer(Server[FedGHParams]):
    def __init__(self, ctx: ServerContext, params: FedGHParams) -> None:
        super().__init__(ctx, params)
        model = build_model(ctx.architectures[0], ctx.in_shape, ctx.num_classes)
        self.header = copy.deepcopy(model.head).to(ctx.device)
        self.pairs: tuple[np.ndarray, np.ndarray] | None = None

    def broadcast(self, arch: str, rnd: RoundContext) -> Payload:
        return to_numpy(self.header.state_dict())

    def aggregate(self, replies: Sequence[Reply], rnd: RoundContext) -> dict[str, float]:
        # Training waits for `update`, where the engine has seeded the server's randomness.
        self.pairs = protos.prototype_pairs([r.payload for r in replies])
        return {"fedgh/prototypes": float(len(self.pairs[1]))}

    def update(self, data: ServerData, rnd: RoundContext) -> dict[str, float]:
        if self.pairs is None or len(self.pairs[1]) == 0:
            return {}
        features = torch.as_tensor(self.pairs[0], device=self.ctx.device)
        labels = torch.as_tensor(self.pairs[1], device=self.ctx.device)
        self.pairs = None
        p = self.params
        loss = train_header(
            self.header,
            data,
            features,
            labels,
            p.server_epochs,
            p.server_lr,
            self.ctx.train.batch_size,
        )
        return {"fedgh/header_loss": loss} if p.server_epochs > 0 else {}

    def state_modules(self) -> dict[str, nn.Module]:
        return {"header": self.header}


ALGORITHMS.add(
    "fedgh",
    Algorithm(
        "fedgh",
        FedGHParams,
        FedGHClient,
        FedGHServer,
        needs_common_feature_dim=True,
        summary="global header trained by the server on uploaded class prototypes",
    ),
)
