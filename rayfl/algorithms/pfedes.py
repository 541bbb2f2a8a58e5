"""pFedES: Yi et al., "pFedES: Generalized Proxy Feature Extractor Sharing for Model Heterogeneous
Personalized Federated Learning" (AAAI 2025; arXiv 2311.06879).

Two variants (see ALGORITHMS.md):
- `kd` (the design document's, default): each client trains its private local model with CE and a
  small global proxy CNN by distilling the local model's detached logits into it
  (`ce + alpha * T^2 KL(proxy || local.detach())`). Optional return path `beta`: the local model also
  distils from the frozen proxy received this round (a fixed teacher, so the two do not chase).
- `input` (the official code): a tiny image-to-image proxy G before the local model F. Stage 1
  trains F on `(1-mu) CE(F(x)) + mu CE(F(G(x)))` with G frozen; stage 2 trains G on `CE(F(G(x)))`
  with F frozen. Inference uses F alone.

Shares: the proxy's parameters (`4 * n_params` bytes each way per client per round).
Keeps local: the heterogeneous local model.
Server: sample-weighted proxy average, with optional per-client weight cap, L2 clipping of each
proxy update, and EMA of the global proxy applied every `ema_every` rounds.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import nn

from rayfl.algorithms import functional as fn
from rayfl.algorithms.base import (
    Algorithm,
    ClientContext,
    ModelClient,
    Payload,
    Reply,
    RoundContext,
    Server,
    ServerContext,
    Trainer,
    load_numpy,
    to_numpy,
)
from rayfl.algorithms.pfedes_stats import PFedESStatsClient, PFedESStatsServer
from rayfl.errors import require
from rayfl.models.zoo import InputProxy, ProxyExtractor
from rayfl.registry import ALGORITHMS


@dataclass(frozen=True)
class PFedESParams:
    variant: Literal["kd", "input", "stats"] = "kd"  # stats: rayfl.algorithms.pfedes_stats
    T: float = 4.0  # distillation temperature (kd)
    alpha: float = 0.1  # weight of the proxy's KD loss (kd)
    beta: float = (
        0.0  # return path: local model distils from the received proxy (0 = the literal method)
    )
    embed_dim: int = 128  # proxy embedding size (kd)
    mu: float = 0.5  # stage-1 weight of the proxied path (input)
    proxy_epochs: int | None = (
        None  # stage-2 epochs (input); None: local_epochs + 10 as in the official code
    )
    weight_cap: float | None = None  # server: no client weighs more than this (e.g. 0.3)
    clip_update: float | None = None  # server: L2 bound on each client's proxy update (e.g. 5.0)
    ema: float | None = None  # server: global = ema * global + (1 - ema) * aggregated (e.g. 0.9)
    ema_every: int = 1  # server: apply the EMA every k rounds (plain replacement otherwise)

    def __post_init__(self) -> None:
        require(self.T > 0, "algorithm.T", f"temperature must be > 0 (got {self.T})")
        require(self.alpha >= 0, "algorithm.alpha", f"must be >= 0 (got {self.alpha})")
        require(self.beta >= 0, "algorithm.beta", f"must be >= 0 (got {self.beta})")
        require(self.embed_dim >= 1, "algorithm.embed_dim", "must be at least 1")
        require(0 <= self.mu <= 1, "algorithm.mu", f"must be in [0, 1] (got {self.mu})")
        require(
            self.weight_cap is None or 0 < self.weight_cap <= 1,
            "algorithm.weight_cap",
            f"must be in (0, 1] or null (got {self.weight_cap})",
        )
        require(
            self.clip_update is None or self.clip_update > 0,
            "algorithm.clip_update",
            "must be > 0 or null",
        )
        require(
            self.ema is None or 0 <= self.ema < 1,
            "algorithm.ema",
            f"must be in [0, 1) or null (got {self.ema})",
        )
        require(self.ema_every >= 1, "algorithm.ema_every", "must be at least 1")
        require(
            self.proxy_epochs is None or self.proxy_epochs >= 0,
            "algorithm.proxy_epochs",
            "must be >= 0",
        )


def build_proxy(params: PFedESParams, in_shape: tuple[int, ...], num_classes: int) -> nn.Module:
    if params.variant == "kd":
        return ProxyExtractor(in_shape, num_classes, embed_dim=params.embed_dim)
    return InputProxy(in_shape[0])


class PFedESClient(ModelClient[PFedESParams]):
    def __new__(cls, ctx: ClientContext, params: PFedESParams) -> Any:
        # `variant: stats` uploads statistics, not a proxy: its own halves (pfedes_stats.py).
        if cls is PFedESClient and params.variant == "stats":
            return PFedESStatsClient(ctx, params)
        return super().__new__(cls)

    def __init__(self, ctx: ClientContext, params: PFedESParams) -> None:
        super().__init__(ctx, params)
        self.proxy = build_proxy(params, ctx.in_shape, ctx.num_classes)
        self.teacher: nn.Module | None = None

    def receive(self, payload: Payload, rnd: RoundContext) -> None:
        load_numpy(self.proxy, payload)
        if self.params.variant == "kd" and self.params.beta > 0:
            self.teacher = copy.deepcopy(self.proxy).eval().requires_grad_(False)

    def fit(self, trainer: Trainer) -> dict[str, float]:
        if self.params.variant == "kd":
            return trainer.run(self.training_step, [self.model, self.proxy])
        # variant `input`: stage 1 trains F with G frozen, stage 2 trains G through a frozen F.
        self.proxy.eval()
        stage1 = trainer.run(self._stage1_step, [self.model])
        self.model.eval()
        epochs = self.params.proxy_epochs
        epochs = self.ctx.train.local_epochs + 10 if epochs is None else epochs
        stage2 = trainer.run(self._stage2_step, [self.proxy], epochs=epochs)
        return {"loss": stage1["loss"], "pfedes/proxy_loss": stage2["loss"]}

    def training_step(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        p = self.params
        local_logits = self.model(x)
        proxy_logits, _ = self.proxy(x)
        # detach: CE trains only the local model, KD only the proxy; otherwise they chase each other.
        loss = F.cross_entropy(local_logits, y) + p.alpha * fn.kd_loss(
            proxy_logits, local_logits.detach(), p.T
        )
        if self.teacher is not None:
            with torch.no_grad():
                teacher_logits, _ = self.teacher(x)
            loss = loss + p.beta * fn.kd_loss(local_logits, teacher_logits, p.T)
        return loss

    def _stage1_step(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            gx = self.proxy(x)
        mu = self.params.mu
        return (1 - mu) * F.cross_entropy(self.model(x), y) + mu * F.cross_entropy(
            self.model(gx), y
        )

    def _stage2_step(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(self.model(self.proxy(x)), y)

    def upload(self) -> Payload:
        return to_numpy(self.proxy.state_dict())

    def eval_metrics(self, x: torch.Tensor, y: torch.Tensor) -> dict[str, float]:
        if self.params.variant != "kd":
            return {}
        local_logits = self.model(x)
        proxy_logits, _ = self.proxy(x)
        return {"pfedes/kl_local_proxy": float(fn.logit_kl(local_logits, proxy_logits))}


class PFedESServer(Server[PFedESParams]):
    sum_form = "weighted_mean"  # a sample-weighted proxy average (see rayfl.privacy)

    @staticmethod
    def variant_class(params: PFedESParams) -> type[Server]:
        """The server half of `params.variant` (what `rayfl.privacy` asks for its sum form)."""
        return PFedESStatsServer if params.variant == "stats" else PFedESServer

    def __new__(cls, ctx: ServerContext, params: PFedESParams) -> Any:
        if cls is PFedESServer and params.variant == "stats":
            return PFedESStatsServer(ctx, params)
        return super().__new__(cls)

    def __init__(self, ctx: ServerContext, params: PFedESParams) -> None:
        super().__init__(ctx, params)
        self.proxy = build_proxy(params, ctx.in_shape, ctx.num_classes).to(ctx.device)

    def broadcast(self, arch: str, rnd: RoundContext) -> Payload:
        return to_numpy(self.proxy.state_dict())

    def aggregate(self, replies: Sequence[Reply], rnd: RoundContext) -> dict[str, float]:
        p = self.params
        current = to_numpy(self.proxy.state_dict())
        updates = [fn.subtract(r.payload, current) for r in replies]
        if p.clip_update is not None:
            updates = [fn.clip_update(u, p.clip_update) for u in updates]
        weights = fn.normalized_weights([r.num_samples for r in replies], cap=p.weight_cap)
        aggregated = fn.add(current, fn.weighted_average(updates, weights))
        if p.ema is not None and rnd.index % p.ema_every == 0:
            aggregated = fn.ema(current, aggregated, p.ema)
        load_numpy(self.proxy, aggregated)
        return {}

    def eval_models(self) -> dict[str, nn.Module]:
        # The `input` proxy is an image-to-image map: it has no accuracy of its own.
        return {"proxy": self.proxy} if self.params.variant == "kd" else {}

    def state_modules(self) -> dict[str, nn.Module]:
        return {"proxy": self.proxy}


ALGORITHMS.add(
    "pfedes",
    Algorithm(
        "pfedes",
        PFedESParams,
        PFedESClient,
        PFedESServer,
        summary="proxy feature extractor sharing (variants kd | input | stats)",
    ),
)
