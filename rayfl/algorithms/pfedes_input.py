"""pFedES variant `input`, the official code's (LipingYi/pFedES `pFedES_mh.py`); the method, its
server and the variant table are in `rayfl.algorithms.pfedes`.

A tiny image-to-image proxy G before the local model F. Stage 1 trains F on
`(1-mu) CE(F(x)) + mu CE(F(G(x)))` with G frozen; stage 2 trains G on `CE(F(G(x)))` with F
frozen for `proxy_epochs` (official: local_epochs + 10). Inference uses F alone.
Deviation for models with batch norm (the official CNNs have none): F's proxied pass leaves its
running statistics alone, so they describe the images F is scored on, not a mix of x and G(x);
otherwise a batch-norm model scored on x normalizes with G(x)'s statistics.
Two quirks of the official code are options, off by default:
`shared_optimizer: true` keeps ONE SGD momentum state for G across clients and rounds (the
official `optimizer_gen` is built once); in a federation whose clients train in parallel the
buffer travels with the proxy: the server broadcasts it, every client continues from it, and
the server averages the clients' final buffers with the proxy's weights. (The official loop
also hands it from one client to the next within a round, a sequential chain that parallel
clients have no counterpart of.) `weights: all` weighs each client's proxy by all of its
samples, train and test (official: train + val + test), instead of its training samples.
The official code also starts every client of an architecture from the same weights; rayfl
initializes each client from its own seed.

Shares: G's parameters (and, with `shared_optimizer`, its momentum) each way.
Keeps local: the heterogeneous local model F.
Server: pFedES's sample-weighted proxy average.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from rayfl.algorithms.base import ClientContext, Payload, RoundContext, Trainer
from rayfl.algorithms.pfedes import (
    MOMENTUM,
    WEIGHT,
    PFedESClient,
    PFedESParams,
    PFedESServer,
    Variant,
    register_variant,
    split_payload,
)
from rayfl.errors import require
from rayfl.models.sbn import running_stats_kept
from rayfl.models.zoo import InputProxy


class PFedESInputClient(PFedESClient):
    """Variant `input` (the official code): an image-to-image proxy G before the local model F."""

    def __init__(self, ctx: ClientContext, params: PFedESParams) -> None:
        super().__init__(ctx, params)
        require(
            not params.shared_optimizer or ctx.train.optimizer == "sgd",
            "algorithm.shared_optimizer",
            "shares an SGD momentum state; set train.optimizer=sgd or drop it",
        )
        self.momentum: Payload = {}
        self.weight = 0.0

    def receive(self, payload: Payload, rnd: RoundContext) -> None:
        state, self.momentum, _ = split_payload(payload)
        super().receive(state, rnd)

    def fit(self, trainer: Trainer) -> dict[str, float]:
        # stage 1 trains F with G frozen, stage 2 trains G through a frozen F.
        stage1 = self._stage1(trainer)
        self.model.eval()
        epochs = self.params.proxy_epochs
        epochs = self.ctx.train.local_epochs + 10 if epochs is None else epochs
        self.model.requires_grad_(False)  # gradients flow through F to G; F computes none
        try:
            if self.params.shared_optimizer:
                stage2 = self._stage2_shared(trainer, epochs)
            else:
                stage2 = trainer.run(self._stage2_step, [self.proxy], epochs=epochs)
        finally:
            self.model.requires_grad_(True)
        if self.params.weights == "all":
            self.weight = float(
                trainer.num_samples + sum(len(y) for _, y in trainer.batches("test"))
            )
        return {"loss": stage1["loss"], "pfedes/proxy_loss": stage2["loss"]}

    def fit_cut_off(self, trainer: Trainer) -> dict[str, float]:
        """Stage 1 only: stage 2 changes G alone, which is uploaded and replaced by the next
        broadcast (F is frozen and in eval mode; the trainer's shuffling is seeded per round)."""
        return self._stage1(trainer)

    def _stage1(self, trainer: Trainer) -> dict[str, float]:
        self.proxy.eval()
        return trainer.run(self._stage1_step, [self.model])

    def _stage2_shared(self, trainer: Trainer, epochs: int) -> dict[str, float]:
        """Stage 2 with the federation's SGD momentum for G: continue from the received buffers
        and keep the final ones for upload (the official code's single `optimizer_gen`)."""
        s = self.ctx.train
        named = dict(self.proxy.named_parameters())
        sgd = torch.optim.SGD(
            named.values(), lr=s.lr, momentum=s.momentum, weight_decay=s.weight_decay
        )
        for name, buf in self.momentum.items():
            sgd.state[named[name]]["momentum_buffer"] = torch.as_tensor(
                np.array(buf), device=named[name].device
            )
        self.proxy.train()
        total, count = 0.0, 0
        for _ in range(epochs):
            for x, y in trainer.batches("train", shuffle=True):
                loss = self._stage2_step(x, y)
                sgd.zero_grad(set_to_none=True)
                loss.backward()
                if s.grad_clip:
                    torch.nn.utils.clip_grad_norm_(self.proxy.parameters(), s.grad_clip)
                sgd.step()
                total += float(loss.detach()) * len(y)
                count += len(y)
        self.momentum = {
            name: sgd.state[p]["momentum_buffer"].detach().cpu().numpy().copy()
            for name, p in named.items()
            if "momentum_buffer" in sgd.state[p]
        }
        return {"loss": total / count if count else float("nan")}

    def upload(self) -> Payload:
        up = super().upload()
        if self.params.shared_optimizer:
            up.update({MOMENTUM + k: v for k, v in self.momentum.items()})
        if self.params.weights == "all":
            up[WEIGHT] = np.array(self.weight, dtype=np.float32)
        return up

    def _stage1_step(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            gx = self.proxy(x)
        mu, ce = self.params.mu, F.cross_entropy
        own = ce(self.model(x), y)
        with running_stats_kept(self.model):  # F is scored on x alone: its statistics are x's
            proxied = ce(self.model(gx), y)
        return (1 - mu) * own + mu * proxied

    def _stage2_step(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(self.model(self.proxy(x)), y)

    def received_proxy_logits(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(self.received(x))


input_proxy = lambda p, shape, classes: InputProxy(shape[0])  # noqa: E731
register_variant("input", Variant(PFedESInputClient, PFedESServer, input_proxy, scored=False))
