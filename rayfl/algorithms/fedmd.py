"""FedMD: Li and Wang, "FedMD: Heterogenous Federated Learning via Model Distillation"
(NeurIPS 2019 workshop; arXiv 1910.03581).

Every party holds a private model of its own architecture; they communicate through class
scores (logits) on a shared public set. One rayfl round of a client is FedMD's cycle:

    digest:  fit the received consensus scores on the public set (L1 or MSE on logits) for
             `digest_epochs`;
    revisit: train on the private data with CE (the engine's loop, `train.local_epochs`);
    communicate: upload the model's logits on the public set.

The server's consensus is the plain average of the uploaded scores (as in the paper).

Engine limits worked around here (an engine change would lift them): clients cannot
read the public split and the server only sees it in `update`, after round one's broadcast.
So the server sends the public inputs down with the consensus (counted in `comm/bytes_down`,
which overstates FedMD's cost: the paper assumes the public set is already on every device),
round one only revisits, and the first digest happens in round three. The paper's warm-up
(transfer learning on the labelled public set) is not done.

Shares: logits on the first `public_samples` public inputs up; consensus (and the inputs) down.
Keeps local: the whole model (the personalized model).
Server: plain average of the clients' public-set logits.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import torch
import torch.nn.functional as F

from rayfl.algorithms.base import (
    Algorithm,
    Client,
    ClientContext,
    Payload,
    Reply,
    Server,
    ServerContext,
    ServerData,
    Trainer,
)
from rayfl.errors import require
from rayfl.models import build_model
from rayfl.registry import ALGORITHMS


@dataclass(frozen=True)
class FedMDParams:
    public_samples: int = 500  # the first this many public samples are the shared set
    digest_epochs: int = 1  # passes over the public set fitting the consensus
    digest_loss: Literal["l1", "mse"] = "l1"  # l1: the paper's code (mean absolute error on logits)
    digest_lr: float | None = None  # None: train.lr

    def __post_init__(self) -> None:
        require(self.public_samples >= 1, "algorithm.public_samples", "must be at least 1")
        require(self.digest_epochs >= 0, "algorithm.digest_epochs", "must be >= 0")
        require(
            self.digest_lr is None or self.digest_lr > 0,
            "algorithm.digest_lr",
            "must be > 0 or null",
        )


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


class FedMDClient(Client):
    def __init__(self, ctx: ClientContext, params: FedMDParams) -> None:
        super().__init__(ctx, params)
        self.model = build_model(ctx.arch, ctx.in_shape, ctx.num_classes)
        self.persistent = {"model": self.model}
        self.public_x: torch.Tensor | None = None
        self.consensus: torch.Tensor | None = None

    def receive(self, payload: Payload) -> None:
        device = self.ctx.device
        self.public_x = (
            torch.as_tensor(np.array(payload["public_x"]), device=device)
            if "public_x" in payload
            else None
        )
        has = "consensus" in payload
        self.consensus = (
            torch.as_tensor(np.array(payload["consensus"]), device=device) if has else None
        )

    def fit(self, trainer: Trainer) -> dict[str, float]:
        metrics: dict[str, float] = {}
        if (
            self.public_x is not None
            and self.consensus is not None
            and self.params.digest_epochs > 0
        ):
            metrics["fedmd/digest_loss"] = self._digest()
        metrics.update(trainer.run(self.training_step, [self.model]))
        return metrics

    def _digest(self) -> float:
        assert self.public_x is not None and self.consensus is not None
        t, p = self.ctx.train, self.params
        lr = t.lr if p.digest_lr is None else p.digest_lr
        optimizer: torch.optim.Optimizer
        if t.optimizer == "adam":
            optimizer = torch.optim.Adam(
                self.model.parameters(), lr=lr, weight_decay=t.weight_decay
            )
        else:
            optimizer = torch.optim.SGD(
                self.model.parameters(), lr=lr, momentum=t.momentum, weight_decay=t.weight_decay
            )
        self.model.train()
        n = len(self.public_x)
        total = 0.0
        for _ in range(p.digest_epochs):
            total = 0.0
            order = torch.randperm(n, device=self.public_x.device)
            for start in range(0, n, t.batch_size):
                idx = order[start : start + t.batch_size]
                loss = digest_loss(
                    self.model(self.public_x[idx]), self.consensus[idx], p.digest_loss
                )
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                optimizer.step()
                total += float(loss.detach()) * len(idx)
        return total / n

    def training_step(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(self.model(x), y)

    @torch.no_grad()
    def upload(self) -> Payload:
        if self.public_x is None:
            return {}
        self.model.eval()
        scores = torch.cat(
            [self.model(chunk) for chunk in self.public_x.split(self.ctx.train.eval_batch_size)]
        )
        return {"scores": scores.float().cpu().numpy()}


class FedMDServer(Server):
    def __init__(self, ctx: ServerContext, params: FedMDParams) -> None:
        super().__init__(ctx, params)
        self.public_x: np.ndarray | None = None
        self.consensus: np.ndarray | None = None

    def broadcast(self, arch: str) -> Payload:
        out: Payload = {}
        if self.public_x is not None:
            out["public_x"] = self.public_x
        if self.consensus is not None:
            out["consensus"] = self.consensus
        return out

    def aggregate(self, replies: Sequence[Reply], round_idx: int) -> dict[str, float]:
        scores = [r.payload["scores"] for r in replies if "scores" in r.payload]
        if scores:
            self.consensus = consensus(scores)
        return {}

    def update(self, data: ServerData, round_idx: int) -> dict[str, float]:
        if self.public_x is None:
            chunks, seen = [], 0
            for x, _ in data.batches("public"):
                chunks.append(x.cpu().numpy())
                seen += len(x)
                if seen >= self.params.public_samples:
                    break
            if chunks:
                self.public_x = np.concatenate(chunks)[: self.params.public_samples].astype(
                    np.float32
                )
        return {}

    def state_dict(self) -> dict[str, Any]:
        return {"public_x": self.public_x, "consensus": self.consensus}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.public_x = None if state.get("public_x") is None else np.array(state["public_x"])
        self.consensus = None if state.get("consensus") is None else np.array(state["consensus"])


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
