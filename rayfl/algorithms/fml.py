"""FML: Shen et al., "Federated Mutual Learning" (arXiv 2006.16765, 2020).

Every client trains its private model and a copy of a small shared "meme" model side by side by
deep mutual learning on each batch:

    private: alpha * CE(private, y) + (1 - alpha) * T^2 KL(meme.detach() || private)
    meme:    beta  * CE(meme, y)    + (1 - beta)  * T^2 KL(private.detach() || meme)

Each KL has the other model's logits as a fixed target (detached), so the private loss trains
only the private model and the meme loss only the meme; both are optimized together.

Shares: the meme model's parameters (any registered architecture, `meme`; default: the
federation's architecture with the fewest parameters, e.g. `cnn5` in the cnn5 family).
Keeps local: the private model (the personalized model).
Server: sample-weighted average of the memes (scored on the server test set as `meme/acc`).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from rayfl.algorithms import functional as fn
from rayfl.algorithms.base import (
    Algorithm,
    AveragingServer,
    ClientContext,
    ModelClient,
    Payload,
    RoundContext,
    ServerContext,
    Trainer,
    load_numpy,
    to_numpy,
)
from rayfl.errors import require
from rayfl.models import build_model
from rayfl.models.zoo import AUXILIARY_MODELS
from rayfl.registry import ALGORITHMS, MODELS


def check_shared_arch(name: str | None, key: str) -> None:
    """A shared model must be a registered classifier (not e.g. the image-to-image `proxy_input`);
    None stands for the family's smallest architecture (`shared_arch`)."""
    require(
        name is None or (name in MODELS and name not in AUXILIARY_MODELS),
        key,
        f"{name!r} is not a registered classifier; pick one from `rayfl ls` (e.g. mlp, cnn_small) "
        "or null for the family's smallest",
    )


@functools.lru_cache(maxsize=64)
def _num_params(arch: str, in_shape: tuple[int, ...], num_classes: int) -> int:
    # fork_rng: counting must not consume the caller's random stream (a cache hit would not)
    with torch.random.fork_rng(devices=[]):
        model = build_model(arch, in_shape, num_classes)
    return sum(p.numel() for p in model.parameters())


def shared_arch(
    name: str | None, archs: Sequence[str], in_shape: tuple[int, ...], num_classes: int
) -> str:
    """The architecture of a shared model (FML's meme, FedKD's mentee): `name`, or with None the
    federation's own architecture with the fewest parameters (ties: the first name), so that a
    CNN family shares one of its CNNs (e.g. `cnn5` in family cnn5) and not an MLP."""
    if name is not None:
        return name
    return min(sorted(archs), key=lambda a: _num_params(a, tuple(in_shape), num_classes))


@dataclass(frozen=True)
class FMLParams:
    meme: str | None = None  # shared meme architecture; None: the family's smallest (shared_arch)
    alpha: float = 0.5  # private model: weight of CE (1 - alpha on the KL to the meme); paper 0.5
    beta: float = 0.5  # meme: weight of CE (1 - beta on the KL to the private model); paper 0.5
    T: float = 1.0  # KL temperature (the paper uses plain softmax, T = 1)

    def __post_init__(self) -> None:
        check_shared_arch(self.meme, "algorithm.meme")
        require(0 <= self.alpha <= 1, "algorithm.alpha", f"must be in [0, 1] (got {self.alpha})")
        require(0 <= self.beta <= 1, "algorithm.beta", f"must be in [0, 1] (got {self.beta})")
        require(self.T > 0, "algorithm.T", f"temperature must be > 0 (got {self.T})")


def mutual_losses(
    private_logits: torch.Tensor, meme_logits: torch.Tensor, y: torch.Tensor, p: FMLParams
) -> tuple[torch.Tensor, torch.Tensor]:
    """(private loss, meme loss) of deep mutual learning; each sees the other as a fixed target."""
    private = p.alpha * F.cross_entropy(private_logits, y) + (1 - p.alpha) * fn.kd_loss(
        private_logits, meme_logits.detach(), p.T
    )
    meme = p.beta * F.cross_entropy(meme_logits, y) + (1 - p.beta) * fn.kd_loss(
        meme_logits, private_logits.detach(), p.T
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
