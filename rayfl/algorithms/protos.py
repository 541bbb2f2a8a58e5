"""Per-class statistics shared between heterogeneous models: prototypes and class logits.

FedProto and FedGH share per-class mean representations (prototypes), FD shares per-class mean
logits. Both travel as the same payload, `{"means": (C, D) float32, "counts": (C,) float32}`,
where `counts[c]` is the number of samples behind `means[c]` (0: the class was not seen and its
row is zero). Every helper here is pure and has a golden-number test.
Not an algorithm module but the helpers four of them share (FD, FedProto, FedGH, FedTGP).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Protocol, TypeVar

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from rayfl.algorithms.base import (
    Batch,
    ClientContext,
    ModelClient,
    P,
    Payload,
    Reply,
    RoundContext,
    Server,
    ServerContext,
    Trainer,
)
from rayfl.models import SplitModel


def class_sums(
    values: torch.Tensor, labels: torch.Tensor, num_classes: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-class sums of the rows of `values` `(B, D)` and the per-class counts `(C,)`."""
    sums = torch.zeros(num_classes, values.shape[1], dtype=values.dtype, device=values.device)
    sums.index_add_(0, labels, values)
    counts = torch.bincount(labels, minlength=num_classes).to(values.dtype)
    return sums, counts


@torch.no_grad()
def class_means(
    fn: Callable[[torch.Tensor], torch.Tensor], batches: Iterable[Batch], num_classes: int
) -> Payload:
    """Per-class means of the `(B, D)` values `fn(x)` (features for prototypes, logits for FD)
    over `(x, y)` batches, as a class-statistics payload (unseen classes: a zero row)."""
    sums: torch.Tensor | None = None
    counts: torch.Tensor | None = None
    for x, y in batches:
        s, c = class_sums(fn(x).float(), y, num_classes)
        sums = s if sums is None else sums + s
        counts = c if counts is None else counts + c
    if sums is None or counts is None:
        raise ValueError("class_means needs at least one batch")
    return stats_payload(sums, counts)


def stats_payload(sums: torch.Tensor, counts: torch.Tensor) -> Payload:
    """A class-statistics payload from per-class sums `(C, D)` and counts `(C,)`."""
    means = sums / counts.clamp(min=1.0).unsqueeze(1)
    return {
        "means": means.detach().cpu().numpy().astype(np.float32),
        "counts": counts.detach().cpu().numpy().astype(np.float32),
    }


def empty_class_stats(num_classes: int, dim: int) -> Payload:
    """A class-statistics payload with no class seen yet (what goes down before round one)."""
    return {
        "means": np.zeros((num_classes, dim), dtype=np.float32),
        "counts": np.zeros(num_classes, dtype=np.float32),
    }


def aggregate_class_means(stats: Sequence[Mapping[str, np.ndarray]]) -> Payload:
    """Count-weighted per-class average of class-statistics payloads.

    `means[c] = sum_k n_kc * m_kc / sum_k n_kc`, i.e. the mean of class c over every sample of
    every client; classes no client saw stay zero with count 0.
    """
    if not stats:
        raise ValueError("nothing to aggregate")
    sums = np.zeros(stats[0]["means"].shape, dtype=np.float64)
    counts = np.zeros(stats[0]["counts"].shape, dtype=np.float64)
    for s in stats:
        n = np.asarray(s["counts"], dtype=np.float64)
        sums += n[:, None] * np.asarray(s["means"], dtype=np.float64)
        counts += n
    means = sums / np.maximum(counts, 1.0)[:, None]
    return {"means": means.astype(np.float32), "counts": counts.astype(np.float32)}


def presence(stats: Mapping[str, np.ndarray]) -> Payload:
    """The payload with its counts replaced by 0/1 presence: count-weighted aggregation of such
    payloads is the unweighted mean over the clients that hold each class (FedProto's official
    `proto_aggregation`)."""
    counts = (np.asarray(stats["counts"]) > 0).astype(np.float32)
    return {"means": np.asarray(stats["means"], dtype=np.float32), "counts": counts}


