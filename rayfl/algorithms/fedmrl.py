"""FedMRL: Yi et al., "Federated Model Heterogeneous Matryoshka Representation Learning"
(NeurIPS 2024; arXiv 2406.00488). Code followed: the official LipingYi/FedMRL
(`experiments/FLHetero/FedMRL_hetero.py`, `Models/CNNs.py`) and HtFLlib's port
(TsingZ0/HtFLlib `system/flcore/clients/clientmrl.py`, `servers/servermrl.py`).

Every client trains its own heterogeneous model `F` beside a copy of one small homogeneous model
`G` shared by the federation. For a sample, the two extractors' representations are concatenated
and fused by the client's personal projector `P` (one linear layer, `d1 + d2 -> d2`) into a
Matryoshka representation `r`: its first `d1` dimensions feed `G`'s header, all `d2` feed `F`'s:

    r = P([G_ex(x), F_ex(x)]);   loss = CE(F_hd(r), y) + CE(G_hd(r[:, :d1]), y)

`d1` is the shared model's feature size (`sub_feature_dim`), `d2` the client's. The personalized
model is `F_hd(P([G_ex(x), F_ex(x)]))` with the latest global `G`, as both codes score it.

Shares: the small homogeneous model `G` (extractor and header), both ways.
Keeps local: the heterogeneous model `F` and the projector `P`.
Server: sample-weighted average of the clients' `G`, not scored alone: `G`'s header only ever
reads the fused representation `r[:, :d1]`, never `G`'s own features (alone it scores near chance).

The shared model is the architecture `extractor` (default: the federation's smallest, as FML's
meme). With `sub_feature_dim` below its feature size, its features are average-pooled to that
size, as HtFLlib's `BaseHeadSplit` pools its global model's (`nn.AdaptiveAvgPool1d`), and it gets
a linear header of that width. Default `sub_feature_dim: null` keeps the architecture's own size:
the official code's small model has `d1 = 500`, the local models' size (`small_rep_dim = 500`);
HtFLlib's command uses 128 with 512-d local features (`total.sh`: `-sfd 128`).

Deviations: the official code clips each model's gradient at norm 50 and trains with momentum
0.9 (rayfl: `train.grad_clip`, `train.momentum`); HtFLlib averages `G` uniformly over clients
and never stores the trained projector (each round starts from its initial one), rayfl
weights by samples and keeps the projector, as the paper and the official code do.
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
    AveragingServer,
    CheckedParams,
    ClientContext,
    ModelClient,
    Payload,
    RoundContext,
    ServerContext,
    Trainer,
    load_numpy,
    to_numpy,
)
from rayfl.algorithms.fml import check_shared_arch, shared_arch
from rayfl.algorithms.functional import arch_sizes
from rayfl.errors import require
from rayfl.models import SplitModel, build_model
from rayfl.schema import setting


@dataclass(frozen=True)
class FedMRLParams(CheckedParams):
    extractor: str | None = setting(
        None,
        "shared small homogeneous model's architecture; None: the family's smallest (as FML's meme)",
    )
    sub_feature_dim: int | None = setting(
        None,
        "its representation size d1 (pooled down to it); None: the architecture's own feature size",
        ge=1,
    )

    def __post_init__(self) -> None:
        check_shared_arch(self.extractor, "algorithm.extractor")
        super().__post_init__()


def shared_model(
    params: FedMRLParams, archs: Sequence[str], in_shape: tuple[int, ...], num_classes: int
) -> SplitModel:
    """The small homogeneous model: `extractor` (or the family's smallest), its features pooled
    to `sub_feature_dim` with a linear header of that width when that is smaller."""
    arch = shared_arch(params.extractor, archs, in_shape, num_classes)
    model = build_model(arch, in_shape, num_classes)
    d1 = params.sub_feature_dim
    if d1 is None or d1 == model.feature_dim:
        return model
    require(
        d1 < model.feature_dim,
        "algorithm.sub_feature_dim",
        f"{d1} exceeds the shared {arch}'s feature size {model.feature_dim}",
    )
    encoder = nn.Sequential(model.encoder, nn.AdaptiveAvgPool1d(d1))
    return SplitModel(encoder, nn.Linear(d1, num_classes), d1)


def require_nested(d1: int, arch: str, d2: int) -> None:
    """The shared representation must fit in the first `d1` of `arch`'s `d2` dimensions."""
    require(
        d1 <= d2,
        "algorithm.sub_feature_dim",
        f"the shared representation ({d1}) exceeds {arch}'s feature size {d2}; "
        f"set algorithm.sub_feature_dim to at most {d2}",
    )


class Matryoshka(nn.Module):
    """The personalized model: `local.head(projector([shared_ex(x), local_ex(x)]))`."""

    def __init__(self, shared: SplitModel, local: SplitModel, projector: nn.Module) -> None:
        super().__init__()
        self.shared = shared
        self.local = local
        self.projector = projector

    def fused(self, x: torch.Tensor) -> torch.Tensor:
        """The Matryoshka representation `r` (size d2; its first d1 dimensions are G's)."""
        return self.projector(torch.cat([self.shared.features(x), self.local.features(x)], 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.local.head(self.fused(x))


class FedMRLClient(ModelClient[FedMRLParams]):
    def __init__(self, ctx: ClientContext, params: FedMRLParams) -> None:
        super().__init__(ctx, params)
        archs = ctx.family_archs or (ctx.arch,)
        self.shared = shared_model(params, archs, ctx.in_shape, ctx.num_classes)
        d1, d2 = self.shared.feature_dim, self.model.feature_dim
        require_nested(d1, ctx.arch, d2)
        self.projector = nn.Linear(d1 + d2, d2)
        self.persistent = {"model": self.model, "projector": self.projector}
        self.net = Matryoshka(self.shared, self.model, self.projector)

    def receive(self, payload: Payload, rnd: RoundContext) -> None:
        load_numpy(self.shared, payload)

    def fit(self, trainer: Trainer) -> dict[str, float]:
        return trainer.run(self.training_step, [self.model, self.projector, self.shared])

    def training_step(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        r = self.net.fused(x)
        coarse = r[:, : self.shared.feature_dim]
        return F.cross_entropy(self.model.head(r), y) + F.cross_entropy(self.shared.head(coarse), y)

    def eval_model(self) -> nn.Module:
        return self.net

    def upload(self) -> Payload:
        return to_numpy(self.shared.state_dict())


class FedMRLServer(AveragingServer[FedMRLParams]):
    scored = False  # `G` classifies only through a client's projector

    def __init__(self, ctx: ServerContext, params: FedMRLParams) -> None:
        model = shared_model(params, ctx.architectures, ctx.in_shape, ctx.num_classes)
        for arch in sorted(set(ctx.architectures)):  # refused here, before any client trains
            d2 = arch_sizes(arch, tuple(ctx.in_shape), ctx.num_classes)[1]
            require_nested(model.feature_dim, arch, d2)
        super().__init__(ctx, params, model)


ALGORITHMS.add(
    "fedmrl",
    Algorithm(
        "fedmrl",
        FedMRLParams,
        FedMRLClient,
        FedMRLServer,
        summary="matryoshka representations fused from a shared small model and the local one",
    ),
)
