"""FedRep: Collins et al., "Exploiting Shared Representations for Personalized Federated
Learning" (ICML 2021; arXiv 2102.07078).

Each round a client first trains its head with the received extractor frozen, then the
extractor with the new head frozen, and uploads the extractor.

Code followed: PFLlib `system/flcore/clients/clientrep.py` (head for `plocal_epochs`, then base
for `local_epochs`, two SGD optimizers); FL-bench `fedrep` (`train_body_epoch`).

Shares: the feature extractor (`model.encoder`), both ways.
Keeps local: the head; the personalized model is the client's model after both phases.
Server: per architecture, the sample-weighted average of its clients' extractors
(`rayfl.algorithms.groups`).

Defaults: `head_epochs=1` (PFLlib's `plocal_epochs` default; the paper runs more head than body
updates per round: raise `algorithm.head_epochs`); the body trains for `train.local_epochs`.
Deviations: one optimizer per phase built by the engine from `train:` (PFLlib keeps two SGD
optimizers alive across rounds; with plain SGD they are the same).
"""

from __future__ import annotations

from dataclasses import dataclass

from rayfl.algorithms.base import ALGORITHMS, Algorithm, CheckedParams, Trainer
from rayfl.algorithms.groups import GroupClient, GroupServer, frozen
from rayfl.schema import setting


@dataclass(frozen=True)
class FedRepParams(CheckedParams):
    head_epochs: int = setting(
        1, "passes training the head (extractor frozen) before the extractor's", ge=1
    )


class FedRepClient(GroupClient[FedRepParams]):
    part = "extractor"

    def fit(self, trainer: Trainer) -> dict[str, float]:
        with frozen(self.model.encoder):
            head = trainer.run(self.training_step, [self.model], epochs=self.params.head_epochs)
        with frozen(self.model.head):
            body = trainer.run(self.training_step, [self.model])
        return {**body, "head_loss": head["loss"]}


class FedRepServer(GroupServer[FedRepParams]):
    part = "extractor"
    scored = False  # the server's head is its untrained initialization


ALGORITHMS.add(
    "fedrep",
    Algorithm(
        "fedrep",
        FedRepParams,
        FedRepClient,
        FedRepServer,
        summary="shared extractor; head trained first, then extractor (per architecture group)",
    ),
)
