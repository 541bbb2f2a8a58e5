"""FedGen: Zhu et al., "Data-Free Knowledge Distillation for Heterogeneous Federated Learning"
(ICML 2021; arXiv 2105.10056), as HtFLlib adapts it to heterogeneous models
(TsingZ0/HtFLlib `system/flcore/clients/clientgen.py`, `system/flcore/servers/servergen.py`).

The server learns a generator `G(y, eps)` of feature-space samples: an embedding of the label
(one-hot) and uniform noise `eps`, one hidden layer with BatchNorm and ReLU, a linear map to the
feature size. It trains `G` so that the ensemble of the clients' heads, weighted by their sample
counts, classifies its samples as their labels:

    server: min_G  CE(sum_k w_k head_k(G(y, eps)), y),   y ~ the federation's label counts
    client: CE(model(x), y) + CE(head(G(y', eps)), y'),    y' ~ the same label counts

so every client's head also learns from the other clients' knowledge of the feature space. The
heads are averaged (sample-weighted) and the global head replaces each client's head at the
start of a round, as in HtFLlib; every architecture must emit features of one size.

Shares: the head and the client's label counts up; the global head, the generator and the
federation's label counts down.
Keeps local: the feature extractor (and the head as fine-tuned this round).
Server: trains the generator against the uploaded heads (`server_epochs` Adam steps on
`train.batch_size` samples, learning rate `generator_lr`, a fresh optimizer each round), then
averages the heads.

Defaults are HtFLlib's FedGen command (`system/total.sh`: `-nd 32 -hd 512 -se 100`; the noise
size 32 is also the official FedGen code's for MNIST and EMNIST, zhuangdizhu/FedGen
`GENERATORCONFIGS`) but for the generator's learning rate: 3e-4, the official code's for MNIST
(`RUNCONFIGS`, `ensemble_lr`), not HtFLlib's `-glr 0.1`. HtFLlib's `train_generator` trains a
copy of the saved generator and never saves it back (`servergen.py`), so its clients sample the
initial generator all along (rayfl: `server_epochs: 0`) and its `-glr` is never exercised; a
generator that does learn at 0.1 drives the clients' heads to non-finite weights within a few
rounds.

Deviations from HtFLlib, each for a reason:
- the trained generator is kept and sent to the clients (the paper's method; see above), with
  HtFLlib's fresh Adam each round (the official code keeps one, its rate decayed 0.98 a round).
- the label counts travel with the heads, and the server sums the latest counts of every client
  seen so far; HtFLlib reads every client's counts at start-up. Until the first upload no count
  is known and clients train by CE alone (HtFLlib's round 0 samples its untrained generator).
- labels are drawn with torch's seeded generator, not numpy's global one (determinism).
- the official FedGen's diversity loss, its decaying loss weights and its second client term
  (a KL between the model's predictions on real samples and on generated samples of the same
  labels) are left out, as in HtFLlib.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from rayfl.algorithms import functional as fn
from rayfl.algorithms.base import (
    ALGORITHMS,
    Algorithm,
    CheckedParams,
    ClientContext,
    ModelClient,
    Payload,
    Reply,
    RoundContext,
    Server,
    ServerContext,
    ServerData,
    Trainer,
    load_numpy,
    to_numpy,
    unprefixed,
)
from rayfl.models import build_model
from rayfl.schema import setting

HEAD, GEN, LABELS = "head.", "gen.", "label_counts"


@dataclass(frozen=True)
class FedGenParams(CheckedParams):
    noise_dim: int = setting(
        32, "size of the generator's uniform noise (HtFLlib total.sh -nd 32)", ge=1
    )
    hidden_dim: int = setting(512, "width of the generator's hidden layer (HtFLlib -hd 512)", ge=1)
    generator_lr: float = setting(
        3e-4, "the generator's Adam learning rate (official FedGen, MNIST ensemble_lr)", gt=0
    )
    server_epochs: int = setting(
        100, "Adam steps of the generator per round (HtFLlib -se 100; 0: HtFLlib's untrained one)"
    )


class Generator(nn.Module):
    """Labels -> feature-space samples: `[uniform noise, one-hot label]`, a hidden layer with
    BatchNorm and ReLU, a linear map to the feature size (FedGen's generator, as in HtFLlib)."""

    def __init__(self, noise_dim: int, num_classes: int, hidden_dim: int, feature_dim: int) -> None:
        super().__init__()
        self.noise_dim = noise_dim
        self.num_classes = num_classes
        self.hidden = nn.Sequential(
            nn.Linear(noise_dim + num_classes, hidden_dim),
            nn.BatchNorm1d(hidden_dim),
            nn.ReLU(),
        )
        self.out = nn.Linear(hidden_dim, feature_dim)

    def forward(self, labels: torch.Tensor) -> torch.Tensor:
        eps = torch.rand(len(labels), self.noise_dim, device=labels.device)  # torch's seeded RNG
        onehot = F.one_hot(labels, self.num_classes).to(eps.dtype)
        return self.out(self.hidden(torch.cat([eps, onehot], dim=1)))


def sample_labels(counts: torch.Tensor, n: int) -> torch.Tensor:
    """`n` labels drawn with replacement in proportion to `counts` (HtFLlib's choice from the
    pooled list of every sample's label)."""
    return torch.multinomial(counts.float(), n, replacement=True)


def ensemble_logits(
    head: nn.Module,
    states: Sequence[Mapping[str, torch.Tensor]],
    weights: np.ndarray,
    z: torch.Tensor,
) -> torch.Tensor:
    """`sum_k weights[k] * head_k(z)`, with `head_k` the module `head` holding `states[k]`."""
    terms = [
        float(w) * torch.func.functional_call(head, dict(s), (z,)) for w, s in zip(weights, states)
    ]
    return torch.stack(terms).sum(0)


class FedGenClient(ModelClient[FedGenParams]):
    def __init__(self, ctx: ClientContext, params: FedGenParams) -> None:
        super().__init__(ctx, params)
        p = params
        self.generator = Generator(
            p.noise_dim, ctx.num_classes, p.hidden_dim, self.model.feature_dim
        )
        self.generator.requires_grad_(False)  # the server trains it; clients only sample
        self.label_weights = torch.zeros(ctx.num_classes)
        self.counts = np.zeros(ctx.num_classes, dtype=np.float32)

    def receive(self, payload: Payload, rnd: RoundContext) -> None:
        load_numpy(self.model.head, unprefixed(payload, HEAD))
        load_numpy(self.generator, unprefixed(payload, GEN))
        weights = np.array(payload[LABELS], dtype=np.float32)
        self.label_weights = torch.as_tensor(weights, device=self.ctx.device)

    def fit(self, trainer: Trainer) -> dict[str, float]:
        counts = torch.zeros(self.ctx.num_classes, device=self.ctx.device)
        for _, y in trainer.batches("train"):
            counts += torch.bincount(y, minlength=self.ctx.num_classes).to(counts.dtype)
        self.counts = counts.cpu().numpy().astype(np.float32)
        self.generator.train()  # BatchNorm on the batch's statistics, as the server trains it
        return trainer.run(self.training_step, [self.model])

    def training_step(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = F.cross_entropy(self.model(x), y)
        if bool(self.label_weights.sum() > 0):
            labels = sample_labels(self.label_weights, self.ctx.train.batch_size)
            with torch.no_grad():
                z = self.generator(labels)
            loss = loss + F.cross_entropy(self.model.head(z), labels)
        return loss

    def upload(self) -> Payload:
        head = {HEAD + k: v for k, v in to_numpy(self.model.head.state_dict()).items()}
        return {**head, LABELS: self.counts}


class FedGenServer(Server[FedGenParams]):
    state_attrs = ("label_table",)

    def __init__(self, ctx: ServerContext, params: FedGenParams) -> None:
        super().__init__(ctx, params)
        model = build_model(ctx.architectures[0], ctx.in_shape, ctx.num_classes)
        self.head = model.head.to(ctx.device)
        p = params
        self.generator = Generator(
            p.noise_dim, ctx.num_classes, p.hidden_dim, model.feature_dim
        ).to(ctx.device)
        # each client's latest label counts: their sum is the labels' sampling distribution
        self.label_table = np.zeros((ctx.num_clients, ctx.num_classes), dtype=np.float32)
        self.heads: list[dict[str, torch.Tensor]] = []
        self.weights = np.zeros(0)

    def broadcast(self, arch: str, rnd: RoundContext) -> Payload:
        head = {HEAD + k: v for k, v in to_numpy(self.head.state_dict()).items()}
        gen = {GEN + k: v for k, v in to_numpy(self.generator.state_dict()).items()}
        return {**head, **gen, LABELS: self.label_table.sum(0)}

    def aggregate(self, replies: Sequence[Reply], rnd: RoundContext) -> dict[str, float]:
        heads = [unprefixed(r.payload, HEAD) for r in replies]
        for r in replies:
            self.label_table[r.client_id] = np.asarray(r.payload[LABELS], dtype=np.float32)
        self.weights = fn.normalized_weights([r.num_samples for r in replies])
        device = self.ctx.device
        self.heads = [{k: torch.as_tensor(v, device=device) for k, v in h.items()} for h in heads]
        # the generator learns from this round's heads in `update` (seeded), then they are averaged
        return {}

    def update(self, data: ServerData, rnd: RoundContext) -> dict[str, float]:
        if not self.heads:
            return {}
        counts = torch.as_tensor(self.label_table.sum(0), device=self.ctx.device)
        loss = float("nan")
        if self.params.server_epochs > 0 and bool(counts.sum() > 0):
            loss = self.train_generator(counts)
        average = fn.weighted_average(
            [{k: v.cpu().numpy() for k, v in h.items()} for h in self.heads], self.weights
        )
        load_numpy(self.head, average)
        self.heads = []
        return {"fedgen/generator_loss": loss} if np.isfinite(loss) else {}

    def train_generator(self, counts: torch.Tensor) -> float:
        """`server_epochs` Adam steps of the generator against the ensemble of this round's
        heads; returns the mean loss."""
        p = self.params
        optimizer = torch.optim.Adam(self.generator.parameters(), lr=p.generator_lr)
        self.head.eval()
        self.generator.train()
        total = 0.0
        for _ in range(p.server_epochs):
            labels = sample_labels(counts, self.ctx.train.batch_size)
            logits = ensemble_logits(self.head, self.heads, self.weights, self.generator(labels))
            loss = F.cross_entropy(logits, labels)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            total += float(loss.detach())
        return total / p.server_epochs

    def state_modules(self) -> dict[str, nn.Module]:
        return {"head": self.head, "generator": self.generator}


ALGORITHMS.add(
    "fedgen",
    Algorithm(
        "fedgen",
        FedGenParams,
        FedGenClient,
        FedGenServer,
        needs_common_feature_dim=True,
        summary="server-trained generator of feature-space samples teaches the clients' heads",
    ),
)
