"""Pure helpers shared by algorithms: averaging, weight caps, update clipping, EMA, KD losses,
truncated-SVD compression of updates; the payload helpers (numpy state dicts to and from
modules, their byte size, an architecture's size).

All take and return plain numpy state dicts or tensors, so each has a golden-number test.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from rayfl.models import build_model

State = Mapping[str, np.ndarray]

# `kd_loss` reductions: KL per sample (`batchmean`) or per entry (`mean`, nn.KLDivLoss default)
KD_REDUCTIONS = ("batchmean", "mean")


def normalized_weights(counts: Sequence[float], cap: float | None = None) -> np.ndarray:
    """Sample-count weights summing to one; with `cap`, no weight exceeds it (excess spread over the rest).

    The cap is applied by water-filling: capped weights are fixed at `cap` and the remaining mass is
    redistributed proportionally among the others, repeated until no weight exceeds the cap. When
    `cap * n < 1` a cap cannot hold and the weights become uniform.
    """
    w = np.asarray(counts, dtype=np.float64)
    if w.ndim != 1 or len(w) == 0 or np.any(w < 0) or w.sum() <= 0:
        raise ValueError(f"weights need positive counts, got {counts!r}")
    w = w / w.sum()
    if cap is None or cap >= 1.0:
        return w
    if cap * len(w) <= 1.0:
        return np.full_like(w, 1.0 / len(w))
    capped = np.zeros(len(w), dtype=bool)
    for _ in range(len(w)):
        over = (w > cap + 1e-12) & ~capped
        if not over.any():
            break
        capped |= over
        free = ~capped
        w[capped] = cap
        w[free] = w[free] / w[free].sum() * (1.0 - cap * capped.sum())
    return w


def weighted_average(
    states: Sequence[State], weights: Sequence[float] | np.ndarray
) -> dict[str, np.ndarray]:
    """Per-key weighted average of numpy state dicts (weights need not be normalized).

    Integer entries (e.g. BatchNorm's `num_batches_tracked`) take the first state's value.
    """
    if not states:
        raise ValueError("nothing to average")
    w = np.asarray(weights, dtype=np.float64)
    w = w / w.sum()
    out: dict[str, np.ndarray] = {}
    for key, first in states[0].items():
        if not np.issubdtype(first.dtype, np.floating):
            out[key] = np.array(first)
            continue
        acc = np.zeros(first.shape, dtype=np.float64)
        for wi, s in zip(w, states):
            acc += wi * s[key]
        out[key] = acc.astype(first.dtype)
    return out


def clip_update(update: State, max_norm: float) -> dict[str, np.ndarray]:
    """Scale a whole update (a state difference) so that its global L2 norm is at most `max_norm`."""
    norm = float(
        np.sqrt(sum(float(np.sum(np.square(v, dtype=np.float64))) for v in update.values()))
    )
    scale = min(1.0, max_norm / norm) if norm > 0 else 1.0
    return {k: (v * scale).astype(v.dtype) for k, v in update.items()}


def subtract(a: State, b: State) -> dict[str, np.ndarray]:
    return {k: a[k] - b[k] if np.issubdtype(a[k].dtype, np.floating) else np.array(a[k]) for k in a}


def add(a: State, b: State) -> dict[str, np.ndarray]:
    return {k: a[k] + b[k] if np.issubdtype(a[k].dtype, np.floating) else np.array(a[k]) for k in a}


def ema(old: State, new: State, decay: float) -> dict[str, np.ndarray]:
    """`decay * old + (1 - decay) * new` for float entries; other entries take `new`."""
    return {
        k: (decay * old[k] + (1.0 - decay) * new[k]).astype(old[k].dtype)
        if np.issubdtype(old[k].dtype, np.floating)
        else np.array(new[k])
        for k in old
    }


def kd_loss(
    student_logits: torch.Tensor,
    teacher_logits: torch.Tensor,
    temperature: float,
    reduction: str = "batchmean",
) -> torch.Tensor:
    """Hinton's distillation loss `T^2 * KL(softmax(teacher/T) || softmax(student/T))`.

    `reduction="batchmean"` sums the KL over the classes and averages over the batch (the KL
    per sample); `"mean"` averages over every entry, i.e. also divides by the number of classes,
    which is what `nn.KLDivLoss()` does with its default reduction (HtFLlib's FML and FedKD).
    Gradients flow into the student, and into the teacher unless the caller detached it.
    """
    if reduction not in KD_REDUCTIONS:
        raise ValueError(f"reduction must be one of {KD_REDUCTIONS} (got {reduction!r})")
    t = float(temperature)
    log_p_student = F.log_softmax(student_logits / t, dim=1)
    log_p_teacher = F.log_softmax(teacher_logits / t, dim=1)
    total = F.kl_div(log_p_student, log_p_teacher, reduction="sum", log_target=True)
    # spelt out rather than passed on: torch warns that its `mean` will become `batchmean`
    per = student_logits.shape[0] if reduction == "batchmean" else student_logits.numel()
    return total / per * (t * t)


def logit_kl(a_logits: torch.Tensor, b_logits: torch.Tensor) -> torch.Tensor:
    """`KL(softmax(a) || softmax(b))`, batch mean, temperature 1 (a diagnostic)."""
    return F.kl_div(
        F.log_softmax(b_logits, 1),
        F.log_softmax(a_logits, 1),
        reduction="batchmean",
        log_target=True,
    )


# -- truncated-SVD compression of updates (FedKD; usable by any algorithm) ---------------------

_SVD_PARTS = ("::u", "::s", "::vh")


def energy_rank(singular_values: np.ndarray, energy: float) -> int:
    """Fewest leading singular values whose squared sum is at least `energy` of the total (>= 1)."""
    sq = np.square(singular_values.astype(np.float64))
    total = sq.sum()
    if total <= 0:
        return 1
    first = int(
        np.searchsorted(np.cumsum(sq) / total, energy - 1e-12)
    )  # cumulative share >= energy
    return min(len(sq), first + 1)


def svd_compress(update: State, energy: float) -> dict[str, np.ndarray]:
    """Truncated-SVD form of a state update; entries it would not shrink stay dense."""
    out: dict[str, np.ndarray] = {}
    for key, value in update.items():
        if value.ndim < 2 or not np.issubdtype(value.dtype, np.floating):
            out[key] = value
            continue
        matrix = value.reshape(value.shape[0], -1).astype(np.float64)
        u, s, vh = np.linalg.svd(matrix, full_matrices=False)
        k = energy_rank(s, energy)
        m, n = matrix.shape
        if k * (m + n + 1) >= m * n:  # no saving: send it as it is
            out[key] = value
            continue
        out[key + "::u"] = u[:, :k].astype(value.dtype)
        out[key + "::s"] = s[:k].astype(value.dtype)
        out[key + "::vh"] = vh[:k].reshape(k, *value.shape[1:]).astype(value.dtype)
    return out


def svd_decompress(payload: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Inverse of `svd_compress` (up to the truncation)."""
    out: dict[str, np.ndarray] = {}
    for key, value in payload.items():
        if key.endswith("::u"):
            name = key[: -len("::u")]
            s, vh = payload[name + "::s"], payload[name + "::vh"]
            matrix = (value * s) @ vh.reshape(len(s), -1)
            out[name] = matrix.reshape(value.shape[0], *vh.shape[1:]).astype(value.dtype)
        elif not key.endswith(_SVD_PARTS):
            out[key] = np.asarray(value)
    return out


def grouped_average(
    states: Sequence[State], weights: Sequence[float], groups: Sequence[str]
) -> dict[str, dict[str, np.ndarray]]:
    """`weighted_average` within each group: the states that carry one group label (clients of
    one architecture) are averaged with their weights, different groups are never mixed.

    Returns `{group: average}`, the groups in order of first appearance.
    """
    if not (len(states) == len(weights) == len(groups)):
        raise ValueError("states, weights and groups need one entry each")
    members: dict[str, list[int]] = {}
    for i, g in enumerate(groups):
        members.setdefault(g, []).append(i)
    return {
        g: weighted_average([states[i] for i in idx], [weights[i] for i in idx])
        for g, idx in members.items()
    }


@functools.lru_cache(maxsize=64)
def arch_sizes(arch: str, in_shape: tuple[int, ...], num_classes: int) -> tuple[int, int]:
    """`(parameters, feature size)` of architecture `arch`. Building it draws nothing from the
    caller's random stream (a cache hit would not), so asking never changes a run's numbers."""
    with torch.random.fork_rng(devices=[]):
        model = build_model(arch, in_shape, num_classes)
    return sum(p.numel() for p in model.parameters()), model.feature_dim


def to_numpy(state: Mapping[str, torch.Tensor]) -> dict[str, np.ndarray]:
    """A torch state dict as detached CPU numpy arrays (the travelling format)."""
    return {k: v.detach().cpu().numpy().copy() for k, v in state.items()}


def load_numpy(module: nn.Module, state: Mapping[str, np.ndarray], strict: bool = True) -> None:
    """Load a numpy state dict (possibly read-only, zero-copy from Ray) into `module` in place."""
    module.load_state_dict(
        {k: torch.from_numpy(np.array(v)) for k, v in state.items()}, strict=strict
    )


def unprefixed(payload: Mapping[str, np.ndarray], prefix: str) -> dict[str, np.ndarray]:
    """Copies of the entries of `payload` whose key starts with `prefix`, the prefix dropped
    (one of several states travelling in one payload)."""
    return {k[len(prefix) :]: np.array(v) for k, v in payload.items() if k.startswith(prefix)}


def payload_nbytes(payload: Mapping[str, Any]) -> int:
    """Bytes on the wire of a payload (numpy arrays, nested dicts of them)."""
    total = 0
    for v in payload.values():
        if isinstance(v, np.ndarray):
            total += v.nbytes
        elif isinstance(v, Mapping):
            total += payload_nbytes(v)
    return total
