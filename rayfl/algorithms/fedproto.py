"""FedProto: Tan et al., "FedProto: Federated Prototype Learning across Heterogeneous Clients"
(AAAI 2022; arXiv 2105.00243).

Clients share class prototypes (mean representations) instead of weights; each client's
representation of a sample is pulled towards the federation's prototype of its label:

    loss = CE(f(x), y) + lambda * MSE(features(x), P[y])

`MSE` is a mean over the batch and the feature dimensions, as `nn.MSELoss` in the official code
(classes without a global prototype contribute zero, see `protos.masked_class_mse`). Prototypes
are compared across architectures, so every model must have the same feature size.

Shares: per-class mean features and per-class counts up (`C x (D + 1)` floats); the global
prototypes down.
Keeps local: the whole model. As in the paper and HtFLlib (`system/flcore/clients/
clientproto.py:73-95`, argmin of the distance to each global prototype) it deploys the class of
the nearest global prototype (`predict: prototype`, the default); `predict: head` deploys its own
head instead (no prototype needed at inference; what FedProto tables that score the head report).
Server: per-class average of the client prototypes.

Two choices of the official code (yuetan031/FedProto `lib/update.py` `update_weights_het`,
`lib/utils.py` `proto_aggregation`) are options, with the official behaviour as default:
- `collect: train` (default): a client's prototypes are the means of the representations its
  model computed *during* local training (train mode, before each step's update), as the
  official code and HtFLlib's `clientproto.py` do. rayfl averages over every step of the round,
  as HtFLlib does; the official code keeps the last local epoch only (the same at
  `local_epochs: 1`, both papers' setting).
  `collect: after`: one eval-mode pass over the training split after training (the prototypes
  of the model as trained).
- `average: clients` (default): each class's global prototype is the unweighted mean over the
  clients that hold the class (official `proto_aggregation`). The client uploads 0/1 presence as
  its counts, so the server's count-weighted average is that mean, and privacy's `class_means`
  sum form protects it unchanged. `average: samples`: weighted by the clients' class counts.

`lam` defaults to 1, the official FedProto code's `--ld` default (README "Options"; its MNIST
and FEMNIST commands use 1, CIFAR-10 0.1). HtFLlib's `total.sh` runs FedProto with `-lam 10`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from rayfl.algorithms import protos
from rayfl.algorithms.base import (
    ALGORITHMS,
    Algorithm,
    CheckedParams,
    ServerContext,
)
from rayfl.models import build_model
from rayfl.schema import setting


@dataclass(frozen=True)
class FedProtoParams(CheckedParams):
    lam: float = setting(
        1.0, "weight of the prototype distance (the paper's lambda; official default 1)"
    )
    predict: Literal["head", "prototype"] = setting(
        "prototype",
        "what the client deploys: the nearest global prototype (the paper's and the official code's inference; HtFLlib scores FedProto this way) or its own head",
    )
    collect: Literal["train", "after"] = setting(
        "train",
        "prototypes from the representations of the training steps (official) or from a pass after",
    )
    average: Literal["clients", "samples"] = setting(
        "clients",
        "global prototype: unweighted mean over clients (official) or weighted by class counts",
    )


class FedProtoClient(protos.ClassTableClient[FedProtoParams]):
    @classmethod
    def deploys_payload(cls, params: FedProtoParams) -> bool:
        return params.predict == "prototype"  # its own head needs no global prototype

    def loss_from(self, values: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return self.loss(values, y)

    def loss(self, features: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """CE of the head on `features` plus `lam` times their distance to the global prototypes."""
        loss = F.cross_entropy(self.model.head(features), y)
        if self.params.lam > 0:
            loss = loss + self.params.lam * protos.masked_class_mse(
                features, y, self.global_table, self.global_counts
            )
        return loss

    def eval_model(self) -> nn.Module:
        if self.params.predict == "prototype":
            return protos.NearestPrototype(self.model, self.global_table, self.global_counts)
        return self.model


class FedProtoServer(protos.ClassTableServer[FedProtoParams]):
    prefix = "fedproto"

    def __init__(self, ctx: ServerContext, params: FedProtoParams) -> None:
        dim = build_model(ctx.architectures[0], ctx.in_shape, ctx.num_classes).feature_dim
        super().__init__(ctx, params, dim=dim)


ALGORITHMS.add(
    "fedproto",
    Algorithm(
        "fedproto",
        FedProtoParams,
        FedProtoClient,
        FedProtoServer,
        needs_common_feature_dim=True,
        summary="federated prototype learning (per-class mean features)",
    ),
)
