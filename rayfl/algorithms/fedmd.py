"""FedMD: Li and Wang, "FedMD: Heterogenous Federated Learning via Model Distillation"
(NeurIPS 2019 workshop; arXiv 1910.03581).

Every party holds a private model of its own architecture; they communicate through class
scores (logits) on a public set every party has (the federation's labelled public split, read
through `trainer.batches("public")`). One rayfl round of a client is FedMD's cycle:

    digest:  fit the received consensus scores on the public set (L1 or MSE on logits) for
             `digest_epochs` (the engine's loop with per-sample targets);
    revisit: train on the private data with CE (the engine's loop, `train.local_epochs`);
    communicate: upload the model's logits on the first `public_samples` public samples.

Round one has no consensus yet, so it only revisits and communicates. The server's consensus is
the plain average of the uploaded scores (as in the paper). The paper's warm-up (transfer
learning on the labelled public set) is not done.

Shares: logits on the first `public_samples` public inputs up; their consensus down.
Keeps local: the whole model (the personalized model).
Server: plain average of the clients' public-set logits.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch
import torch.nn.functional as F

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
)
from rayfl.schema import setting


@dataclass(frozen=True)
class FedMDParams(CheckedParams):
    public_samples: int = setting(
        5000,
        "the first this many public samples are the shared set (all of them when the split is smaller): 5000, the official code's N_alignment (diogenes0319/FedMD_clean conf/*.json), which draws a fresh random 5000 each round where rayfl keeps the same ones",
        ge=1,
    )
    digest_epochs: int = setting(
        1, "passes fitting the consensus (official N_logits_matching_round 1)"
    )
    digest_loss: Literal["l1", "mse"] = setting(
        "l1", "l1: the paper's code (mean absolute error on logits)"
    )
    digest_lr: float | None = setting(None, "None: train.lr", gt=0)


def consensus(scores: Sequence[np.ndarray]) -> np.ndarray:
    """The plain average of the parties' score matrices (public samples x classes)."""
    if not scores:
        raise ValueError("no scores to average")
    return np.mean(np.stack([np.asarray(s, dtype=np.float64) for s in scores]), axis=0).astype(
        np.float32
    )


def digest_loss(logits: torch.Tensor, target: torch.Tensor, kind: str) -> torch.Tensor:
    """Distance of a batch of logits to the consensus scores: mean absolute or squared error."""
    return F.l1_loss(logits, target) if kind == "l1" else F.mse_loss(logits, target)


class FedMDClient(ModelClient[FedMDParams]):
    deployed_uses_payload = False  # deploys its local model

    def __init__(self, ctx: ClientContext, params: FedMDParams) -> None:
        super().__init__(ctx, params)
        self.consensus: torch.Tensor | None = None
        self.scores: np.ndarray | None = None

    def receive(self, payload: Payload, rnd: RoundContext) -> None:
        has = "consensus" in payload
        self.consensus = torch.from_numpy(np.array(payload["consensus"])) if has else None

    def fit(self, trainer: Trainer) -> dict[str, float]:
        p = self.params
        metrics: dict[str, float] = {}
        if self.consensus is not None and p.digest_epochs > 0:
            digest = trainer.run(
                self._digest_step,
                [self.model],
                epochs=p.digest_epochs,
                lr=p.digest_lr,
                split="public",
                targets=self.consensus,
            )
            metrics["fedmd/digest_loss"] = digest["loss"]
        metrics.update(trainer.run(self.training_step, [self.model]))
        self.scores = self._public_scores(trainer)
        return metrics

    def _digest_step(self, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return digest_loss(self.model(x), target, self.params.digest_loss)

    @torch.no_grad()
    def _public_scores(self, trainer: Trainer) -> np.ndarray:
        self.model.eval()
        chunks, seen = [], 0
        for x, _ in trainer.batches("public"):
            chunks.append(self.model(x).float().cpu())
            seen += len(x)
            if seen >= self.params.public_samples:
                break
        return torch.cat(chunks)[: self.params.public_samples].numpy()

    def upload(self) -> Payload:
        return {} if self.scores is None else {"scores": self.scores}


class FedMDServer(Server[FedMDParams]):
    state_attrs = ("consensus",)

    def __init__(self, ctx: ServerContext, params: FedMDParams) -> None:
        super().__init__(ctx, params)
        self.consensus: np.ndarray | None = None

    def broadcast(self, arch: str, rnd: RoundContext) -> Payload:
        return {} if self.consensus is None else {"consensus": self.consensus}

    def aggregate(self, replies: Sequence[Reply], rnd: RoundContext) -> dict[str, float]:
        scores = [r.payload["scores"] for r in replies if "scores" in r.payload]
        if scores:
            self.consensus = consensus(scores)
        return {}


ALGORITHMS.add(
    "fedmd",
    Algorithm(
        "fedmd",
        FedMDParams,
        FedMDClient,
        FedMDServer,
        needs_public=True,
        summary="consensus of class scores on a public set: digest then revisit",
    ),
)
