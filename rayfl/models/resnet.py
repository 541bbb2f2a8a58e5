"""CIFAR-style ResNet-18 scaled in width (He et al. 2016; HeteroFL, Diao et al., ICLR 2021;
FedFD, Li et al., NeurIPS 2025), with its basic block and HeteroFL's scaler and static batch
norm. The zoo registers `resnet18` and `resnet18_w1`..`resnet18_w10` (`rayfl.models.zoo`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
from torch import nn

from rayfl.errors import ConfigError
from rayfl.models.base import SplitModel

#: Width multipliers of `resnet18_w1`..`resnet18_w10` (HeteroFL/FedFD's ten complexity levels).
RESNET18_WIDTHS: tuple[float, ...] = tuple(k / 10 for k in range(1, 11))

_RESNET18_CHANNELS = (64, 128, 256, 512)


class Scaler(nn.Module):
    """HeteroFL's scaler: divides activations by the width `rate` in training, identity in eval.

    A sub-model of width `rate` sees fewer input channels per unit, so its activations are
    smaller than the full model's; scaling them during local training keeps the magnitudes of
    all width levels comparable (Diao et al., "HeteroFL", ICLR 2021, Sec. 3.1).
    """

    def __init__(self, rate: float) -> None:
        super().__init__()
        if not rate > 0:
            raise ValueError(f"scaler rate must be > 0, got {rate}")
        self.rate = float(rate)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x / self.rate if self.training else x

    def extra_repr(self) -> str:
        return f"rate={self.rate}"


class BasicBlock(nn.Module):
    """ResNet basic block (two 3x3 convs, `stride` on the first and on the projection shortcut)
    with a `Scaler(scaler_rate)` after each conv when `scaler_rate` is given; `norm` builds the
    normalization of a number of channels."""

    def __init__(
        self,
        in_planes: int,
        planes: int,
        stride: int = 1,
        norm: Callable[[int], nn.Module] = nn.BatchNorm2d,
        scaler_rate: float | None = None,
    ) -> None:
        super().__init__()

        def scaler() -> nn.Module:
            return Scaler(scaler_rate) if scaler_rate is not None else nn.Identity()

        self.conv1 = nn.Conv2d(in_planes, planes, 3, stride=stride, padding=1, bias=False)
        self.scaler1 = scaler()
        self.bn1 = norm(planes)
        self.conv2 = nn.Conv2d(planes, planes, 3, stride=1, padding=1, bias=False)
        self.scaler2 = scaler()
        self.bn2 = norm(planes)
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or in_planes != planes:
            self.shortcut = nn.Sequential(
                nn.Conv2d(in_planes, planes, 1, stride=stride, bias=False), scaler(), norm(planes)
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.relu(self.bn1(self.scaler1(self.conv1(x))))
        out = self.bn2(self.scaler2(self.conv2(out)))
        return torch.relu(out + self.shortcut(x))


class _ResNetEncoder(nn.Module):
    def __init__(
        self,
        in_channels: int,
        channels: tuple[int, int, int, int],
        norm: Callable[[int], nn.Module],
        scaler_rate: float | None,
    ) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, channels[0], 3, stride=1, padding=1, bias=False)
        self.scaler1: nn.Module = Scaler(scaler_rate) if scaler_rate is not None else nn.Identity()
        self.bn1 = norm(channels[0])
        layers: list[nn.Module] = []
        in_planes = channels[0]
        for i, planes in enumerate(channels):
            stride = 1 if i == 0 else 2
            layers.append(
                nn.Sequential(
                    BasicBlock(in_planes, planes, stride, norm, scaler_rate),
                    BasicBlock(planes, planes, 1, norm, scaler_rate),
                )
            )
            in_planes = planes
        self.layer1, self.layer2, self.layer3, self.layer4 = layers
        self.pool = nn.AdaptiveAvgPool2d(1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.relu(self.bn1(self.scaler1(self.conv1(x))))
        out = self.layer4(self.layer3(self.layer2(self.layer1(out))))
        return torch.flatten(self.pool(out), 1)


class ResNet18(SplitModel):
    """CIFAR-style ResNet-18 with a width multiplier (He et al. 2016; HeteroFL's width scaling).

    Stem 3x3 conv stride 1 without max-pool, BasicBlocks [2, 2, 2, 2] with
    `max(1, round(c * width))` channels for c in 64/128/256/512, global average pool; the
    features are the pooled last stage (`feature_dim = round(512 * width)`), the head is one
    linear layer. Every parameter of a narrower model is the leading slice of the same
    parameter of a wider one, which `rayfl.models.slicing` relies on. `static_bn`: HeteroFL's
    static batch norm (batch statistics in training and evaluation, no running buffers);
    `scaler`: a HeteroFL `Scaler(width)` after every conv (active in training only).
    """

    def __init__(
        self,
        in_channels: int,
        num_classes: int,
        width: float = 1.0,
        static_bn: bool = False,
        scaler: bool = False,
    ) -> None:
        if not width > 0:
            raise ConfigError(f"ResNet18 width is {width}; it must be > 0")
        c0, c1, c2, c3 = (max(1, round(c * width)) for c in _RESNET18_CHANNELS)
        # HeteroFL's static BN keeps no running statistics
        static = functools.partial(nn.BatchNorm2d, momentum=None, track_running_stats=False)
        norm = static if static_bn else nn.BatchNorm2d
        encoder = _ResNetEncoder(in_channels, (c0, c1, c2, c3), norm, width if scaler else None)
        super().__init__(encoder, nn.Linear(c3, num_classes), c3)
        self.width = float(width)
        self.static_bn = bool(static_bn)


def resnet_width(arch: str) -> float:
    """Width multiplier of a `resnet_widths` architecture name (`resnet18` is 1.0)."""
    if arch == "resnet18":
        return 1.0
    prefix = "resnet18_w"
    if arch.startswith(prefix) and arch[len(prefix) :].isdigit():
        level = int(arch[len(prefix) :])
        if 1 <= level <= len(RESNET18_WIDTHS):
            return RESNET18_WIDTHS[level - 1]
    raise ConfigError(
        f"model {arch!r} is not a width-scaled ResNet-18; use 'resnet18' or "
        f"'resnet18_w1'..'resnet18_w{len(RESNET18_WIDTHS)}'"
    )
