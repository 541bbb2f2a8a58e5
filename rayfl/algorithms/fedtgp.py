"""FedTGP: Zhang et al., "FedTGP: Trainable Global Prototypes with Adaptive-Margin-Enhanced
Contrastive Learning for Data and Model Heterogeneity in Federated Learning" (AAAI 2024;
arXiv 2401.03230).

Clients train as in FedProto (`CE + lambda * MSE(features(x), P[y])`, `rayfl.algorithms.fedproto`)
and upload one prototype (mean representation) per class they hold. Instead of averaging them,
the server *trains* the global prototypes: a small generator maps each class id to a prototype,
`P_c = W_2 relu(W_1 e_c)` (an embedding `e_c`, a hidden layer, an output layer), and learns it
by adaptive-margin-enhanced contrastive learning (ACL) on every uploaded (prototype, class) pair:

    loss = CE(-(d + delta * onehot(y)), y),   d_c = || p - P_c ||_2

where the margin `delta = min(max_c gap_c, margin_threshold)`, and `gap_c` is the distance from
class c's average client prototype to the nearest other class's (classes without a neighbour
take the smallest gap). The margin keeps each global prototype at least as far from the other
classes' client prototypes as the clients' own prototypes are apart, so the prototypes stay
separable instead of shrinking towards each other as plain averages do.

Clients deploy the nearest global prototype (`predict: prototype`, the official code's
inference) or their own head (`predict: head`).

Shares: per-class mean features and counts up (`C x (D + 1)` floats); the C global prototypes down.
Keeps local: the whole model.
Server: the prototype generator, trained `server_epochs` epochs over the round's uploaded
prototypes with plain SGD (learning rate `server_lr`, default `train.lr`; minibatches of
`train.batch_size` pairs), as in HtFLlib's implementation.

Defaults are the official code's (TsingZ0/FedTGP `system/run_me.sh`: `-lam 10 -se 100 -mart 100`;
the generator's hidden width is the feature size, `server_hidden_dim = feature_dim`); docs/algorithms.md
tables every algorithm's defaults and their sources.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

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
)
from rayfl.algorithms.fedproto import FedProtoClient
from rayfl.models import build_model
from rayfl.schema import setting


@dataclass(frozen=True)
class FedTGPParams(CheckedParams):
    lam: float = setting(
        10.0,
        "weight of the distance to the global prototype: 10 as in the official FedTGP code (TsingZ0/FedTGP system/run_me.sh `-lam 10`; HtFLlib system/total.sh), whose client says it follows FedProto's lambda of 10 (clienttgp.py). A small lam (0.1) leaves FedTGP far below local training.",
    )
    predict: Literal["head", "prototype"] = setting(
        "prototype", "the paper's inference: nearest prototype"
    )
    collect: Literal["train", "after"] = setting(
        "after",
        "the official FedTGP client collects its prototypes after training, in eval mode (clienttgp.py `collect_protos`); `train`: during training, as FedProto's official code",
    )
    server_epochs: int = setting(
        100, "epochs of ACL over the uploaded prototypes per round (paper: S)"
    )
    margin_threshold: float = setting(100.0, "upper bound of the adaptive margin (paper: tau)")
    server_lr: float | None = setting(None, "generator's SGD learning rate (None: train.lr)", gt=0)
    hidden_dim: int | None = setting(
        None, "generator's hidden width (None: the feature size)", ge=1
    )


class FedTGPClient(FedProtoClient):  # FedTGPParams has FedProto's lam, predict and collect
    """FedProto's client: CE plus the distance to the received (trained) global prototypes."""

    def averaged_over_clients(self) -> bool:
        # The server trains on every uploaded (prototype, class) pair; the counts only say which
        # classes a client holds, so they travel as they are.
        return False


class PrototypeGenerator(nn.Module):
    """Class id -> global prototype: an embedding, one hidden ReLU layer, an output layer."""

    def __init__(self, num_classes: int, dim: int, hidden: int) -> None:
        super().__init__()
        self.embedding = nn.Embedding(num_classes, dim)
        self.hidden = nn.Linear(dim, hidden)
        self.out = nn.Linear(hidden, dim)

    def forward(self, classes: torch.Tensor) -> torch.Tensor:
        return self.out(F.relu(self.hidden(self.embedding(classes))))


