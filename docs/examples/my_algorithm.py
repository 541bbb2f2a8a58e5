"""MOON: Li, He and Song, "Model-Contrastive Federated Learning" (CVPR 2021; arXiv 2103.16257).
The tutorial's algorithm (docs/your_algorithm.md):

    rayfl run docs/examples/moon_digits.yaml
    rayfl run experiments/pfedes_fmnist.yaml algorithm.name=moon model.architectures=[cnn_small] \
        --plugin docs/examples/my_algorithm.py

FedAvg whose local training also pulls each sample's features towards the global model's and
away from the client's previous local model's: `CE + mu * l_con`, with
`l_con = -log(e^{sim(z, z_glob)/T} / (e^{sim(z, z_glob)/T} + e^{sim(z, z_prev)/T}))`
and `sim` the cosine similarity of the features.

Shares: the whole model (homogeneous families only), trained locally and averaged as in FedAvg.
Keeps local: the model it trained last, the "previous model" of its next round and what it
deploys (a client's first round contrasts with its own initial model).
Server: sample-weighted average of the models (FedAvg's server).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from rayfl.algorithms import ALGORITHMS
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
from rayfl.errors import require
from rayfl.schema import setting


@dataclass(frozen=True)
class MoonParams:
    """The `algorithm:` keys of a config (`rayfl ls moon` lists them)."""

    mu: float = setting(1.0, "weight of the model-contrastive loss (paper: 1 or 5 by data set)")
    temperature: float = setting(0.5, "temperature T of the cosine similarities (paper: 0.5)")

    def __post_init__(self) -> None:
        require(self.mu >= 0, "algorithm.mu", f"must be >= 0 (got {self.mu})")
        require(self.temperature > 0, "algorithm.temperature", "must be > 0")


class MoonClient(ModelClient[MoonParams]):
    """`self.model` (from ModelClient) is the client's local model, kept between rounds; the
    global and previous models are transient copies, rebuilt every round."""

    # It deploys the model it trained last, whatever the broadcast: a client that did not train
    # since its last score keeps it (the deployed evaluation skips it). Leave it out when unsure.
    deployed_uses_payload = False

    def __init__(self, ctx: ClientContext, params: MoonParams) -> None:
        super().__init__(ctx, params)  # persistent = {"model": the local model}
        self.global_model = copy.deepcopy(self.model)
        self.previous = copy.deepcopy(self.model)

    def receive(self, payload: Payload, rnd: RoundContext) -> None:
        load_numpy(self.global_model, payload)

    def fit(self, trainer: Trainer) -> dict[str, float]:
        # the last local model becomes the previous one; training starts from the global model
        self.previous.load_state_dict(self.model.state_dict())
        self.model.load_state_dict(self.global_model.state_dict())
        self.global_model.eval()
        self.previous.eval()
        return trainer.run(self.training_step, [self.model])

    def training_step(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        z = self.model.features(x)
        with torch.no_grad():  # both anchors are constants
            z_glob = self.global_model.features(x)
            z_prev = self.previous.features(x)
        t = self.params.temperature
        sims = torch.stack(
            [F.cosine_similarity(z, z_glob, dim=1), F.cosine_similarity(z, z_prev, dim=1)], dim=1
        )
        # cross-entropy with the global model's features as the positive (column 0)
        contrastive = F.cross_entropy(
            sims / t, torch.zeros(len(x), dtype=torch.long, device=x.device)
        )
        return F.cross_entropy(self.model.head(z), y) + self.params.mu * contrastive

    def upload(self) -> Payload:
        return to_numpy(self.model.state_dict())


ALGORITHMS.add(
    "moon",
    Algorithm(
        "moon",
        MoonParams,
        MoonClient,
        FedAvgServer,
        needs_homogeneous=True,
        summary="FedAvg with a model-contrastive loss on the features (Li et al. 2021)",
    ),
)
