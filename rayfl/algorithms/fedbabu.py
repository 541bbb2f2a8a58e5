"""FedBABU: Oh, Kim and Yun, "FedBABU: Toward Enhanced Representation for Federated Image
Classification" (ICLR 2022; arXiv 2106.06042).

During federated training only the body (extractor) learns: the head keeps the random
initialization every client received from the server and is never updated or averaged. The
personalized model is the global model fine-tuned on the client's data.

Code followed: PFLlib `system/flcore/clients/clientbabu.py` (head frozen, base trained and
averaged, `fine_tune` of base and head for `fine_tuning_epochs` after the last round) and
`servers/serverbabu.py`; FL-bench `fedbabu` (`finetune_epoch`, at least 1).

Shares: the whole global model down (body plus the fixed head), the trained body up.
Keeps local: the fine-tuned personal model (what is scored and deployed).
Server: per architecture, the sample-weighted average of its clients' bodies into a model whose
head stays at its initialization (`rayfl.algorithms.groups`); that model is scored as `global/acc`.

Defaults: `finetune_epochs=1` (FL-bench's floor; PFLlib fine-tunes 10 epochs once, after the
last round) at `finetune_lr = train.lr` (PFLlib's one optimizer). Trained under a fixed head, the
body's features grow, and a first fine-tuning step of the head at the training rate can undo
much of it (digits, cnn_small, lr 0.05: personalized accuracy 0.63 against 0.92 without
fine-tuning, 0.91 with `finetune_lr=0.005`): lower `algorithm.finetune_lr` then. Deviation: the fine-tuning (the whole model, as PFLlib's default) runs after every
round's training on a copy, since rayfl scores the personalized model every round; the body
uploaded is the one before fine-tuning, so the federation itself is unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.nn.functional as F

from rayfl.algorithms.base import (
    ALGORITHMS,
    Algorithm,
    CheckedParams,
    Trainer,
)
from rayfl.algorithms.groups import GlobalCopyClient, GroupServer, frozen
from rayfl.schema import setting


@dataclass(frozen=True)
class FedBABUParams(CheckedParams):
    finetune_epochs: int = setting(
        1, "passes fine-tuning the whole received model into the personal one"
    )
    finetune_lr: float | None = setting(
        None, "learning rate of that fine-tuning (None: train.lr)", gt=0
    )


class FedBABUClient(GlobalCopyClient[FedBABUParams]):
    """`self.model` is the fine-tuned personal model (kept); `self.global_model` the received
    body and head, trained body-only and uploaded (transient)."""

    deployed_uses_payload = False  # deploys its last fine-tuned model
    part = "extractor"

    def fit(self, trainer: Trainer) -> dict[str, float]:
        g = self.global_model
        with frozen(g.head):
            out = trainer.run(lambda x, y: F.cross_entropy(g(x), y), [g])
        self.model.load_state_dict(g.state_dict())
        if self.params.finetune_epochs:
            p = self.params
            tuned = trainer.run(
                self.training_step, [self.model], p.finetune_epochs, lr=p.finetune_lr
            )
            out["finetune_loss"] = tuned["loss"]
        return out


class FedBABUServer(GroupServer[FedBABUParams]):
    part = "extractor"
    down = "whole"  # the fixed head travels down with the body


ALGORITHMS.add(
    "fedbabu",
    Algorithm(
        "fedbabu",
        FedBABUParams,
        FedBABUClient,
        FedBABUServer,
        summary="body-only federated training, fixed random head, local fine-tuning",
    ),
)
