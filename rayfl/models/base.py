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


def build_model(arch: str, in_shape: Sequence[int], num_classes: int) -> SplitModel:
    """Build the registered architecture `arch` for inputs of `in_shape` (without batch)."""
    builder = MODELS.get(arch, key="model")
    return builder(tuple(in_shape), int(num_classes))
