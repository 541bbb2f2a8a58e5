"""FML: Shen et al., "Federated Mutual Learning" (arXiv 2006.16765, 2020).

Every client trains its private model and a copy of a small shared "meme" model side by side by
deep mutual learning on each batch:

    private: alpha * CE(private, y) + (1 - alpha) * T^2 KL(meme || private)
    meme:    beta  * CE(meme, y)    + (1 - beta)  * T^2 KL(private || meme)

The defaults are HtFLlib's (TsingZ0/HtFLlib `system/flcore/clients/clientfml.py`, the code the
heterogeneous-FL papers run FML with):
- `kl_reduction: mean`: each KL is `nn.KLDivLoss()` with its default reduction, the mean over
  every entry, so the per-sample KL is also divided by the number of classes (clientfml.py:18,
  47-48). `batchmean` (the per-sample KL, Hinton's scale) is 10x stronger on 10 classes.
- `detach: false`: neither KL's target is detached (clientfml.py:47-48 pass `F.softmax(output_g)`
  and `F.softmax(output)` with their graphs; both losses are backpropagated into the same
  gradients, clientfml.py:52-53), so each KL also trains the model that provides its target.
  `detach: true` makes each loss train its own model only, as in deep mutual learning's paper.
- `weighting: uniform`: the server's meme is the plain mean of the uploaded memes
  (`system/flcore/servers/serverfml.py:80`); `samples` weighs them by training samples (FedAvg).
HtFLlib also clips each model's gradient at norm 10 (clientfml.py:55-56) and uses plain SGD
(clientfml.py:24-25): those are the run's `train.grad_clip: 10` and `train.momentum: 0`.
HtFLlib averages `parameters()` only, so batch-norm statistics of the meme never leave a client;
rayfl averages the whole state dict (the cnn5 and seed3 memes have no batch norm).
Under secure aggregation or DP the server only sees the sample-weighted sum, so there the
average is sample-weighted whatever `weighting` says.

Shares: the meme model's parameters (any registered architecture, `meme`; default: the
federation's architecture with the fewest parameters, e.g. `cnn5` in the cnn5 family).
Keeps local: the private model (the personalized model).
Server: mean of the memes, uniform or sample-weighted (scored on the server test set as
`meme/acc`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F

from rayfl.algorithms import functional as fn
from rayfl.algorithms.base import (
    ALGORITHMS,
    Algorithm,
    AveragingServer,
    CheckedParams,
    ClientContext,
    ModelClient,
    Payload,
    Reply,
    RoundContext,
    ServerContext,
    Trainer,
    load_numpy,
    reply_weights,
    to_numpy,
)
from rayfl.algorithms.functional import arch_sizes
from rayfl.errors import require
from rayfl.models import build_model
from rayfl.models.base import MODELS
from rayfl.models.zoo import AUXILIARY_MODELS
from rayfl.schema import setting


def check_shared_arch(name: str | None, key: str) -> None:
    """A shared model must be a registered classifier (not e.g. the image-to-image `proxy_input`);
    None stands for the family's smallest architecture (`shared_arch`)."""
    require(
        name is None or (name in MODELS and name not in AUXILIARY_MODELS),
        key,
        f"{name!r} is not a registered classifier; pick one from `rayfl ls` (e.g. mlp, cnn_small) "
        "or null for the family's smallest",
    )


def shared_arch(
    name: str | None, archs: Sequence[str], in_shape: tuple[int, ...], num_classes: int
) -> str:
    """The architecture of a shared model (FML's meme, FedKD's mentee): `name`, or with None the
    federation's own architecture with the fewest parameters (ties: the first name), so that a
    CNN family shares one of its CNNs (e.g. `cnn5` in family cnn5) and not an MLP."""
    if name is not None:
        return name
    return min(sorted(archs), key=lambda a: arch_sizes(a, tuple(in_shape), num_classes)[0])


@dataclass(frozen=True)
class FMLParams(CheckedParams):
    meme: str | None = setting(
        None, "shared meme architecture; None: the family's smallest (shared_arch)"
    )
    alpha: float = setting(
        0.5, "private model: weight of CE (1 - alpha on the KL to the meme); paper 0.5", le=1
    )
    beta: float = setting(
        0.5, "meme: weight of CE (1 - beta on the KL to the private model); paper 0.5", le=1
    )
    T: float = setting(1.0, "KL temperature (the paper uses plain softmax, T = 1)", gt=0)
    kl_reduction: Literal["mean", "batchmean"] = setting(
        "mean",
        "KL averaged per entry (HtFLlib's nn.KLDivLoss() default, divides by the classes too) or per sample (batchmean)",
    )
    detach: bool = setting(False, "true: each KL trains its own model only (HtFLlib: both models)")
    weighting: Literal["uniform", "samples"] = setting(
        "uniform", "server mean of the memes (HtFLlib: uniform)"
    )

    def __post_init__(self) -> None:
        check_shared_arch(self.meme, "algorithm.meme")
        super().__post_init__()


def target(logits: torch.Tensor, detach: bool) -> torch.Tensor:
    """A distillation target: detached, or carrying its graph so the KL trains its model too."""
    return logits.detach() if detach else logits


def mutual_losses(
    private_logits: torch.Tensor, meme_logits: torch.Tensor, y: torch.Tensor, p: FMLParams
) -> tuple[torch.Tensor, torch.Tensor]:
    """(private loss, meme loss) of deep mutual learning, each KL with `p.kl_reduction`; with
    `p.detach` each sees the other as a fixed target."""
    red = p.kl_reduction
    private = p.alpha * F.cross_entropy(private_logits, y) + (1 - p.alpha) * fn.kd_loss(
        private_logits, target(meme_logits, p.detach), p.T, red
    )
    meme = p.beta * F.cross_entropy(meme_logits, y) + (1 - p.beta) * fn.kd_loss(
        meme_logits, target(private_logits, p.detach), p.T, red
    )
    return private, meme


class FMLClient(ModelClient[FMLParams]):
    deployed_uses_payload = False  # deploys its local model (the meme model travels)

    def __init__(self, ctx: ClientContext, params: FMLParams) -> None:
        super().__init__(ctx, params)
        archs = ctx.family_archs or (ctx.arch,)
        meme = shared_arch(params.meme, archs, ctx.in_shape, ctx.num_classes)
        self.meme = build_model(meme, ctx.in_shape, ctx.num_classes)

    def receive(self, payload: Payload, rnd: RoundContext) -> None:
        load_numpy(self.meme, payload)

    def fit(self, trainer: Trainer) -> dict[str, float]:
        return trainer.run(self.training_step, [self.model, self.meme])

    def training_step(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        private, meme = mutual_losses(self.model(x), self.meme(x), y, self.params)
        return private + meme

    def upload(self) -> Payload:
        return to_numpy(self.meme.state_dict())


class FMLServer(AveragingServer[FMLParams]):
    name = "meme"

    def __init__(self, ctx: ServerContext, params: FMLParams) -> None:
        meme = shared_arch(params.meme, ctx.architectures, ctx.in_shape, ctx.num_classes)
        super().__init__(ctx, params, build_model(meme, ctx.in_shape, ctx.num_classes))

    def aggregate(self, replies: Sequence[Reply], rnd: RoundContext) -> dict[str, float]:
        weights = reply_weights(replies, self.params.weighting)
        load_numpy(self.shared, fn.weighted_average([r.payload for r in replies], weights))
        return {}


ALGORITHMS.add(
    "fml",
    Algorithm(
        "fml",
        FMLParams,
        FMLClient,
        FMLServer,
        summary="federated mutual learning with a shared meme model",
    ),
)
