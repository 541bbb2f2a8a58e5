"""FedDF: Lin et al., "Ensemble Distillation for Robust Model Fusion in Federated Learning"
(NeurIPS 2020; arXiv 2006.07242).

The FedFD server (`rayfl.algorithms.fedfd`) with averaged-logit distillation: after HeteroFL's
sliced aggregation, the global model learns `T^2 KL(softmax(teacher / T) || softmax(g(x) / T))`
on the public split, the teacher being the mean of the round's client models' logits.

Deliberate difference from the paper (as in FedFD's comparison): FedDF distils one prototype
model per architecture; here the single global model is distilled and clients get its slices.

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
