"""FedKD: Wu et al., "Communication-efficient federated learning via knowledge distillation"
(Nature Communications 13, 2032, 2022; arXiv 2108.13323).

Every client keeps a private mentor (its own architecture) and trains it together with a copy of
a small shared mentee by adaptive mutual distillation and hidden-state distillation: with
`s = CE(mentor, y) + CE(mentee, y)` and `h`, `h_g` the mentor's and the mentee's features,

    mentor: CE(mentor, y) + KL(mentee || mentor) / s + MSE(h, W h_g) / s
    mentee: CE(mentee, y) + KL(mentor || mentee) / s + MSE(h, W h_g) / s

so distillation counts more when both models already predict well (the paper's adaptive
weighting). `W` is a client-local linear map from the mentee's features to the mentor's, trained
with both models and never shared.

The defaults are HtFLlib's (TsingZ0/HtFLlib `system/flcore/clients/clientkd.py`, the code the
docs cite for FedKD):
- `kl_reduction: mean`: `nn.KLDivLoss()`'s default, the mean over every entry (clientkd.py:24,
  62-63); `batchmean` is the per-sample KL.
- `detach: false`: neither the KL targets nor `s` are detached (clientkd.py:62-65), so each KL
  also trains the model of its target and the gradient flows through `s`; `detach: true` makes
  each loss train its own model only, with `s` a constant.
- `hidden: true`: the hidden loss of clientkd.py:19, 64-65 (`nn.MSELoss`, a `W` without bias);
  it appears in both losses, as there, so it counts twice in their sum. `false` drops it.
- `weighting: uniform`: the server's mentee is the plain mean over the clients
  (`system/flcore/servers/serverkd.py:94`); `samples` weighs the updates by training samples.
- `T: 1`: HtFLlib has no temperature; other values scale both KLs by `T^2` at temperature `T`.
HtFLlib clips each model's gradient at norm 10 (clientkd.py:76-78) and uses plain SGD: those are
the run's `train.grad_clip: 10` and `train.momentum: 0`. Its mentee learning rate (`-mlr`,
default 0.01) is the run's `train.lr` here.

Optionally the mentee *update* is compressed by truncated SVD before upload (`svd_energy`): each
matrix-shaped update (conv kernels as `out x in*k*k`) keeps the fewest singular values whose
squared sum reaches `svd_energy` of the total, and travels as `U_k, s_k, V_k^T` when that is
smaller than the dense matrix. HtFLlib compresses the mentee's *parameters* both ways with an
energy annealed from 0.95 to 0.98 (clientkd.py:86, serverkd.py:66, 96); here the threshold is
fixed, the uplink carries updates and the downlink is the dense mentee (`svd_energy: null`, no
compression, is the method's accuracy upper bound).
Under secure aggregation or DP the server only sees the sample-weighted sum, so there the
average is sample-weighted whatever `weighting` says.

Shares: the mentee's update (dense or SVD-compressed) up, the global mentee down.
Keeps local: the mentor (the personalized model) and `W`. The mentee defaults to the
federation's architecture with the fewest parameters (`rayfl.algorithms.fml.shared_arch`).
Server: mean of the mentee updates (uniform or sample-weighted) added to the global mentee
(`mentee/acc`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from rayfl.algorithms import functional as fn
from rayfl.algorithms.base import (
    ALGORITHMS,
    Algorithm,
    CheckedParams,
    ClientContext,
    ModelClient,
    Payload,
    Reply,
    RoundContext,
    Server,
    ServerContext,
    Trainer,
    load_numpy,
    reply_weights,
    to_numpy,
)
from rayfl.algorithms.fml import check_shared_arch, shared_arch, target
from rayfl.algorithms.functional import svd_compress, svd_decompress
from rayfl.models import build_model
from rayfl.schema import setting


@dataclass(frozen=True)
class FedKDParams(CheckedParams):
    mentee: str | None = setting(None, "shared mentee architecture; None: the family's smallest")
    T: float = setting(1.0, "distillation temperature (HtFLlib: none, i.e. 1)", gt=0)
    svd_energy: float | None = setting(
        None, "e.g. 0.95: SVD-compress mentee updates keeping this energy", gt=0, le=1
    )
    kl_reduction: Literal["mean", "batchmean"] = setting(
        "mean", "KL averaged per entry (HtFLlib's nn.KLDivLoss() default) or per sample (batchmean)"
    )
    detach: bool = setting(
        False, "true: KL targets and the 1/(CE+CE_g) scale detached (HtFLlib: not)"
    )
    hidden: bool = setting(
        True, "hidden-state loss MSE(h, W h_g) / (CE+CE_g) through a local map W"
    )
    weighting: Literal["uniform", "samples"] = setting("uniform", "server mean (HtFLlib: uniform)")

    def __post_init__(self) -> None:
        check_shared_arch(self.mentee, "algorithm.mentee")
        super().__post_init__()


def adaptive_losses(
    mentor_logits: torch.Tensor,
    mentee_logits: torch.Tensor,
    y: torch.Tensor,
    p: FedKDParams,
    hidden: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(mentor loss, mentee loss) of adaptive mutual distillation; `hidden` is the unscaled
    hidden-state loss `MSE(h, W h_g)` (None: none)."""
    ce_mentor = F.cross_entropy(mentor_logits, y)
    ce_mentee = F.cross_entropy(mentee_logits, y)
    scale = 1.0 / target(ce_mentor + ce_mentee, p.detach)
    red = p.kl_reduction
    mentor = ce_mentor + scale * fn.kd_loss(
        mentor_logits, target(mentee_logits, p.detach), p.T, red
    )
    mentee = ce_mentee + scale * fn.kd_loss(
        mentee_logits, target(mentor_logits, p.detach), p.T, red
    )
    if hidden is not None:
        mentor, mentee = mentor + scale * hidden, mentee + scale * hidden
    return mentor, mentee


