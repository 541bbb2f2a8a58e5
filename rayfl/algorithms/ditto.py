"""Ditto: Li et al., "Ditto: Fair and Robust Federated Learning Through Personalization"
(ICML 2021; arXiv 2012.04221).

Two models per client: a global model trained as in FedAvg and averaged by the server, and a
personal model trained on the client's data with a pull towards the received global one,
`CE(v) + lam/2 ||v - w_global||^2`. The personal model is what the client deploys.

Code followed: PFLlib `system/flcore/clients/clientditto.py` (`ptrain` of the personal model
with `PerturbedGradientDescent` towards the received global model, then `train` of the global
one; `servers/serverditto.py` calls them in that order); FL-bench `ditto` (`lamda`, `pers_epoch`).

Shares: the global model, both ways.
Keeps local: the personal model, a copy of the received global model when the client first
trains.
Server: per architecture, the sample-weighted average of the global models
(`rayfl.algorithms.groups`); scored as `global/acc`.

Defaults: `lam=1.0` (FL-bench's `lamda`; the paper tunes it between 0.01 and 2;
PFLlib's generic `mu` defaults to 0), `personal_epochs=1` (PFLlib's `plocal_epochs`, FL-bench's
`pers_epoch`). Deviation: the pull is a loss term (FedProx's `proximal_term`) under the run's
optimizer, where PFLlib folds it into an SGD step; with plain SGD the update is the same.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from rayfl.algorithms.base import (
    ALGORITHMS,
    Algorithm,
    CheckedParams,
    ClientContext,
    Payload,
    RoundContext,
    Trainer,
)
from rayfl.algorithms.fedprox import proximal_term
from rayfl.algorithms.groups import Flag, GlobalCopyClient, GroupServer
from rayfl.schema import setting


@dataclass(frozen=True)
class DittoParams(CheckedParams):
    lam: float = setting(
        1.0, "pull of the personal model towards the global one (the paper tunes 0.01 to 2)"
    )
    personal_epochs: int = setting(
        1, "passes over the local data for the personal model per round", ge=1
    )


class DittoClient(GlobalCopyClient[DittoParams]):
    """`self.model` is the personal model (kept); `self.global_model` a transient copy replaced
    by every broadcast, trained and uploaded."""

    deployed_uses_payload = False  # deploys the personal model

    def __init__(self, ctx: ClientContext, params: DittoParams) -> None:
        super().__init__(ctx, params)
        self.trained = Flag()
        self.persistent = {"model": self.model, "trained": self.trained}
        self.anchors: list[torch.Tensor] = []

    def receive(self, payload: Payload, rnd: RoundContext) -> None:
        super().receive(payload, rnd)
        # the received global weights, frozen: the personal model is pulled towards them
        self.anchors = [p.detach().clone() for p in self.global_model.parameters()]

    def fit(self, trainer: Trainer) -> dict[str, float]:
        if not self.trained.is_set():  # the personal model starts as the global one (PFLlib)
            self.model.load_state_dict(self.global_model.state_dict())
            self.trained.set()
        personal = trainer.run(self.training_step, [self.model], self.params.personal_epochs)
        g = self.global_model
        out = trainer.run(lambda x, y: F.cross_entropy(g(x), y), [g])
        return {**out, "personal_loss": personal["loss"]}

    def training_step(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = F.cross_entropy(self.model(x), y)
        if self.anchors:  # empty before the first broadcast
            loss = loss + proximal_term(
                list(self.model.parameters()), self.anchors, self.params.lam
            )
        return loss


ALGORITHMS.add(
    "ditto",
    Algorithm(
        "ditto",
        DittoParams,
        DittoClient,
        GroupServer,
        summary="personal models pulled towards a FedAvg global model (per architecture group)",
    ),
)
