"""FD (federated distillation): Jeong et al., "Communication-Efficient On-Device Machine Learning:
Federated Distillation and Augmentation under Non-IID Private Data" (NeurIPS 2018 workshop;
arXiv 1811.11479).

Clients share no weights, only their per-class mean logits; a regularizer pulls each sample's
logits towards the federation's mean logits of its label `G[y]`:

    loss = CE(f(x), y) + gamma * D(f(x), G[y])

The defaults are HtFLlib's (TsingZ0/HtFLlib `system/flcore/clients/clientfd.py` and
`system/flcore/servers/serverfd.py`, run as `FD -lam 1` in `system/total.sh`), the code the docs
cite for FD:
- `loss: ce_softmax` (HtFLlib from commit bf60d9a to 17f851e, `clientfd.py:52` there):
  `D` is `nn.CrossEntropyLoss` with the softmax of the label's averaged logits as the soft
  target, `-sum_c softmax(G[y])_c log softmax(f(x))_c` (batch mean). The current HtFLlib
  (commit ca3e29a on, clientfd.py:52) drops the softmax, `loss: ce`: the raw averaged logits
  are the target, which is not bounded below (a negative target entry rewards pushing that
  class's probability to zero); on Fashion-MNIST with HtFLlib's settings every client's model
  turns non-finite by round 3 (docs/results.md, "Peer checks against HtFLlib"), so rayfl keeps
  it as an option and defaults to the bounded version before it. `mse` (HtFLlib up to commit
  cae12a2): `nn.MSELoss(G[y], f(x))`, the squared distance averaged over batch and classes.
  For a sample whose label has no global entry yet, HtFLlib's target is the sample's own detached
  logits (clientfd.py:47-51): zero for `mse`, a self-distillation term for the two CEs; rayfl does
  the same.
- `collect: train` (clientfd.py:54-56, 63): a client's class logits are the means of the logits
  its model computed during local training (train mode, before each step's update, every step of
  the round); `after`: one eval-mode pass over the training split after training.
- `average: clients` (serverfd.py:76-91): each class's global logits are the unweighted mean
  over the clients that hold the class (the client uploads 0/1 presence as its counts, so the
  server's count-weighted average is that mean and privacy's `class_means` form protects it);
  `samples`: weighted by the clients' class counts.
- `gamma` is HtFLlib's `-lam 1`.
The paper distils with a KL on the global logits and leaves out each client's own
contribution; HtFLlib and rayfl include it.

Logits have `num_classes` entries whatever the architecture, so unlike prototype methods FD does
*not* need a common feature size (`needs_common_feature_dim=False`): any family whose models
share the label space works.

Shares: per-class mean logits and per-class counts (or 0/1 presence) up (`C x (C + 1)` floats);
the global per-class logits down.
Keeps local: the whole model (the personalized model).
Server: per-class average of the clients' mean logits (over clients, or by class counts).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F

from rayfl.algorithms import protos
from rayfl.algorithms.base import (
    ALGORITHMS,
    Algorithm,
    CheckedParams,
    ClientContext,
    ServerContext,
)
from rayfl.schema import setting


@dataclass(frozen=True)
class FDParams(CheckedParams):
    gamma: float = setting(1.0, "weight of the distillation term (HtFLlib -lam 1)")
    loss: Literal["ce_softmax", "ce", "mse"] = setting(
        "ce_softmax",
        "distillation term: CE to the softmax of the global logits (HtFLlib until ca3e29a), CE to the raw global logits (HtFLlib since; unbounded, diverges) or MSE (HtFLlib's first)",
    )
    collect: Literal["train", "after"] = setting(
        "train", "class logits of the training steps (HtFLlib) or of an eval pass after training"
    )
    average: Literal["clients", "samples"] = setting(
        "clients",
        "global logits: unweighted mean over clients (HtFLlib) or weighted by class counts",
    )


def distill_term(
    logits: torch.Tensor, y: torch.Tensor, table: torch.Tensor, counts: torch.Tensor, loss: str
) -> torch.Tensor:
    """The distance of each row of `logits` to its label's row of the global `table`; rows whose
    label has no entry (`counts[y] == 0`) take their own detached logits as the target."""
    known = (counts[y] > 0).unsqueeze(1)
    target = torch.where(known, table[y].to(logits.dtype), logits.detach())
    if loss == "mse":
        return F.mse_loss(logits, target)
    if loss == "ce_softmax":
        target = target.softmax(dim=1)
    return F.cross_entropy(logits, target)


class FDClient(protos.ClassTableClient[FDParams]):
    deployed_uses_payload = False  # deploys its local model

    def __init__(self, ctx: ClientContext, params: FDParams) -> None:
        super().__init__(ctx, params, dim=ctx.num_classes)

    def loss_from(self, values: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = F.cross_entropy(values, y)
        # before any class is known HtFLlib adds nothing (its global logits are None)
        if self.params.gamma > 0 and bool((self.global_counts > 0).any()):
            term = distill_term(values, y, self.global_table, self.global_counts, self.params.loss)
            loss = loss + self.params.gamma * term
        return loss

    def statistic(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(x)  # the logits


class FDServer(protos.ClassTableServer[FDParams]):
    prefix = "fd"

    def __init__(self, ctx: ServerContext, params: FDParams) -> None:
        super().__init__(ctx, params, dim=ctx.num_classes)


ALGORITHMS.add(
    "fd",
    Algorithm(
        "fd",
        FDParams,
        FDClient,
        FDServer,
        summary="federated distillation of per-class mean logits",
    ),
)