class FedKDClient(ModelClient[FedKDParams]):
    deployed_uses_payload = False  # deploys its local mentor (the mentee travels)

    def __init__(self, ctx: ClientContext, params: FedKDParams) -> None:
        super().__init__(ctx, params)
        archs = ctx.family_archs or (ctx.arch,)
        mentee = shared_arch(params.mentee, archs, ctx.in_shape, ctx.num_classes)
        self.mentee = build_model(mentee, ctx.in_shape, ctx.num_classes)
        self.received: Payload = {}
        self.hidden_map: nn.Module | None = None
        if params.hidden:
            # HtFLlib's W_h: mentee features -> mentor features, no bias, local to the client
            self.hidden_map = nn.Linear(self.mentee.feature_dim, self.model.feature_dim, bias=False)
            self.persistent["hidden_map"] = self.hidden_map

    def receive(self, payload: Payload, rnd: RoundContext) -> None:
        load_numpy(self.mentee, payload)
        self.received = to_numpy(self.mentee.state_dict())

    def fit(self, trainer: Trainer) -> dict[str, float]:
        modules: list[nn.Module] = [self.model, self.mentee]
        if self.hidden_map is not None:
            modules.append(self.hidden_map)
        return trainer.run(self.training_step, modules)

    def training_step(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h, h_g = self.model.features(x), self.mentee.features(x)
        hidden = None
        if self.hidden_map is not None:
            hidden = F.mse_loss(h, self.hidden_map(h_g))
        mentor, mentee = adaptive_losses(
            self.model.head(h), self.mentee.head(h_g), y, self.params, hidden
        )
        return mentor + mentee

    def upload(self) -> Payload:
        update = fn.subtract(to_numpy(self.mentee.state_dict()), self.received)
        if self.params.svd_energy is None:
            return update
        return svd_compress(update, self.params.svd_energy)


class FedKDServer(Server[FedKDParams]):
    def __init__(self, ctx: ServerContext, params: FedKDParams) -> None:
        super().__init__(ctx, params)
        mentee = shared_arch(params.mentee, ctx.architectures, ctx.in_shape, ctx.num_classes)
        self.mentee = build_model(mentee, ctx.in_shape, ctx.num_classes).to(ctx.device)

    def broadcast(self, arch: str, rnd: RoundContext) -> Payload:
        return to_numpy(self.mentee.state_dict())

    def aggregate(self, replies: Sequence[Reply], rnd: RoundContext) -> dict[str, float]:
        updates = [svd_decompress(r.payload) for r in replies]
        avg = fn.weighted_average(updates, reply_weights(replies, self.params.weighting))
        current = to_numpy(self.mentee.state_dict())
        load_numpy(self.mentee, fn.add(current, avg))
        return {}

    def eval_models(self) -> dict[str, nn.Module]:
        return {"mentee": self.mentee}


ALGORITHMS.add(
    "fedkd",
    Algorithm(
        "fedkd",
        FedKDParams,
        FedKDClient,
        FedKDServer,
        summary="adaptive mutual distillation with a shared mentee (optional SVD-compressed updates)",
    ),
)
