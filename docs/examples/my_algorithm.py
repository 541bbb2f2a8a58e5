"""Ditto: Li et al., "Ditto: Fair and Robust Federated Learning Through Personalization"
(ICML 2021; arXiv 2012.04221). The tutorial's algorithm (docs/your_algorithm.md):

    rayfl run docs/examples/ditto_digits.yaml
    rayfl run experiments/pfedes_fmnist.yaml algorithm.name=ditto model.family=homo_cnn_small \
        --plugin docs/examples/my_algorithm.py

Shares: the global model (homogeneous families only), trained locally as in FedAvg.
Keeps local: a personal model, trained with cross-entropy plus lam/2 ||v - w_global||^2.
Server: sample-weighted average of the global models (FedAvg's server).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from rayfl.algorithms.base import (
    Algorithm,
    ClientContext,
    ModelClient,
    Payload,
    RoundContext,
    Trainer,
    load_numpy,
    to_numpy,
)
from rayfl.algorithms.fedavg import FedAvgServer
from rayfl.algorithms.fedprox import proximal_term
from rayfl.errors import require
from rayfl.registry import ALGORITHMS


@dataclass(frozen=True)
class DittoParams:
    """The `algorithm:` keys of a config (`rayfl ls ditto` lists them)."""

    lam: float = 0.1  # pull of the personal model towards the global one (paper: 0.01 to 2)
    personal_epochs: int = 1  # passes over the local data for the personal model per round

    def __post_init__(self) -> None:
        require(self.lam >= 0, "algorithm.lam", f"must be >= 0 (got {self.lam})")
        require(self.personal_epochs >= 1, "algorithm.personal_epochs", "must be >= 1")


class DittoClient(ModelClient[DittoParams]):
    """`self.model` (from ModelClient) is the personal model, kept between rounds; the global
    model is a transient copy, replaced by every broadcast."""

    # It deploys the personal model, whatever the broadcast: a client that did not train since
    # its last score keeps it (the deployed evaluation skips it). Leave it out when unsure.
    deployed_uses_payload = False

    def __init__(self, ctx: ClientContext, params: DittoParams) -> None:
        super().__init__(ctx, params)  # persistent = {"model": the personal model}
        self.global_model = copy.deepcopy(self.model)
        self.anchors: list[torch.Tensor] = []

    def receive(self, payload: Payload, rnd: RoundContext) -> None:
        load_numpy(self.global_model, payload)
        # the received global weights, frozen: the personal model is pulled towards them
        self.anchors = [p.detach().clone() for p in self.global_model.parameters()]

    def fit(self, trainer: Trainer) -> dict[str, float]:
        # 1. FedAvg's local step on the global copy (what the server averages)
        trainer.run(lambda x, y: F.cross_entropy(self.global_model(x), y), [self.global_model])
        # 2. the personal model: cross-entropy plus the proximal pull
        return trainer.run(self.training_step, [self.model], epochs=self.params.personal_epochs)

    def training_step(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = F.cross_entropy(self.model(x), y)
        if self.anchors:  # empty before the first broadcast
            params = list(self.model.parameters())
            loss = loss + proximal_term(params, self.anchors, self.params.lam)
        return loss

    def upload(self) -> Payload:
        return to_numpy(self.global_model.state_dict())


ALGORITHMS.add(
    "ditto",
    Algorithm(
        "ditto",
        DittoParams,
        DittoClient,
        FedAvgServer,
        needs_homogeneous=True,
        summary="personal models pulled towards a FedAvg global model (Li et al. 2021)",
    ),
)
