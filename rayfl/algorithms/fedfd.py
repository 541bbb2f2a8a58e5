"""FedFD: Li et al., "Feature Distillation is the Better Choice for Model-Heterogeneous Federated
Learning" (NeurIPS 2025; arXiv 2507.10348). FedDF, the logit-distillation setting of the same
server, is registered in `rayfl.algorithms.feddf`.

Clients are width levels of ResNet-18 trained with cross-entropy, exactly as in HeteroFL
(`rayfl.algorithms.heterofl`); the server aggregates the slices per entry, then distils the
ensemble of the round's client models into its full-width global model on the public
(distillation) split:

- `distill=feature` (FedFD): for every architecture group d present this round, the features
  of the group's client extractors are averaged, `e^d = mean_{k in S_d} f(w_k; x)`; the global
  features z are projected into group d's feature space by that group's projection `M_d`; the
  loss is the mean over groups of `T^2 KL(softmax(e^d / T) || softmax(M_d z / T))` (softmax over
  feature dimensions). As in the paper's server loss (a sum over groups 2..m divided by m - 1),
  the group of the global model's own width is left out and has no projection; `self_group:
  true` distils from it too, through a learnable rotation (the mean then runs over m groups).
- `distill=logit` (FedDF-style; FedFD's "logit distillation" comparison): the teacher is the
  average of all client models' logits, the loss `T^2 KL(softmax(teacher / T) || softmax(g(x) / T))`.
- `distill=both`: the sum of the two.

Projections (`projection=`): `orthogonal` (default) `M_d` = the leading `d_group x d_global`
block of `exp(A - A^T)`, an orthogonal matrix, so its rows are orthonormal whatever the optimizer
does; `linear` a plain learned matrix (the ablation); `identity` where the sizes are equal. Both
learned kinds start as the leading identity block: narrower clients' features are the leading
channels of the global model's, so that is the natural initial alignment.

The group targets (features and logits) are computed once per round under `no_grad`, loading
each reply into a cached model of its architecture; then `steps` minibatches of distillation
train the global model and the projections on the server's device.

Differences from the papers, deliberate: FedDF distils one prototype model per architecture;
here, as in FedFD's comparison, the single global model is distilled and clients get its slices.

Shares: the client's slice of the global model (down), the trained slice (up).
Keeps local: nothing.
Server: per-entry sliced averaging (HeteroFL), then ensemble feature / logit distillation.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Literal

import torch
from torch import nn

from rayfl.algorithms import functional as fn
from rayfl.algorithms.base import (
    ALGORITHMS,
    Algorithm,
    Reply,
    RoundContext,
    ServerContext,
    ServerData,
    load_numpy,
)
from rayfl.algorithms.heterofl import (
    HeteroFLClient,
    HeteroFLParams,
    HeteroFLServer,
    build_width_model,
    check_width_family,
)
from rayfl.errors import ConfigError
from rayfl.models.base import SplitModel
from rayfl.models.resnet import resnet_width
from rayfl.schema import setting

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class FedFDParams(HeteroFLParams):
    """FedFD hyperparameters (plus HeteroFL's `global_arch`, `static_bn`, `scaler`, `weighting`)."""

    distill: Literal["feature", "logit", "both"] = setting(
        "feature", "`feature` (FedFD), `logit` (FedDF-style averaged logits) or `both`"
    )
    projection: Literal["orthogonal", "linear", "identity"] = setting(
        "orthogonal", "`orthogonal` (FedFD), `linear` (ablation) or `identity` (equal sizes only)"
    )
    steps: int = setting(
        50, "distillation minibatches per round (0 turns distillation off: HeteroFL)"
    )
    lr: float = setting(0.01, "distillation learning rate (the paper: 0.01)", gt=0)
    optimizer: Literal["sgd", "adam"] = setting(
        "sgd", "distillation optimizer; SGD uses `momentum`, both use `train.weight_decay`"
    )
    momentum: float = setting(0.9, "SGD momentum of the distillation optimizer", lt=1)
    T: float = setting(1.0, "softmax temperature over feature dimensions (and logits)", gt=0)
    batch_size: int | None = setting(
        None, "distillation minibatch size; null takes `train.batch_size`", ge=2
    )
    self_group: bool = setting(
        False,
        "also distil from the clients of the global model's own width (the paper leaves that group out)",
    )


# -- projections and the loss --------------------------------------------------------------------


class OrthogonalProjection(nn.Module):
    """`z -> z M^T` with `M` the leading `out_dim x in_dim` block of `exp(A - A^T)`.

    `exp` of a skew-symmetric matrix is orthogonal (`exp(S) exp(S)^T = exp(S - S) = I`), so the
    rows of `M` are orthonormal when `out_dim <= in_dim` (its columns otherwise) after any update
    of the free parameter `A` (only its strict upper triangle is used). `A = 0` gives the leading
    identity block. `in_dim`: the global model's feature size; `out_dim`: the group's.
    """

    def __init__(self, in_dim: int, out_dim: int) -> None:
        super().__init__()
        self.in_dim, self.out_dim = int(in_dim), int(out_dim)
        n = max(self.in_dim, self.out_dim)
        self.weight = nn.Parameter(torch.zeros(n, n))

    def matrix(self) -> torch.Tensor:
        """The current `out_dim x in_dim` projection matrix."""
        upper = torch.triu(self.weight, diagonal=1)
        return torch.linalg.matrix_exp(upper - upper.T)[: self.out_dim, : self.in_dim]

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        return z @ self.matrix().T


class LinearProjection(nn.Module):
    """`z -> z M^T` with a free `out_dim x in_dim` matrix `M`, started at the leading identity block."""

    def __init__(self, in_dim: int, out_dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.eye(int(out_dim), int(in_dim)))

    def matrix(self) -> torch.Tensor:
        return self.weight

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        return z @ self.weight.T


def build_projection(kind: str, in_dim: int, out_dim: int, arch: str = "?") -> nn.Module:
    """The projection of kind `orthogonal`, `linear` or `identity` (equal sizes only) from
    `in_dim` to `out_dim` features."""
    if kind == "orthogonal":
        return OrthogonalProjection(in_dim, out_dim)
    if kind == "linear":
        return LinearProjection(in_dim, out_dim)
    if kind == "identity":
        if in_dim != out_dim:
            raise ConfigError(
                f"algorithm.projection=identity needs equal feature sizes, but client model {arch!r} has "
                f"{out_dim} features and the global model {in_dim}; use projection=orthogonal or linear"
            )
        return nn.Identity()
    raise ValueError(f"unknown projection {kind!r}")  # the Params' Literal refuses it first


def check_fedfd_family(archs: Sequence[str], params: FedFDParams) -> None:
    """HeteroFL's width checks plus `projection=identity`'s equal feature sizes; builds no model."""
    check_width_family(archs, params)
    if params.projection == "identity" and params.distill != "logit":
        global_width = resnet_width(params.global_arch)
        for arch in archs:
            if resnet_width(arch) != global_width:
                raise ConfigError(
                    f"algorithm.projection=identity needs equal feature sizes, but client model {arch!r} "
                    f"is narrower than algorithm.global_arch={params.global_arch}; use projection=orthogonal or linear"
                )


def orthogonality_error(projection: nn.Module) -> float:
    """`max |M M^T - I|` (or `M^T M` when `M` is tall): 0 for an exactly semi-orthogonal `M`."""
    matrix_fn = getattr(projection, "matrix", None)
    if matrix_fn is None:  # identity
        return 0.0
    with torch.no_grad():
        m = matrix_fn().double()
        if m.shape[0] > m.shape[1]:
            m = m.T
        gram = m @ m.T
        return float(
            (gram - torch.eye(len(gram), dtype=gram.dtype, device=gram.device)).abs().max()
        )


def feature_distill_loss(
    global_features: torch.Tensor,
    projections: Mapping[str, nn.Module] | nn.ModuleDict,
    targets: Mapping[str, torch.Tensor],
    temperature: float,
) -> torch.Tensor:
    """FedFD's loss: mean over the groups in `targets` of `T^2 KL(softmax(e^d/T) || softmax(M_d z/T))`.

    `global_features` are the global model's `(batch, d_global)` features `z`; `projections` map
    them to each group's size; `targets` are each group's `(batch, d_group)` mean client features.
    """
    if not targets:
        raise ValueError("feature distillation needs at least one group target")
    losses = [
        fn.kd_loss(projections[g](global_features), t, temperature) for g, t in targets.items()
    ]
    return torch.stack(losses).mean()


# -- the two halves ------------------------------------------------------------------------------


class FedFDClient(HeteroFLClient[FedFDParams]):
    """A width level of ResNet-18 trained with cross-entropy on the received slice (as HeteroFL)."""


class FedFDServer(HeteroFLServer[FedFDParams]):
    """HeteroFL's sliced aggregation followed by ensemble feature and/or logit distillation."""

    metric_prefix = "fedfd"

    def __init__(self, ctx: ServerContext, params: FedFDParams) -> None:
        super().__init__(ctx, params)
        self.params: FedFDParams = params
        d_global = self.model.feature_dim
        self.projections = nn.ModuleDict()
        if params.distill in ("feature", "both"):
            for arch in filter(self._feature_group, ctx.architectures):
                self.projections[arch] = build_projection(
                    params.projection, d_global, self.feature_dims[arch], arch
                ).to(ctx.device)
        self._extractors: dict[str, SplitModel] = {}
        self._replies: list[Reply] = []

    def aggregate(self, replies: Sequence[Reply], rnd: RoundContext) -> dict[str, float]:
        metrics = super().aggregate(replies, rnd)
        # The replies are the ensemble `update` distils from; dropped again once it has.
        self._replies = list(replies)
        return metrics

    # -- distillation ----------------------------------------------------------------------------
    def _feature_group(self, arch: str) -> bool:
        """Whether clients of `arch` are a feature-distillation group (see `self_group`)."""
        return self.params.self_group or resnet_width(arch) != resnet_width(self.params.global_arch)

    def _extractor(self, arch: str) -> SplitModel:
        if arch not in self._extractors:
            ctx = self.ctx
            self._extractors[arch] = build_width_model(
                arch, ctx.in_shape, ctx.num_classes, self.params
            ).to(ctx.device)
        return self._extractors[arch]

    @torch.no_grad()
    def _targets(
        self, batches: Sequence[torch.Tensor], replies: Sequence[Reply]
    ) -> tuple[dict[str, torch.Tensor], torch.Tensor | None]:
        """Per-group mean features and the mean of all clients' logits over the distillation set."""
        want_features = self.params.distill in ("feature", "both")
        want_logits = self.params.distill in ("logit", "both")
        feats: dict[str, torch.Tensor] = {}
        counts: dict[str, int] = {}
        logits: torch.Tensor | None = None
        for reply in replies:
            model = self._extractor(reply.arch)
            load_numpy(model, reply.payload)
            model.eval()
            f = torch.cat([model.features(x) for x in batches])
            if want_features and self._feature_group(reply.arch):
                feats[reply.arch] = feats[reply.arch] + f if reply.arch in feats else f
                counts[reply.arch] = counts.get(reply.arch, 0) + 1
            if want_logits:
                out = model.head(f)
                logits = out if logits is None else logits + out
        means = {arch: feats[arch] / counts[arch] for arch in sorted(feats)}
        return means, (logits / len(replies) if logits is not None else None)

    def distil(
        self,
        data: ServerData,
        step: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
        tensors: tuple[torch.Tensor, torch.Tensor],
        size: int,
        steps: int | None = None,
        lr: float | None = None,
    ) -> dict[str, float]:
        """`steps` (default `params.steps`) minibatches of distillation of the global model and
        the projections at `lr` (default `params.lr`); returns extra metrics (none here).
        FedFD's own optimizer, with the run's weight decay and no clipping."""
        p = self.params
        lr = p.lr if lr is None else lr
        data.run(
            step,
            [self.model, self.projections],
            steps=p.steps if steps is None else steps,
            params=list(self.model.parameters()) + list(self.projections.parameters()),
            settings=replace(
                self.ctx.train, optimizer=p.optimizer, lr=lr, momentum=p.momentum, grad_clip=None
            ),
            data=tensors,
            batch_size=size,
        )
        return {}

    def update(self, data: ServerData, rnd: RoundContext) -> dict[str, float]:
        replies, self._replies = self._replies, []
        p = self.params
        if not replies or p.steps == 0:
            return {}
        size = p.batch_size or self.ctx.train.batch_size
        # A batch of one cannot go through batch norm with batch statistics.
        batches = [x for x, _ in data.batches("public", batch_size=size) if len(x) > 1]
        if not batches:
            log.warning(
                "round %d: the public split is too small to distil from; skipped", rnd.index
            )
            return {}
        feats, logits = self._targets(batches, replies)
        if not feats and logits is None:  # only full-width clients, and they are no group
            return {}
        x_all = torch.cat(batches)
        total = {"loss": 0.0, "feature": 0.0, "logit": 0.0, "steps": 0.0}

        def step(x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
            # `y` is each sample's index into the round's targets
            z = self.model.features(x)
            loss = torch.zeros((), device=z.device)
            if feats:
                f_loss = feature_distill_loss(
                    z, self.projections, {a: t[idx] for a, t in feats.items()}, p.T
                )
                loss = loss + f_loss
                total["feature"] += float(f_loss.detach())
            if logits is not None:
                l_loss = fn.kd_loss(self.model.head(z), logits[idx], p.T)
                loss = loss + l_loss
                total["logit"] += float(l_loss.detach())
            total["loss"] += float(loss.detach())
            total["steps"] += 1
            return loss

        index = torch.arange(len(x_all), device=x_all.device)
        extra = self.distil(data, step, (x_all, index), size)
        self.model.eval()
        prefix = self.metric_prefix
        n = max(total["steps"], 1.0)
        metrics = {
            f"{prefix}/distill_loss": total["loss"] / n,
            f"{prefix}/groups": float(len({r.arch for r in replies})),
        }
        if p.distill == "both":
            metrics[f"{prefix}/feature_loss"] = total["feature"] / n
            metrics[f"{prefix}/logit_loss"] = total["logit"] / n
        metrics.update({f"{prefix}/{k}": v for k, v in extra.items()})
        if len(self.projections):
            metrics[f"{prefix}/orth_error"] = max(
                orthogonality_error(m) for m in self.projections.values()
            )
        return metrics

    # -- state ------------------------------------------------------------------------------------
    def state_modules(self) -> dict[str, nn.Module]:
        return {"global": self.model, "projections": self.projections}


ALGORITHMS.add(
    "fedfd",
    Algorithm(
        "fedfd",
        FedFDParams,
        FedFDClient,
        FedFDServer,
        needs_public=True,
        summary="HeteroFL slices + server ensemble feature distillation through orthogonal projections",
        check_archs=check_fedfd_family,
    ),
)
