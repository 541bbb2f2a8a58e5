"""pFedES variant `stats`: statistics-only upload, the third protection of the pFedES design
document (section 5.3: "only upload distillation statistics, not the proxy parameters").

Instead of a proxy extractor, each client uploads the per-class mean soft predictions of its
local model on its own training data, `p_k[c] = mean_{(x, y) in D_k, y = c} softmax(f_k(x) / T)`,
with the per-class counts. The server averages them per class by count and sends the table back;
the local model then distils from it: each sample is pulled towards the federation's mean soft
prediction of its label,

    loss = CE(f(x), y) + alpha * T^2 * KL(P[y] || softmax(f(x) / T))

(samples of classes no client has reported contribute zero). The design document expects
coarser knowledge transfer in exchange for a smaller, more obviously harmless upload.

Relation to FD (`rayfl.algorithms.fd`, Jeong et al. 2018): the same exchange of per-class output
statistics (the payload format and server, `protos.ClassTableServer`, are shared). FD averages raw
logits and pulls with an MSE; this variant averages *temperature-softened probabilities* and
distils with pFedES's KL at temperature T, so its knobs (`T`, `alpha`) are pFedES's and it slots
into pFedES sweeps. Probabilities are bounded (each row sums to one), which also bounds a
client's contribution for DP (`rayfl.privacy`).

Shares: per-class mean soft predictions and counts up (`C x (C + 1)` floats); the global table down.
Keeps local: the whole heterogeneous local model.
Server: per-class count-weighted average of the tables.
"""

from __future__ import annotations

from typing import Protocol, TypeVar

import torch
import torch.nn.functional as F

from rayfl.algorithms import protos
from rayfl.algorithms.base import (
    ClientContext,
    Payload,
    RoundContext,
    ServerContext,
)


class StatsParams(Protocol):
    """What this variant reads of `rayfl.algorithms.pfedes.PFedESParams` (a protocol, so that
    the two modules do not import each other)."""

    @property
    def alpha(self) -> float: ...

    @property
    def T(self) -> float: ...


P = TypeVar("P", bound=StatsParams)


def class_kd_loss(
    logits: torch.Tensor,
    labels: torch.Tensor,
    table: torch.Tensor,
    counts: torch.Tensor,
    temperature: float,
) -> torch.Tensor:
    """`T^2 * KL(table[y] || softmax(logits / T))` per sample, batch mean over every sample;
    `table` holds per-class mean soft predictions, and samples whose class has no entry
    (`counts[y] == 0`) contribute zero."""
    t = float(temperature)
    # Rows are renormalized: a DP-noised table (rayfl.privacy) need not hold distributions.
    target = table[labels].clamp_min(1e-12)
    target = target / target.sum(1, keepdim=True)
    log_student = F.log_softmax(logits / t, dim=1)
    per_sample = (target * (target.log() - log_student)).sum(1)
    known = (counts[labels] > 0).to(per_sample.dtype)
    return (per_sample * known).mean() * (t * t)


class PFedESStatsClient(protos.ClassStatsClient[P]):
    """Trains the local model with CE plus distillation from the received class table; uploads
    the class means of its soft predictions at temperature T, after training."""

    deployed_uses_payload = False  # deploys its local model

    def __init__(self, ctx: ClientContext, params: P) -> None:
        super().__init__(ctx, params)
        c = ctx.num_classes
        self.table, self.counts = torch.zeros(c, c), torch.zeros(c)

    def receive(self, payload: Payload, rnd: RoundContext) -> None:
        self.table, self.counts = protos.stats_tensors(payload, self.ctx.device)

    def training_step(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        p = self.params
        logits = self.model(x)
        loss = F.cross_entropy(logits, y)
        if p.alpha > 0:
            loss = loss + p.alpha * class_kd_loss(logits, y, self.table, self.counts, p.T)
        return loss

    def statistic(self, x: torch.Tensor) -> torch.Tensor:
        return F.softmax(self.model(x) / float(self.params.T), dim=1)


class PFedESStatsServer(protos.ClassTableServer[P]):
    prefix = "pfedes"

    def __init__(self, ctx: ServerContext, params: P) -> None:
        super().__init__(ctx, params, dim=ctx.num_classes)
