"""pFedES: Yi et al., "pFedES: Generalized Proxy Feature Extractor Sharing for Model Heterogeneous
Personalized Federated Learning" (AAAI 2025; arXiv 2311.06879).

Variants (see ALGORITHMS.md), one client class each, chosen by `algorithm.variant` through the
`VARIANTS` table (a new variant is one `register_variant` call): `kd` here, `input` (the official
code's) in `rayfl.algorithms.pfedes_input`, `stats` in `rayfl.algorithms.pfedes_stats`.
- `kd` (the design document's, default): each client trains its private local model with CE and a
  small global proxy CNN by distilling the local model's detached logits into it
  (`ce + alpha * T^2 KL(proxy || local.detach())`). Optional return path `beta`: the local model also
  distils from the frozen proxy received this round (a fixed teacher, so the two do not chase).
  Deviation: the proxy steps by `proxy_lr` (default train.lr) times the gradient of its
  unweighted KD loss; alpha weights the reported loss. Under the document's single objective
  and learning rate (`alpha_scales_proxy: true`) alpha, touching no other gradient, only shrinks
  the proxy's step, and with the document's alpha 0.1 the shared proxy stays at chance.

The kd and input variants score the global proxy they *received* (a frozen copy kept before
local training): `pfedes/proxy_acc` on the client's test split (kd: the proxy's own head; input:
F after G), and for kd `pfedes/kl_local_proxy`, the KL between the local model's and that global
proxy's logits.

Shares: the proxy's parameters (`4 * n_params` bytes each way per client per round).
Keeps local: the heterogeneous local model.
Server: sample-weighted proxy average, with optional per-client weight cap, L2 clipping of each
proxy update, and EMA of the global proxy applied every `ema_every` rounds.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

import torch
import torch.nn.functional as F
from torch import nn

from rayfl.algorithms import functional as fn
from rayfl.algorithms.base import (
    ALGORITHMS,
    Algorithm,
    CheckedParams,
    Client,
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
from rayfl.models.zoo import ProxyExtractor
from rayfl.schema import setting


@dataclass(frozen=True)
class PFedESParams(CheckedParams):
    variant: str = setting(
        "kd", "kd | input | stats (rayfl.algorithms.pfedes_stats): a name in VARIANTS"
    )
    T: float = setting(4.0, "distillation temperature (kd)", gt=0)
    alpha: float = setting(
        0.1,
        "kd: weight of the proxy's KD loss in the objective; the local logits are detached, so it scales the proxy's gradient only with alpha_scales_proxy, and the reported loss otherwise",
    )
    alpha_scales_proxy: bool = setting(
        False,
        "kd: true is the design document's single objective `ce + alpha * kd` under one learning rate, where the proxy steps by alpha * train.lr (10x slower at alpha 0.1: it stays at chance, docs/algorithms.md); false: the proxy steps by proxy_lr on its unweighted KD loss",
    )
    beta: float = setting(
        0.0, "return path: local model distils from the received proxy (0 = the literal method)"
    )
    embed_dim: int = setting(128, "proxy embedding size (kd)", ge=1)
    proxy_lr: float | None = setting(
        None, "kd: the proxy's own learning rate (null: train.lr)", gt=0
    )
    mu: float = setting(0.5, "stage-1 weight of the proxied path (input)", le=1)
    proxy_epochs: int | None = setting(
        None, "stage-2 epochs (input); None: local_epochs + 10 as in the official code"
    )
    weight_cap: float | None = setting(
        None, "server: no client weighs more than this (e.g. 0.3)", gt=0, le=1
    )
    clip_update: float | None = setting(
        None, "server: L2 bound on each client's proxy update (e.g. 5.0)", gt=0
    )
    ema: float | None = setting(
        None, "server: global = ema * global + (1 - ema) * aggregated (e.g. 0.9)", lt=1
    )
    ema_every: int = setting(
        1, "server: apply the EMA every k rounds (plain replacement otherwise)", ge=1
    )
    shared_optimizer: bool = setting(
        False,
        "input: one momentum state for G across clients and rounds, as the official code's single `optimizer_gen` (needs train.optimizer sgd); false: a fresh optimizer per client and round",
    )
    weights: Literal["train", "all"] = setting(
        "train",
        "input: aggregation weights from the training samples (`train`) or from all of a client's samples, train and test (`all`: the official code counts train + val + test)",
    )

    def __post_init__(self) -> None:
        require(
            self.variant in VARIANTS,
            "algorithm.variant",
            f"{self.variant!r} is not a pFedES variant; choose one of {', '.join(VARIANTS)}",
        )
        super().__post_init__()
        require(
            not (self.alpha_scales_proxy and self.proxy_lr is not None),
            "algorithm.proxy_lr",
            "alpha_scales_proxy steps the proxy by alpha * train.lr; drop one of the two",
        )
        for key, on in (
            ("shared_optimizer", self.shared_optimizer),
            ("weights", self.weights == "all"),
        ):
            require(
                not on or self.variant == "input",
                f"algorithm.{key}",
                "reproduces the official code's variant; set algorithm.variant=input or drop it",
            )

    def notes(self) -> list[str]:
        """Valid settings that make the run pointless (`rayfl validate` prints them)."""
        if self.variant == "kd" and self.beta == 0:
            return [
                "algorithm.beta=0 with variant kd (the design document's literal loss): no local "
                "model reads the proxy, so personal accuracy equals algorithm.name=local; set "
                "algorithm.beta > 0 or algorithm.variant=input"
            ]
        return []


@dataclass(frozen=True)
class Variant:
    """One pFedES variant: its client half, its server half and its proxy."""

    client: type[Client[PFedESParams]]
    server: type[Server[PFedESParams]]
    # builds the shared proxy from `(params, in_shape, num_classes)`
    proxy: Callable[[PFedESParams, tuple[int, ...], int], nn.Module] | None = None
    scored: bool = True  # the proxy is a classifier the server scores (`proxy/acc`)


VARIANTS: dict[str, Variant] = {}


def register_variant(name: str, variant: Variant) -> None:
    """Make `algorithm.variant: <name>` choose `variant`."""
    VARIANTS[name] = variant


def build_proxy(params: PFedESParams, in_shape: tuple[int, ...], num_classes: int) -> nn.Module:
    make = VARIANTS[params.variant].proxy
    if make is None:
        raise ValueError(f"pFedES variant {params.variant!r} shares no proxy")
    return make(params, in_shape, num_classes)


def _variant_new(
    base: type[Any], cls: type[Any], half: str, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Any:
    """`__new__` of both halves: `base(ctx, params)` builds the `half` ("client" or "server") of
    `params.variant` from the VARIANTS table; a subclass named directly is built as itself."""
    if cls is not base:
        return super(base, cls).__new__(cls)
    params = args[1] if len(args) > 1 else kwargs["params"]  # (ctx, params)
    target: Any = getattr(VARIANTS[params.variant], half)
    if half == "server":
        target = PFedESServer.variant_class(params)
    if not issubclass(target, base):
        return target(*args, **kwargs)  # a variant with halves of its own (stats)
    return super(base, base).__new__(target)


class PFedESClient(ModelClient[PFedESParams]):
    """What every variant shares: a private local model, a proxy that travels, and a frozen copy
    of the global proxy received this round (`self.received`). `PFedESClient(ctx, params)`
    returns the client class of `params.variant`."""

    deployed_uses_payload = False  # deploys its local model (the proxy only travels)

    @classmethod
    def deploys_payload(cls, params: PFedESParams) -> bool:
        target = VARIANTS[params.variant].client if cls is PFedESClient else cls
        return target.deployed_uses_payload

    def __new__(cls, *args: Any, **kwargs: Any) -> Any:
        return _variant_new(PFedESClient, cls, "client", args, kwargs)

    def __init__(self, ctx: ClientContext, params: PFedESParams) -> None:
        super().__init__(ctx, params)
        self.proxy = build_proxy(params, ctx.in_shape, ctx.num_classes)
        self.received = copy.deepcopy(self.proxy).eval().requires_grad_(False)

    def receive(self, payload: Payload, rnd: RoundContext) -> None:
        load_numpy(self.proxy, payload)
        # kept before local training: the metrics compare with what the federation sent
        load_numpy(self.received, payload)

    def upload(self) -> Payload:
        return to_numpy(self.proxy.state_dict())

    def received_proxy_logits(self, x: torch.Tensor) -> torch.Tensor:
        """Logits of the received global proxy's prediction path for `x`."""
        raise NotImplementedError

    def eval_metrics(self, x: torch.Tensor, y: torch.Tensor) -> dict[str, float]:
        self.received.eval()
        hits = (self.received_proxy_logits(x).argmax(1) == y).float().mean()
        return {"pfedes/proxy_acc": float(hits)}


