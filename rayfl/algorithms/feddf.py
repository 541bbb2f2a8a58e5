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
the FedFD server's optimizer (`optimizer: adam`, `lr: 0.001`, `batch_size: 128` give the
official one; its schedule and early stopping are not implemented) and clients get its slices.

Shares: the client's slice of the global model (down), the trained slice (up).
Keeps local: nothing.
Server: per-entry sliced averaging (HeteroFL), then ensemble logit distillation.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from rayfl.algorithms.base import Algorithm
from rayfl.algorithms.fedfd import FedFDClient, FedFDParams, FedFDServer, check_fedfd_family
from rayfl.registry import ALGORITHMS


@dataclass(frozen=True)
class FedDFParams(FedFDParams):
    """FedFD's parameters with averaged-logit distillation by default."""

    distill: Literal["feature", "logit", "both"] = "logit"


class FedDFServer(FedFDServer):
    """The FedFD server with FedDF's averaged-logit distillation (its metrics under `feddf/`)."""

    metric_prefix = "feddf"


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
