"""FedBN: Li et al., "FedBN: Federated Learning on Non-IID Features via Local Batch Normalization"
(ICLR 2021; arXiv 2102.07623).

Code followed: PFLlib `system/flcore/clients/clientbn.py` (FedAvg whose clients skip the BN
entries of the received model); FL-bench `fedbn`.

Shares: every entry of the model but those of its BatchNorm layers, both ways.
Keeps local: the BatchNorm layers (affine weights and running statistics); the personalized
model is the client's model after local training.
Server: per architecture, the sample-weighted average of its clients' non-BN entries
(`rayfl.algorithms.groups`).

Deviations: BN layers are found by type (`torch.nn` BatchNorm), not by PFLlib's `'bn' in name`;
their running statistics stay local as well (PFLlib moves parameters only, so its buffers
never travel). A model without BatchNorm (`tiny_a`, `cnn_small`) makes FedBN FedAvg.
"""

from __future__ import annotations

from rayfl.algorithms.base import ALGORITHMS, Algorithm, NoParams, P
from rayfl.algorithms.groups import GroupClient, GroupServer


class FedBNClient(GroupClient[P]):
    part = "no_batchnorm"


class FedBNServer(GroupServer[P]):
    part = "no_batchnorm"
    scored = False  # its BN layers are their initialization, never trained


ALGORITHMS.add(
    "fedbn",
    Algorithm(
        "fedbn",
        NoParams,
        FedBNClient,
        FedBNServer,
        summary="FedAvg with local BatchNorm layers (per architecture group)",
    ),
)