class PFedESKDClient(PFedESClient):
    """Variant `kd`: local CE plus the proxy distilled from the local model's logits."""

    def __init__(self, ctx: ClientContext, params: PFedESParams) -> None:
        super().__init__(ctx, params)
        self.teacher: nn.Module | None = None
        # the proxy's KD loss summed over this round's samples, and their count
        self._kd_sum: torch.Tensor | float = 0.0
        self._kd_count = 0

    def receive(self, payload: Payload, rnd: RoundContext) -> None:
        super().receive(payload, rnd)
        self.teacher = self.received if self.params.beta > 0 else None

    def fit(self, trainer: Trainer) -> dict[str, float]:
        lrs = None if self.params.proxy_lr is None else [None, self.params.proxy_lr]
        self._kd_sum, self._kd_count = 0.0, 0
        out = trainer.run(self.training_step, [self.model, self.proxy], module_lrs=lrs)
        # the proxy's own (unweighted) KD loss over the round: the design document's first check
        # when the proxy does not learn is whether this falls
        out["pfedes/kd_loss"] = (
            float(self._kd_sum) / self._kd_count if self._kd_count else float("nan")
        )
        return out

    def training_step(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        p = self.params
        local_logits = self.model(x)
        proxy_logits, _ = self.proxy(x)
        # detach: CE trains only the local model, KD only the proxy; otherwise they chase each other.
        kd = fn.kd_loss(proxy_logits, local_logits.detach(), p.T)
        self._kd_sum = self._kd_sum + kd.detach() * len(y)  # a tensor: no sync per batch
        self._kd_count += len(y)
        # Value alpha * kd (the reported objective) but, unless alpha_scales_proxy, the gradient
        # of kd: the proxy's step is set by its learning rate alone, not shrunk by alpha.
        proxy_term = p.alpha * kd if p.alpha_scales_proxy else kd + (p.alpha - 1.0) * kd.detach()
        loss = F.cross_entropy(local_logits, y) + proxy_term
        if self.teacher is not None:
            self.teacher.eval()
            with torch.no_grad():
                teacher_logits, _ = self.teacher(x)
            loss = loss + p.beta * fn.kd_loss(local_logits, teacher_logits, p.T)
        return loss

    def received_proxy_logits(self, x: torch.Tensor) -> torch.Tensor:
        logits, _ = self.received(x)
        return logits

    def eval_metrics(self, x: torch.Tensor, y: torch.Tensor) -> dict[str, float]:
        out = super().eval_metrics(x, y)
        kl = fn.logit_kl(self.model(x), self.received_proxy_logits(x))
        out["pfedes/kl_local_proxy"] = float(kl)
        return out


MOMENTUM = "momentum."  # payload prefix of G's shared SGD momentum (shared_optimizer)
WEIGHT = "weight"  # payload key of a client's aggregation weight (weights: all)


def split_payload(payload: Payload) -> tuple[Payload, Payload, float | None]:
    """`(proxy state, momentum buffers by parameter name, client weight or None)` of an upload."""
    state = {k: v for k, v in payload.items() if not k.startswith(MOMENTUM) and k != WEIGHT}
    momentum = {k[len(MOMENTUM) :]: v for k, v in payload.items() if k.startswith(MOMENTUM)}
    weight = float(payload[WEIGHT]) if WEIGHT in payload else None
    return state, momentum, weight


class PFedESServer(Server[PFedESParams]):
    """Sample-weighted proxy average (optional weight cap, update clipping, EMA).
    `PFedESServer(ctx, params)` returns the server class of `params.variant`."""

    sum_form: ClassVar[str | None] = "weighted_mean"  # a sample-weighted average (rayfl.privacy)
    state_attrs = ("momentum",)

    @staticmethod
    def variant_class(params: PFedESParams) -> type[Server[PFedESParams]]:
        """The server half of `params.variant` (what `rayfl.privacy` asks for its sum form)."""
        if params.weights == "all":
            return PFedESOwnWeightsServer
        return VARIANTS[params.variant].server

    def __new__(cls, *args: Any, **kwargs: Any) -> Any:
        return _variant_new(PFedESServer, cls, "server", args, kwargs)

    def __init__(self, ctx: ServerContext, params: PFedESParams) -> None:
        super().__init__(ctx, params)
        self.proxy = build_proxy(params, ctx.in_shape, ctx.num_classes).to(ctx.device)
        self.momentum: Payload = {}  # G's shared SGD momentum (shared_optimizer)

    def broadcast(self, arch: str, rnd: RoundContext) -> Payload:
        down = to_numpy(self.proxy.state_dict())
        down.update({MOMENTUM + k: v for k, v in self.momentum.items()})
        return down

    def aggregate(self, replies: Sequence[Reply], rnd: RoundContext) -> dict[str, float]:
        p = self.params
        current = to_numpy(self.proxy.state_dict())
        parts = [split_payload(r.payload) for r in replies]
        updates = [fn.subtract(state, current) for state, _, _ in parts]
        if p.clip_update is not None:
            updates = [fn.clip_update(u, p.clip_update) for u in updates]
        counts = [r.num_samples if w is None else w for r, (_, _, w) in zip(replies, parts)]
        weights = fn.normalized_weights(counts, cap=p.weight_cap)
        aggregated = fn.add(current, fn.weighted_average(updates, weights))
        if p.ema is not None and rnd.index % p.ema_every == 0:
            aggregated = fn.ema(current, aggregated, p.ema)
        load_numpy(self.proxy, aggregated)
        if p.shared_optimizer:
            self.momentum = fn.weighted_average([m for _, m, _ in parts], weights)
        # a uniform guess's accuracy, beside `proxy/acc`: the proxy's health check compares them
        return {"proxy/chance": 1.0 / self.ctx.num_classes} if self.eval_models() else {}

    def eval_models(self) -> dict[str, nn.Module]:
        # The `input` proxy is an image-to-image map: it has no accuracy of its own.
        return {"proxy": self.proxy} if VARIANTS[self.params.variant].scored else {}

    def state_modules(self) -> dict[str, nn.Module]:
        return {"proxy": self.proxy}


class PFedESOwnWeightsServer(PFedESServer):
    """The pFedES server with each client's own aggregation weight (`weights: all`): a protected
    sum carries only the training counts, so privacy refuses it (`sum_form = None`)."""

    sum_form = None


kd_proxy = lambda p, shape, classes: ProxyExtractor(shape, classes, embed_dim=p.embed_dim)  # noqa: E731
register_variant("kd", Variant(PFedESKDClient, PFedESServer, kd_proxy))
register_variant("stats", Variant(PFedESStatsClient, PFedESStatsServer, scored=False))

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