def stats_tensors(
    stats: Mapping[str, np.ndarray], device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """`(means, counts)` of a class-statistics payload as tensors on `device`."""
    means = torch.as_tensor(np.array(stats["means"]), dtype=torch.float32, device=device)
    counts = torch.as_tensor(np.array(stats["counts"]), dtype=torch.float32, device=device)
    return means, counts


def masked_class_mse(
    values: torch.Tensor, labels: torch.Tensor, table: torch.Tensor, counts: torch.Tensor
) -> torch.Tensor:
    """Mean squared distance of each row of `values` to its class's row of `table`.

    Rows whose class has no entry (`counts[y] == 0`) contribute zero but still count in the mean,
    as in the official FedProto code (`MSELoss(proto_new, rep)` with unknown rows copied from
    `rep`), so the loss scale does not jump when a class first appears.
    """
    known = (counts[labels] > 0).unsqueeze(1).to(values.dtype)
    target = table[labels].to(values.dtype)
    return F.mse_loss(values * known, target * known)


def prototype_pairs(stats: Sequence[Mapping[str, np.ndarray]]) -> tuple[np.ndarray, np.ndarray]:
    """Every (prototype, class) pair of the uploaded class statistics with count > 0, clients
    in order: `(protos (P, D) float32, labels (P,) int64)`."""
    protos: list[np.ndarray] = []
    labels: list[np.ndarray] = []
    for s in stats:
        seen = np.flatnonzero(np.asarray(s["counts"]) > 0)
        protos.append(np.asarray(s["means"], dtype=np.float32)[seen])
        labels.append(seen.astype(np.int64))
    if not protos:
        return np.zeros((0, 0), dtype=np.float32), np.zeros(0, dtype=np.int64)
    return np.concatenate(protos), np.concatenate(labels)


class ClassStatsClient(ModelClient[P]):
    """A client that trains its model and uploads per-class means of `statistic(x)` (FD: logits;
    FedProto, FedGH: features): either those of its training forward passes (train mode, before
    each step's update, summed over every step of the round: `collects_in_training`) or those of
    one eval-mode pass over its training split after training. Subclasses say how the broadcast
    is received, what `statistic` is, the loss computed from it (`loss_from`) and, if need be,
    how `train` differs."""

    def __init__(self, ctx: ClientContext, params: P) -> None:
        super().__init__(ctx, params)
        self.stats: Payload = {}
        # per-class sums and counts of this round's training statistics (collects_in_training)
        self.step_sums: tuple[torch.Tensor, torch.Tensor] | None = None

    def statistic(self, x: torch.Tensor) -> torch.Tensor:
        """The per-sample values whose class means travel (default: the model's features)."""
        return self.model.features(x)

    def loss_from(self, values: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """The training loss of a batch given its `statistic` values (with their graph); needed
        by `collecting_step` only."""
        raise NotImplementedError

    def collects_in_training(self) -> bool:
        """Whether the uploaded means are those of the training steps (default: a pass after)."""
        return False

    def averaged_over_clients(self) -> bool:
        """Whether the server should average each class's statistics over clients, unweighted:
        the upload then carries 0/1 presence as its counts (see `presence`)."""
        return False

    def train(self, trainer: Trainer) -> dict[str, float]:
        """Local training (default: the engine's loop over `training_step` for the model, or over
        `collecting_step` when the statistics come from the training steps)."""
        if not self.collects_in_training():
            return trainer.run(self.training_step, [self.model])
        self.step_sums = None
        return trainer.run(self.collecting_step, [self.model])

    def collecting_step(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """`training_step` that also adds the batch's statistics (train mode, before the update)
        to the round's per-class sums."""
        values = self.statistic(x)
        sums, counts = class_sums(values.detach().float(), y, self.ctx.num_classes)
        if self.step_sums is not None:
            sums, counts = sums + self.step_sums[0], counts + self.step_sums[1]
        self.step_sums = (sums, counts)
        return self.loss_from(values, y)

    def fit(self, trainer: Trainer) -> dict[str, float]:
        metrics = self.train(trainer)
        self.stats = self.collect(trainer)
        return metrics

    def collect(self, trainer: Trainer) -> Payload:
        """The statistics to upload: the training steps' (`collects_in_training`), else one
        eval-mode pass over the training split after training, so they describe the model as
        trained this round; as presence counts when `averaged_over_clients`."""
        if self.collects_in_training() and self.step_sums is not None:
            stats = stats_payload(*self.step_sums)
            self.step_sums = None
        else:
            self.model.eval()
            stats = class_means(self.statistic, trainer.batches("train"), self.ctx.num_classes)
        return presence(stats) if self.averaged_over_clients() else stats

    def upload(self) -> Payload:
        return self.stats


class TableParams(Protocol):
    @property
    def collect(self) -> str: ...  # "train": statistics of the training steps

    @property
    def average(self) -> str: ...  # "clients": the server averages over clients


TP = TypeVar("TP", bound=TableParams)


class ClassTableClient(ClassStatsClient[TP]):
    """A client trained against the server's class table of `dim` columns (FD's class logits;
    default: the feature size, FedProto's prototypes): its Params' `collect` says whether its
    statistics come from the training steps, `average` whether the server averages them over
    clients."""

    def __init__(self, ctx: ClientContext, params: TP, dim: int | None = None) -> None:
        super().__init__(ctx, params)
        dim = self.model.feature_dim if dim is None else dim
        self.global_table = torch.zeros(ctx.num_classes, dim)
        self.global_counts = torch.zeros(ctx.num_classes)

    def receive(self, payload: Payload, rnd: RoundContext) -> None:
        self.global_table, self.global_counts = stats_tensors(payload, self.ctx.device)

    def collects_in_training(self) -> bool:
        return self.params.collect == "train"

    def averaged_over_clients(self) -> bool:
        return self.params.average == "clients"

    def training_step(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return self.loss_from(self.statistic(x), y)


class ClassTableServer(Server[P]):
    """Server of per-class statistics (FD's class logits, FedProto's prototypes): it averages the
    clients' tables per class by count and broadcasts the result."""

    prefix = "classes"
    sum_form = "class_means"
    state_attrs = ("table",)

    def __init__(self, ctx: ServerContext, params: P, dim: int) -> None:
        super().__init__(ctx, params)
        self.table = empty_class_stats(ctx.num_classes, dim)

    def broadcast(self, arch: str, rnd: RoundContext) -> Payload:
        return dict(self.table)

    def aggregate(self, replies: Sequence[Reply], rnd: RoundContext) -> dict[str, float]:
        self.table = aggregate_class_means([r.payload for r in replies])
        return {f"{self.prefix}/classes_known": float(np.count_nonzero(self.table["counts"]))}


class NearestPrototype(nn.Module):
    """A split model that predicts the class of the nearest global prototype (FedProto's and
    FedTGP's inference, as in their official code): logits are minus the squared Euclidean
    distance of `model.features(x)` to each known prototype, `-inf` for classes without one.
    With no prototype known yet it falls back to the model's own head."""

    def __init__(self, model: SplitModel, table: torch.Tensor, counts: torch.Tensor) -> None:
        super().__init__()
        self.model = model
        self.table = table
        self.known = counts > 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        features = self.model.features(x)
        if not bool(self.known.any()):
            return self.model.head(features)
        dist = (features.unsqueeze(1) - self.table.unsqueeze(0)).pow(2).sum(-1)
        return (-dist).masked_fill(~self.known, float("-inf"))
