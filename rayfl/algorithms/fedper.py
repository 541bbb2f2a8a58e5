"""FedPer: Arivazhagan et al., "Federated Learning with Personalization Layers" (arXiv 1912.00818).

Code followed: PFLlib `system/flcore/clients/clientper.py` and `servers/serverper.py` (the whole
model trained with cross-entropy, only the base uploaded, averaged and loaded); FL-bench `fedper`.

Shares: the feature extractor (`model.encoder`), both ways.
Keeps local: the head (the personalization layers); the personalized model is the client's
model after local training.
Server: per architecture, the sample-weighted average of its clients' extractors
(`rayfl.algorithms.groups`).

Deviations: none with one architecture.
"""

from __future__ import annotations

from rayfl.algorithms.base import ALGORITHMS, Algorithm, NoParams, P
from rayfl.algorithms.groups import GroupClient, GroupServer


class FedPerClient(GroupClient[P]):
    part = "extractor"


class FedPerServer(GroupServer[P]):
    part = "extractor"
    scored = False  # the server's head is its untrained initialization


ALGORITHMS.add(
    "fedper",
    Algorithm(
        "fedper",
        NoParams,
        FedPerClient,
        FedPerServer,
        summary="shared extractor, personal head (per architecture group)",
    ),
)
