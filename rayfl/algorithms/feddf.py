"""FedDF: Lin et al., "Ensemble Distillation for Robust Model Fusion in Federated Learning"
(NeurIPS 2020; arXiv 2006.07242).

The FedFD server (`rayfl.algorithms.fedfd`) with averaged-logit distillation: after HeteroFL's
sliced aggregation, the global model learns `T^2 KL(softmax(teacher / T) || softmax(g(x) / T))`
on the public split, the teacher being the mean of the round's client models' logits.

This is FedDF as the FedFD paper compares it, not the official FedDF code's own recipe
(epfml/federated-learning-public-code, `codes/FedDF-code/pcode/aggregation/
noise_knowledge_transfer.py`): that server distils one prototype model per architecture with
Adam at 1e-3 under a cosine schedule over up to 10,000 batches of 128, clips gradients at 5,
scores a labelled validation set every 100 batches, stops after 1,000 without gain and keeps
the best model. Here the single global model is distilled for `steps` minibatches per round by
the FedFD server's optimizer, and clients get its slices. The official recipe is a set of
options: `optimizer: adam`, `lr: 0.001`, `batch_size: 128`, `steps: 10000`, `schedule: cosine`,
`patience: 1000`, `eval_every: 100` (`grad_clip` 5 is not exposed). Its validation set is the
server's public split with its labels, the one it distils on (rayfl's server has no other
labelled data), and because the engine's minibatch loop builds its optimizer per call, Adam's
moments restart every `eval_every` steps and the cosine learning rate is held constant within
each chunk.

Shares: the client's slice of the global model (down), the trained slice (up).
Keeps local: nothing.
Server: per-entry sliced averaging (HeteroFL), then ensemble logit distillation.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch

from rayfl.algorithms.base import ALGORITHMS, Algorithm, ServerData
from rayfl.algorithms.fedfd import FedFDClient, FedFDParams, FedFDServer, check_fedfd_family
from rayfl.schema import setting


@dataclass(frozen=True)
class FedDFParams(FedFDParams):
    """FedFD's parameters with averaged-logit distillation by default, plus the official FedDF
    code's schedule and early stopping (off by default).
    """

    distill: Literal["feature", "logit", "both"] = setting(
        "logit", "`feature` (FedFD), `logit` (FedDF's averaged logits) or `both`"
    )
    schedule: Literal["constant", "cosine"] = setting(
        "constant", "`constant`, or `cosine` annealing of `lr` to 0 over `steps` (official)"
    )
    patience: int | None = setting(
        None,
        "stop when the public-split accuracy has not improved for this many steps and keep the best model (official: 1000); null runs all `steps`",
        ge=1,
    )
    eval_every: int = setting(
        100, "steps between two accuracy checks when `patience` is set (official: 100)", ge=1
    )


def cosine_lr(lr: float, done: int, total: int) -> float:
    """`CosineAnnealingLR`'s rate after `done` of `total` steps (to 0 at the end)."""
    return lr * 0.5 * (1.0 + math.cos(math.pi * done / total))


class FedDFServer(FedFDServer):
    """The FedFD server with FedDF's averaged-logit distillation (its metrics under `feddf/`)."""

    metric_prefix = "feddf"

    @torch.no_grad()
    def public_accuracy(self, data: ServerData) -> float:
        """Accuracy of the global model on the labelled public split (the validation score)."""
        self.model.eval()
        right = seen = 0
        for x, y in data.batches("public"):
            right += int((self.model(x).argmax(1) == y).sum())
            seen += len(y)
        return right / max(seen, 1)

    def distil(
        self,
        data: ServerData,
        step: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
        tensors: tuple[torch.Tensor, torch.Tensor],
        size: int,
        steps: int | None = None,
        lr: float | None = None,
    ) -> dict[str, float]:
        p = self.params
        assert isinstance(p, FedDFParams)
        if p.patience is None and p.schedule == "constant":
            return super().distil(data, step, tensors, size)
        chunk = p.eval_every if p.patience is not None else p.steps
        # as the official tracker: the first check is the first best (the start is not a candidate)
        best, best_at, done = -1.0, 0, 0
        kept = None
        while done < p.steps:
            n = min(chunk, p.steps - done)
            rate = cosine_lr(p.lr, done, p.steps) if p.schedule == "cosine" else p.lr
            super().distil(data, step, tensors, size, steps=n, lr=rate)
            done += n
            if p.patience is None:
                continue
            acc = self.public_accuracy(data)
            if acc > best:
                best, best_at = acc, done
                kept = copy.deepcopy((self.model.state_dict(), self.projections.state_dict()))
            elif done - best_at >= p.patience:
                break
        if kept is not None:  # the official code returns the best model on validation
            self.model.load_state_dict(kept[0])
            self.projections.load_state_dict(kept[1])
        return {"steps": float(done), "best_step": float(best_at)}


ALGORITHMS.add(
    "feddf",
    Algorithm(
        "feddf",
        FedDFParams,
        FedFDClient,
        FedDFServer,
        needs_public=True,
        summary="HeteroFL slices + server averaged-logit ensemble distillation (FedDF-style)",
        check_archs=check_fedfd_family,
    ),
)
