"""FedRoD: Chen and Chao, "On Bridging Generic and Personalized Federated Learning for Image
Classification" (ICLR 2022; arXiv 2107.00778).

One extractor with two heads: the generic head, trained with the balanced softmax loss
(logits shifted by the log of the client's class counts) and averaged like FedAvg, and a
personal head on the detached features, trained with cross-entropy on the SUM of both heads'
logits (the generic ones detached). The personalized prediction is that sum.

Code followed: PFLlib `system/flcore/clients/clientrod.py` (`balanced_softmax_loss`, the two
optimizers, `out_g.detach() + out_p`); FL-bench `fedrod` (its hypernetwork variant, off by
default there, is not implemented).

Shares: the extractor and the generic head (the whole `SplitModel`), both ways.
Keeps local: the personal head, which starts as a copy of the generic head of the first
broadcast the client receives (PFLlib `clientrod.py:15` and FL-bench copy the generic head of
the common initial model; with every client in the first round that is the same head).
Server: per architecture, the sample-weighted average of the models (`rayfl.algorithms.groups`);
scored as `global/acc`.

Deviations: one optimizer over both heads' disjoint losses (their gradients never meet, so with
SGD it equals PFLlib's two); the class counts are recounted from the client's train split each
round rather than kept; a client first sampled after round 1 starts its personal head from that
round's generic head (PFLlib: the initial one). A class absent from the client has count 0 and
log-count -inf, as in PFLlib: its shifted logit vanishes from the softmax.
"""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import nn

from rayfl.algorithms.base import (
    ALGORITHMS,
    Algorithm,
    ClientContext,
    NoParams,
    Payload,
    RoundContext,
    Trainer,
)
from rayfl.algorithms.groups import Flag, GroupClient, GroupServer
from rayfl.models.base import SplitModel


def balanced_softmax_loss(
    logits: torch.Tensor, labels: torch.Tensor, class_counts: torch.Tensor
) -> torch.Tensor:
    """Ren et al.'s balanced softmax: cross-entropy of `logits + log(class_counts)`, batch mean."""
    return F.cross_entropy(logits + class_counts.to(logits).log(), labels)


class TwoHeads(nn.Module):
    """The personalized model: `generic.head(f) + personal(f)` with `f = generic.features(x)`."""

    def __init__(self, generic: SplitModel, personal: nn.Module) -> None:
        super().__init__()
        self.generic = generic
        self.personal = personal

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rep = self.generic.features(x)
        return self.generic.head(rep) + self.personal(rep)


class FedRoDClient(GroupClient[NoParams]):
    """`self.model` (extractor + generic head) comes from the broadcast each round; the personal
    head is the client's state."""

    def __init__(self, ctx: ClientContext, params: NoParams) -> None:
        super().__init__(ctx, params)
        self.personal_head = copy.deepcopy(self.model.head)
        self.started = Flag()  # set once the personal head has trained
        self.persistent = {"personal_head": self.personal_head, "started": self.started}
        self.counts = torch.ones(ctx.num_classes)

    def receive(self, payload: Payload, rnd: RoundContext) -> None:
        super().receive(payload, rnd)
        if not self.started.is_set():  # the personal head starts as the generic head
            self.personal_head.load_state_dict(self.model.head.state_dict())

    def fit(self, trainer: Trainer) -> dict[str, float]:
        self.started.set()
        labels = torch.cat([y for _, y in trainer.batches("train")])
        self.counts = torch.bincount(labels, minlength=self.ctx.num_classes).float()
        return trainer.run(self.training_step, [self.model, self.personal_head])

    def training_step(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        rep = self.model.features(x)
        out_g = self.model.head(rep)
        generic = balanced_softmax_loss(out_g, y, self.counts)
        personal = F.cross_entropy(out_g.detach() + self.personal_head(rep.detach()), y)
        return generic + personal

    def eval_model(self) -> nn.Module:
        return TwoHeads(self.model, self.personal_head)


ALGORITHMS.add(
    "fedrod",
    Algorithm(
        "fedrod",
        NoParams,
        FedRoDClient,
        GroupServer,
        summary="generic head (balanced softmax, shared) + personal head (per architecture group)",
    ),
)
