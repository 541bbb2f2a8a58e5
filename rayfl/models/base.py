"""`SplitModel`: every client model is a feature extractor plus a head with a known feature size.

Prototypes, logits, heads and features can then be shared between heterogeneous models
(HtFLlib's one good idea).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from rayfl.registry import Registry

# Architecture name -> builder `(in_shape, num_classes) -> SplitModel`; the built-ins are in zoo.
MODELS: Registry[Any] = Registry("model", group="rayfl.models")


class SplitModel(nn.Module):
    """`forward(x) = head(encoder(x))`; the encoder's output has `feature_dim` features."""

    def __init__(self, encoder: nn.Module, head: nn.Module, feature_dim: int) -> None:
        super().__init__()
        self.encoder = encoder
        self.head = head
        self.feature_dim = int(feature_dim)

    def features(self, x: torch.Tensor) -> torch.Tensor:
        return self.encoder(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x))


def place(module: nn.Module, device: torch.device) -> nn.Module:
    """Move `module` to `device` in the layout fastest there: on a CPU, channels-last (oneDNN's
    NHWC convolutions and the vectorized channels-last max-pool train small CNNs markedly
    faster; results differ from NCHW in float rounding only). Only when every convolution's
    channels are multiples of 8 (AVX2's block width): oneDNN's channels-last kernels corrupt
    the heap on odd widths (width-sliced ResNets of 6, 13 or 51 channels). GPUs keep theirs."""
    convs = [m for m in module.modules() if isinstance(m, nn.Conv2d)]
    # the first convolution reads the image: its input channels need not be blocked
    blocked = all(
        c.out_channels % 8 == 0 and (i == 0 or c.in_channels % 8 == 0) for i, c in enumerate(convs)
    )
    if torch.device(device).type == "cpu" and blocked:
        return module.to(device).to(memory_format=torch.channels_last)
    return module.to(device)


def build_model(arch: str, in_shape: Sequence[int], num_classes: int) -> SplitModel:
    """Build the registered architecture `arch` for inputs of `in_shape` (without batch)."""
    builder = MODELS.get(arch, key="model")
    return builder(tuple(in_shape), int(num_classes))