def adaptive_margin(
    prototypes: np.ndarray, labels: np.ndarray, threshold: float
) -> tuple[float, np.ndarray]:
    """FedTGP's margin `min(max_c gap_c, threshold)` of the `(P, D)` uploaded `prototypes` of
    classes `labels`, and the gaps: `gaps[i]` is the distance from the i-th uploaded class's
    (sorted) mean prototype to the nearest other class's (with a single class: the threshold)."""
    classes = np.unique(labels)
    centers = np.stack([prototypes[labels == c].astype(np.float64).mean(0) for c in classes])
    if len(classes) < 2:
        return float(threshold), np.full(len(classes), float(threshold))
    dist = np.linalg.norm(centers[:, None, :] - centers[None, :, :], axis=-1)
    np.fill_diagonal(dist, np.inf)
    gaps = dist.min(1)
    return float(min(gaps.max(), threshold)), gaps


def acl_loss(
    prototypes: torch.Tensor, labels: torch.Tensor, global_protos: torch.Tensor, margin: float
) -> torch.Tensor:
    """Adaptive-margin-enhanced contrastive loss: `CE(-(d + margin * onehot(y)), y)` with
    `d[i, c] = ||prototypes[i] - global_protos[c]||_2`."""
    sq = (prototypes.unsqueeze(1) - global_protos.unsqueeze(0)).pow(2).sum(-1)
    dist = sq.clamp_min(1e-12).sqrt()  # the clamp keeps the gradient finite at distance zero
    dist = dist + margin * F.one_hot(labels, global_protos.shape[0]).to(dist.dtype)
    return F.cross_entropy(-dist, labels)


class FedTGPServer(Server[FedTGPParams]):
    state_attrs = ("table",)

    def __init__(self, ctx: ServerContext, params: FedTGPParams) -> None:
        super().__init__(ctx, params)
        dim = build_model(ctx.architectures[0], ctx.in_shape, ctx.num_classes).feature_dim
        self.generator = PrototypeGenerator(ctx.num_classes, dim, params.hidden_dim or dim).to(
            ctx.device
        )
        # before the first server update no prototype is known (count 0): clients train by CE
        self.table = protos.empty_class_stats(ctx.num_classes, dim)
        self.pairs: tuple[np.ndarray, np.ndarray] | None = None
        self.margin = 0.0

    def broadcast(self, arch: str, rnd: RoundContext) -> Payload:
        return dict(self.table)

    def aggregate(self, replies: Sequence[Reply], rnd: RoundContext) -> dict[str, float]:
        self.pairs = protos.prototype_pairs([r.payload for r in replies])
        if len(self.pairs[1]) == 0:
            return {}
        self.margin, _ = adaptive_margin(*self.pairs, self.params.margin_threshold)
        return {"fedtgp/margin": self.margin}

    def update(self, data: ServerData, rnd: RoundContext) -> dict[str, float]:
        if self.pairs is None or len(self.pairs[1]) == 0:
            return {}
        p = self.params
        device = self.ctx.device
        x = torch.as_tensor(self.pairs[0], device=device)
        y = torch.as_tensor(self.pairs[1], device=device)
        classes = torch.arange(self.ctx.num_classes, device=device)
        optimizer = torch.optim.SGD(
            self.generator.parameters(), lr=p.server_lr or self.ctx.train.lr
        )
        batch = self.ctx.train.batch_size
        self.generator.train()
        total, count = 0.0, 0
        for _ in range(p.server_epochs):
            order = torch.randperm(len(y)).to(device)  # the engine seeds the server's stream
            for start in range(0, len(y), batch):
                idx = order[start : start + batch]
                loss = acl_loss(x[idx], y[idx], self.generator(classes), self.margin)
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                optimizer.step()
                total += float(loss.detach()) * len(idx)
                count += len(idx)
        self.generator.eval()
        with torch.no_grad():
            table = self.generator(classes).cpu().numpy().astype(np.float32)
        # every class has a trained prototype from now on, as in the official code
        self.table = {"means": table, "counts": np.ones(len(table), dtype=np.float32)}
        self.pairs = None
        return {"fedtgp/server_loss": total / count} if count else {}

    def state_modules(self) -> dict[str, nn.Module]:
        return {"generator": self.generator}


ALGORITHMS.add(
    "fedtgp",
    Algorithm(
        "fedtgp",
        FedTGPParams,
        FedTGPClient,
        FedTGPServer,
        needs_common_feature_dim=True,
        summary="trainable global prototypes with adaptive-margin contrastive learning",
    ),
)
