"""Scoring models whose batch norm keeps no running statistics, independently of the batch.

HeteroFL's static batch norm (`ResNet18(static_bn=True)`, Diao et al., ICLR 2021, Sec. 3.2)
normalizes with the statistics of the batch it is given, in evaluation too. The paper's sBN is
followed: before a model is scored, every such layer gets running statistics (a cumulative
average, `momentum=None`) over a pass of the training data in which each layer normalizes with
its batch's statistics, exactly as in training; the model is scored in eval mode with them, and
the layers return to their static form afterwards. Why, and the one deliberate deviation from
the official code (only the batch-norm layers are in train mode during the pass, so HeteroFL's
`Scaler` is not applied to what they collect): docs/engine.md, "Scores do not depend on the
batch".
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager

import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

__all__ = ["batch_independent", "batch_stat_norms", "running_stats_kept"]


def batch_stat_norms(model: nn.Module) -> list[_BatchNorm]:
    """The batch-norm layers of `model` that normalize with batch statistics in eval mode."""
    return [
        m
        for m in model.modules()
        if isinstance(m, _BatchNorm) and not m.track_running_stats and m.running_mean is None
    ]


@contextmanager
def batch_independent(
    model: nn.Module, batches: Callable[[], Iterable[torch.Tensor]]
) -> Iterator[nn.Module]:
    """`model` in eval mode with every batch-statistics batch norm given running statistics over
    `batches()` (inputs only; called only when the model has such a layer), restored on exit.

    Inside the block the model's output for an input does not depend on the rest of its batch.
    """
    norms = batch_stat_norms(model)
    model.eval()
    if not norms:
        yield model
        return
    saved = [m.momentum for m in norms]
    try:
        for m in norms:
            like = m.weight if m.weight is not None else next(model.parameters(), None)
            device = like.device if like is not None else None
            dtype = like.dtype if like is not None else None
            m.running_mean = torch.zeros(m.num_features, device=device, dtype=dtype)
            m.running_var = torch.ones(m.num_features, device=device, dtype=dtype)
            m.num_batches_tracked = torch.tensor(0, dtype=torch.long, device=device)
            m.track_running_stats = True
            m.momentum = None  # a cumulative average over the pass
            m.train()
        with torch.no_grad():
            for x in batches():
                model(x)
        model.eval()
        yield model
    finally:
        for m, momentum in zip(norms, saved):
            m.running_mean = None
            m.running_var = None
            m.num_batches_tracked = None
            m.track_running_stats = False
            m.momentum = momentum


@contextmanager
def running_stats_kept(model: nn.Module) -> Iterator[nn.Module]:
    """`model` whose batch norms still normalize with batch statistics in training but leave
    their running statistics as they are: for a forward pass on inputs the model is not scored
    on (pFedES `input`'s proxied images), so that evaluation normalizes with the statistics of
    the inputs it does see."""
    norms = [m for m in model.modules() if isinstance(m, _BatchNorm) and m.track_running_stats]
    saved = [(m.momentum, m.num_batches_tracked) for m in norms]
    try:
        for m in norms:
            m.momentum = 0.0  # running = (1 - 0) * running + 0 * batch
            if m.num_batches_tracked is not None:
                m.num_batches_tracked = m.num_batches_tracked.clone()
        yield model
    finally:
        for m, (momentum, tracked) in zip(norms, saved):
            m.momentum = momentum
            m.num_batches_tracked = tracked
