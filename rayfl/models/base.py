"""`SplitModel`: every client model is a feature extractor plus a head with a known feature size.

Prototypes, logits, heads and features can then be shared between heterogeneous models
(HtFLlib's one good idea).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from rayfl.registry import MODELS


class SplitModel(nn.Module):
    """`forward(x) = head(features(x))` with `features(x)` of size `feature_dim`.

    Args:
        encoder: maps a batch of inputs to a `(batch, feature_dim)` tensor.
        head: maps features to logits.
        feature_dim: size of the representation between the two.
    """

    def __init__(self, encoder: nn.Module, head: nn.Module, feature_dim: int) -> None:
        super().__init__()
        self.encoder = encoder
        self.head = head
        self.feature_dim = int(feature_dim)

    def features(self, x: torch.Tensor) -> torch.Tensor:
        return self.encoder(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x))


class MaxPool2d(nn.MaxPool2d):
    """`nn.MaxPool2d` that, in CPU inference (no autograd), pools a channels-last copy of its
    input: PyTorch's NCHW CPU kernel is the slowest layer of the small CNNs there (half of
    cnn_small's forward pass; 10.3 ms against 4.0 ms for 64x32x28x28 on one thread, torch
    2.14). The values are those of the stock kernel, bit for bit (a maximum is exact). Training
    keeps the stock kernel: with its backward pass the copy costs more than it saves."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if (
            torch.is_grad_enabled()
            or self.return_indices
            or x.dim() != 4
            or x.device.type != "cpu"
            or torch._C._are_functorch_transforms_active()  # vmap refuses memory formats
        ):
            return super().forward(x)
        return super().forward(x.contiguous(memory_format=torch.channels_last)).contiguous()


def build_model(arch: str, in_shape: Sequence[int], num_classes: int) -> SplitModel:
    """Build the registered architecture `arch` for inputs of `in_shape` (without batch)."""
    builder = MODELS.get(arch, key="model")
    return builder(tuple(in_shape), int(num_classes))
