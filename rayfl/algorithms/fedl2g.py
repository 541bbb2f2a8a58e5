"""FedL2G: Zhang et al., "FedL2G: Learning to Guide Local Training in Heterogeneous Federated
Learning" (arXiv 2410.06490; also titled "Adaptive Guidance for Local Training in Heterogeneous
Federated Learning"), as implemented in HtFLlib (TsingZ0/HtFLlib
`system/flcore/clients/clientl2g_feat.py`, `clientl2g_logit.py`,
`system/flcore/servers/serverl2g_feat.py`, `serverl2g_logit.py`).

The server holds one guiding vector per class, `g_c`. Clients train their own model with

    loss = CE(f(x), y) + MSE(h(x), g[y])

where `h(x)` is the model's features (`guide: feature`, FedL2G-f) or its logits (`guide: logit`,
FedL2G-l). The guide is *learned to help local training*: each client holds a quiz set out of
its training data. After training, it takes one look-ahead SGD step of that loss on
`study_batches` batches of its other samples (learning rate `train.lr`) and scores the stepped
model by CE on the quiz set; the gradient of that quiz loss with respect to `g`, through the
step, travels up. Only the mixed derivative of the study loss in the model and the guide enters
it (no Hessian in the model's parameters: the paper's first-order property). The server averages
each class's gradient over the clients whose gradient for it is non-zero, clips the whole
gradient to norm `clip` and takes one SGD step of `server_lr` on the guide.
During the first `warm_up_rounds` rounds clients only compute these gradients: the guide is
learned on the untrained models before local training starts.

Shares: the meta-gradient of the guide and which classes it covers up (`C x (D + 1)` floats);
the guiding vectors down.
Keeps local: the whole model (the personalized model is the client's own).
Server: per-class mean of the meta-gradients, clipped, one SGD step on the guiding vectors.

Defaults are HtFLlib's (`system/main.py`: `-slr 0.01 -mdb 1 -mqb 1 -wu 50`; feature guidance is
its FedL2G-feat).

Deviations from HtFLlib:
- the quiz set, held out of local training for good as in the paper and HtFLlib, is the last
  `quiz_batches * batch_size` samples of the client's training split (at most half of them);
  HtFLlib holds out the first ones (rayfl's trainer trains on a prefix of the split). HtFLlib's
  local training visits its batches in a fixed order (`shuffle=False`); rayfl shuffles.
- clients clip their gradients only under `train.grad_clip` (HtFLlib clips at norm 100).
- the look-ahead leaves the model's BatchNorm statistics as they were.
- clients are scored during the warm-up too (HtFLlib skips those rounds' evaluation).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import torch
import torch.nn.functional as F

from rayfl.algorithms import functional as fn
from rayfl.algorithms import protos
from rayfl.algorithms.base import (
    ALGORITHMS,
    Algorithm,
    Batch,
    CheckedParams,
    ClientContext,
    ModelClient,
    Payload,
    Reply,
    RoundContext,
    Server,
    ServerContext,
    Trainer,
)
from rayfl.algorithms.functional import arch_sizes
from rayfl.errors import require
from rayfl.models import SplitModel
from rayfl.schema import setting


@dataclass(frozen=True)
class FedL2GParams(CheckedParams):
    guide: Literal["feature", "logit"] = setting(
        "feature",
        "what the guiding vectors guide: the features (FedL2G-feat) or the logits (FedL2G-logit)",
    )
    server_lr: float = setting(
        0.01, "SGD step size of the guiding vectors (HtFLlib -slr 0.01)", gt=0
    )
    warm_up_rounds: int = setting(
        50, "first rounds with meta-learning only, no local training (-wu 50)"
    )
    study_batches: int = setting(1, "batches of the look-ahead step (HtFLlib -mdb 1)", ge=1)
    quiz_batches: int = setting(1, "batches that score the look-ahead model (HtFLlib -mqb 1)", ge=1)
    clip: float = setting(100.0, "max norm of the aggregated guide gradient (HtFLlib: 100)", gt=0)


def guided_loss(
    features: torch.Tensor, logits: torch.Tensor, y: torch.Tensor, guide: torch.Tensor, kind: str
) -> torch.Tensor:
    """`CE(logits, y) + MSE(h, guide[y])`, `h` the features or the logits (`kind`)."""
    target = features if kind == "feature" else logits
    return F.cross_entropy(logits, y) + F.mse_loss(target, guide[y])


def meta_gradient(
    model: SplitModel,
    guide: torch.Tensor,
    study: Sequence[Batch],
    quiz: Sequence[Batch],
    lr: float,
    kind: str,
) -> tuple[torch.Tensor, float]:
    """The gradient of the quiz loss after one look-ahead SGD step with respect to the guide.

    `theta' = theta - lr * grad_theta mean_b guided_loss(study_b)`, then
    `d/d guide mean_b CE(f_theta'(quiz_b))`, differentiated through the step. The model's
    parameters and buffers are left untouched (the step runs on functional copies). Returns
    `(gradient shaped like guide, the quiz loss)`.
    """
    params = dict(model.named_parameters())
    buffers = {k: b.clone() for k, b in model.named_buffers()}  # BatchNorm stats stay as they were
    guide = guide.detach().clone().requires_grad_(True)

    def forward(weights: Mapping[str, torch.Tensor], x: torch.Tensor) -> tuple[Any, Any]:
        state = {**weights, **buffers}

        def part(prefix: str) -> dict[str, torch.Tensor]:
            return {k[len(prefix) :]: v for k, v in state.items() if k.startswith(prefix)}

        features = torch.func.functional_call(model.encoder, part("encoder."), (x,))
        return features, torch.func.functional_call(model.head, part("head."), (features,))

    pseudo = torch.stack(
        [guided_loss(*forward(params, x), y, guide, kind) for x, y in study]
    ).mean()
    grads = torch.autograd.grad(pseudo, list(params.values()), create_graph=True, allow_unused=True)
    fast = {
        k: v if g is None else v - lr * g for (k, v), g in zip(params.items(), grads, strict=True)
    }
    quiz_loss = torch.stack([F.cross_entropy(forward(fast, x)[1], y) for x, y in quiz]).mean()
    (grad,) = torch.autograd.grad(quiz_loss, guide, allow_unused=True)
    return (torch.zeros_like(guide) if grad is None else grad.detach()), float(quiz_loss.detach())


def split_study_quiz(
    x: torch.Tensor, y: torch.Tensor, study: int, quiz: int, batch_size: int
) -> tuple[int, list[Batch], list[Batch]]:
    """The client's quiz set and this round's study batches.

    The last `quiz * batch_size` samples of the training split (at most half of them) are the
    quiz set, held out of local training; the study batches are the first `study` batches of a
    shuffled pass (torch's seeded RNG) over the other samples. Returns `(number of samples
    local training uses, study batches, quiz batches)`.
    """
    n_quiz = min(quiz * batch_size, len(y) // 2)
    n_train = len(y) - n_quiz
    pick = torch.randperm(n_train)[: study * batch_size].to(x.device)
    return (
        n_train,
        list(zip(x[pick].split(batch_size), y[pick].split(batch_size))),
        list(zip(x[n_train:].split(batch_size), y[n_train:].split(batch_size))),
    )


def guide_dim(params: FedL2GParams, ctx: ServerContext | ClientContext, arch: str) -> int:
    if params.guide == "logit":
        return ctx.num_classes
    return arch_sizes(arch, tuple(ctx.in_shape), ctx.num_classes)[1]


class FedL2GClient(ModelClient[FedL2GParams]):
    deployed_uses_payload = False  # the guide shapes training only; the model is the client's

    def __init__(self, ctx: ClientContext, params: FedL2GParams) -> None:
        super().__init__(ctx, params)
        dim = self.model.feature_dim if params.guide == "feature" else ctx.num_classes
        self.guide = torch.zeros(ctx.num_classes, dim)
        self.rnd = RoundContext(1, 1)
        self.stats: Payload = {}

    def receive(self, payload: Payload, rnd: RoundContext) -> None:
        self.guide = torch.as_tensor(np.array(payload["means"]), device=self.ctx.device)
        self.rnd = rnd

    def training_step(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        features = self.model.features(x)
        logits = self.model.head(features)
        return guided_loss(features, logits, y, self.guide, self.params.guide)

    def fit(self, trainer: Trainer) -> dict[str, float]:
        p = self.params
        x, y = (torch.cat(t) for t in zip(*trainer.batches("train")))
        n_train, study, quiz = split_study_quiz(
            x, y, p.study_batches, p.quiz_batches, self.ctx.train.batch_size
        )
        metrics: dict[str, float] = {}
        if self.rnd.index > p.warm_up_rounds:  # the quiz samples stay out of local training
            metrics = trainer.run(self.training_step, [self.model], targets=y[:n_train])
        grad, quiz_loss = torch.zeros_like(self.guide), float("nan")
        if quiz:  # a client of one sample has nothing to quiz itself on
            self.model.train()
            grad, quiz_loss = meta_gradient(
                self.model, self.guide, study, quiz, self.ctx.train.lr, p.guide
            )
            metrics["fedl2g/quiz_loss"] = quiz_loss
        covered = (grad.abs().sum(1) > 0).to(torch.float32)  # the classes the study batches hold
        self.stats = {
            "means": grad.cpu().numpy().astype(np.float32),
            "counts": covered.cpu().numpy(),
        }
        return metrics

    def upload(self) -> Payload:
        return self.stats


class FedL2GServer(Server[FedL2GParams]):
    sum_form = "class_means"  # a per-class mean over the clients that cover the class
    state_attrs = ("guide",)

    def __init__(self, ctx: ServerContext, params: FedL2GParams) -> None:
        super().__init__(ctx, params)
        dims = {a: guide_dim(params, ctx, a) for a in sorted(set(ctx.architectures))}
        require(
            len(set(dims.values())) == 1,
            "algorithm.guide",
            f"feature guidance needs one feature size, but the family has {dims}; "
            "use algorithm.guide=logit or a family with a common feature size (seed3, cnn5)",
        )
        dim = next(iter(dims.values()))
        # nn.Embedding's initialization, as HtFLlib's guiding vectors (seeded by the engine)
        self.guide = torch.randn(ctx.num_classes, dim).numpy().astype(np.float32)

    def broadcast(self, arch: str, rnd: RoundContext) -> Payload:
        # the guide as a class table, in the uploads' layout (as FedTGP's trained prototypes): the
        # privacy hook sizes the uploads' protected contributions by the broadcast
        counts = np.ones(len(self.guide), dtype=np.float32)
        return {"means": self.guide.copy(), "counts": counts}

    def aggregate(self, replies: Sequence[Reply], rnd: RoundContext) -> dict[str, float]:
        mean = protos.aggregate_class_means([r.payload for r in replies])
        grad = fn.clip_update({"g": mean["means"]}, self.params.clip)["g"]
        self.guide = (self.guide - self.params.server_lr * grad).astype(np.float32)
        return {
            "fedl2g/classes_guided": float(np.count_nonzero(mean["counts"])),
            "fedl2g/grad_norm": float(np.linalg.norm(mean["means"].astype(np.float64))),
        }


ALGORITHMS.add(
    "fedl2g",
    Algorithm(
        "fedl2g",
        FedL2GParams,
        FedL2GClient,
        FedL2GServer,
        summary="class guiding vectors meta-learned so that local training generalizes",
    ),
)
