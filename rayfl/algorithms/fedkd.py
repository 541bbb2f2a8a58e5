"""FedKD: Wu et al., "Communication-efficient federated learning via knowledge distillation"
(Nature Communications 13, 2032, 2022; arXiv 2108.13323).

Every client keeps a private mentor (its own architecture) and trains it together with a copy of
a small shared mentee by adaptive mutual distillation: with `s = CE(mentor, y) + CE(mentee, y)`,

    mentor: CE(mentor, y) + T^2 KL(mentee.detach() || mentor) / s
    mentee: CE(mentee, y) + T^2 KL(mentor.detach() || mentee) / s

so distillation counts more when both models already predict well (the paper's adaptive
weighting). `s` and each distillation target are detached: each loss trains its own model only.
The paper's hidden-state (attention) distillation needs matching layers and is not used here.

Optionally the mentee *update* is compressed by truncated SVD before upload (`svd_energy`): each
matrix-shaped update (conv kernels as `out x in*k*k`) keeps the fewest singular values whose
squared sum reaches `svd_energy` of the total, and travels as `U_k, s_k, V_k^T` when that is
smaller than the dense matrix. The paper also anneals the threshold and compresses the downlink;
here the threshold is fixed and the downlink is the dense mentee.

Shares: the mentee's update (dense or SVD-compressed) up, the global mentee down.
Keeps local: the mentor (the personalized model). The mentee defaults to the federation's
architecture with the fewest parameters (`rayfl.algorithms.fml.shared_arch`).
Server: sample-weighted average of the mentee updates added to the global mentee (`mentee/acc`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from rayfl.algorithms import functional as fn
from rayfl.algorithms.base import (
    Algorithm,
    ClientContext,
    ModelClient,
    Payload,
    Reply,
    RoundContext,
    Server,
    ServerContext,
    Trainer,
    load_numpy,
    to_numpy,
)
from rayfl.algorithms.fml import check_shared_arch, shared_arch
from rayfl.algorithms.functional import svd_compress, svd_decompress
from rayfl.errors import require
from rayfl.models import build_model
from rayfl.registry import ALGORITHMS


@dataclass(frozen=True)
class FedKDParams:
    mentee: str | None = None  # shared mentee architecture; None: the family's smallest
    T: float = 1.0  # distillation temperature
    svd_energy: float | None = None  # e.g. 0.95: SVD-compress mentee updates keeping this energy

    def __post_init__(self) -> None:
        check_shared_arch(self.mentee, "algorithm.mentee")
        require(self.T > 0, "algorithm.T", f"temperature must be > 0 (got {self.T})")
        require(
            self.svd_energy is None or 0 < self.svd_energy <= 1,
            "algorithm.svd_energy",
            f"must be in (0, 1] or null for no compression (got {self.svd_energy})",
        )


def adaptive_losses(
    mentor_logits: torch.Tensor, mentee_logits: torch.Tensor, y: torch.Tensor, T: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(mentor loss, mentee loss) of adaptive mutual distillation."""
    ce_mentor = F.cross_entropy(mentor_logits, y)
    ce_mentee = F.cross_entropy(mentee_logits, y)
    scale = 1.0 / (ce_mentor + ce_mentee).detach()
    mentor = ce_mentor + scale * fn.kd_loss(mentor_logits, mentee_logits.detach(), T)
    mentee = ce_mentee + scale * fn.kd_loss(mentee_logits, mentor_logits.detach(), T)
    return mentor, mentee


class FedKDClient(ModelClient[FedKDParams]):
    deployed_uses_payload = False  # deploys its local mentor (the mentee travels)

    def __init__(self, ctx: ClientContext, params: FedKDParams) -> None:
        super().__init__(ctx, params)
        archs = ctx.family_archs or (ctx.arch,)
        mentee = shared_arch(params.mentee, archs, ctx.in_shape, ctx.num_classes)
        self.mentee = build_model(mentee, ctx.in_shape, ctx.num_classes)
        self.received: Payload = {}

    def receive(self, payload: Payload, rnd: RoundContext) -> None:
        load_numpy(self.mentee, payload)
        self.received = to_numpy(self.mentee.state_dict())

    def fit(self, trainer: Trainer) -> dict[str, float]:
        return trainer.run(self.training_step, [self.model, self.mentee])

    def training_step(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        mentor, mentee = adaptive_losses(self.model(x), self.mentee(x), y, self.params.T)
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
        avg = fn.weighted_average(updates, [r.num_samples for r in replies])
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
