"""APFL: Deng, Kamani and Mahdavi, "Adaptive Personalized Federated Learning" (arXiv 2003.13461).

Each client keeps a local model `v` and a mixing weight `alpha`; its personalized model is the
parameter mixture `v_bar = alpha v + (1 - alpha) w` with the global model `w`. Per minibatch
(the paper's Algorithm 1): `w` takes a step on its own loss, `v` a step on the mixture's loss
(gradient `alpha * grad f(v_bar)`), and `alpha` a step on the mixture's loss too (gradient
`<v - w, grad f(v_bar)>`), projected onto [0, 1].

Code followed: FL-bench `apfl` (per-client `alpha` kept across rounds, initial 0.5,
`adaptive_alpha`); PFLlib `system/flcore/clients/clientapfl.py` (`alpha_update`).

Shares: the global model `w`, both ways.
Keeps local: `v` (a copy of the received global model when the client first trains) and
`alpha`; the personalized model is the mixture with the latest `w` (the
trained one after local training, the broadcast one when deployed).
Server: per architecture, the sample-weighted average of the global models
(`rayfl.algorithms.groups`); scored as `global/acc`.

Defaults: `alpha=0.5` (FL-bench; PFLlib's `-al` is 1.0), `adaptive=True` (FL-bench; the paper's
adaptive alpha). Deviations: `v` trains on the mixture's loss as in the paper (PFLlib trains it
on its own loss and then overwrites it with the mixture); `alpha` is stepped by the run's
optimizer at `train.lr` without PFLlib's extra `0.02 alpha` term, and projected onto [0, 1]
before every use.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call

from rayfl.algorithms.base import (
    ALGORITHMS,
    Algorithm,
    CheckedParams,
    ClientContext,
    Trainer,
)
from rayfl.algorithms.groups import Flag, GlobalCopyClient, GroupServer
from rayfl.schema import setting


@dataclass(frozen=True)
class APFLParams(CheckedParams):
    alpha: float = setting(0.5, "initial weight of the local model in the mixture, in [0, 1]", le=1)
    adaptive: bool = setting(
        True, "learn alpha per client by gradient descent (False: keep it fixed)"
    )


class Alpha(nn.Module):
    """A client's mixing weight, a one-element parameter (state, so it persists per client)."""

    def __init__(self, value: float, learn: bool) -> None:
        super().__init__()
        self.alpha = nn.Parameter(torch.tensor(float(value)), requires_grad=learn)

    def project(self) -> torch.Tensor:
        with torch.no_grad():
            self.alpha.clamp_(0.0, 1.0)
        return self.alpha


def mixture(local: nn.Module, glob: nn.Module, alpha: torch.Tensor) -> dict[str, torch.Tensor]:
    """`alpha * local + (1 - alpha) * glob` per entry: parameters with gradients to `local` and
    `alpha` (never to `glob`), float buffers (BN statistics) as constants, others `local`'s."""
    g = glob.state_dict()
    out = {k: alpha * v + (1 - alpha) * g[k].detach() for k, v in local.named_parameters()}
    a = float(alpha.detach())
    for k, b in local.named_buffers():
        out[k] = a * b + (1 - a) * g[k] if b.is_floating_point() else b.clone()
    return out


class Mixture(nn.Module):
    """The personalized model `v_bar`: `local`'s architecture at the mixed weights."""

    def __init__(self, local: nn.Module, glob: nn.Module, alpha: Alpha) -> None:
        super().__init__()
        self.local, self.glob, self.mix = local, glob, alpha

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return functional_call(self.local, mixture(self.local, self.glob, self.mix.project()), (x,))


class APFLClient(GlobalCopyClient[APFLParams]):
    def __init__(self, ctx: ClientContext, params: APFLParams) -> None:
        super().__init__(ctx, params)
        self.alpha = Alpha(params.alpha, params.adaptive)
        self.trained = Flag()
        self.persistent = {"model": self.model, "alpha": self.alpha, "trained": self.trained}
        self.personal = Mixture(self.model, self.global_model, self.alpha)

    def fit(self, trainer: Trainer) -> dict[str, float]:
        if not self.trained.is_set():  # v starts as the global model (PFLlib, FL-bench)
            self.model.load_state_dict(self.global_model.state_dict())
            self.trained.set()
        out = trainer.run(self.training_step, [self.global_model, self.model, self.alpha])
        self.alpha.project()
        return {**out, "alpha": float(self.alpha.alpha.detach())}

    def training_step(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(self.global_model(x), y) + F.cross_entropy(self.personal(x), y)

    def eval_model(self) -> nn.Module:
        return self.personal


ALGORITHMS.add(
    "apfl",
    Algorithm(
        "apfl",
        APFLParams,
        APFLClient,
        GroupServer,
        summary="personal model = learned mixture of local and global weights (per arch group)",
    ),
)
