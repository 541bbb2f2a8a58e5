"""The architecture zoo: every model a config can name, registered in `MODELS`.

Each builder has the signature `builder(in_shape, num_classes) -> SplitModel`, where
`in_shape` excludes the batch dimension: `(C, H, W)` for images, `(D,)` for flat features.
Flattened sizes are computed from `in_shape`, so every image model runs on 1x28x28
(Fashion-MNIST), 3x32x32 (CIFAR) and small synthetic images such as 1x8x8.

Families of architectures (see `rayfl.models.families`):

* `seed3` (the pFedES design document's three groups): `cnn_small`, `resnet_small`, `mlp`,
  all with `feature_dim` 128 so feature- and prototype-sharing baselines work across them.
* `cnn5`: CNN-1..CNN-5 of the official pFedES code (Yi et al., AAAI 2025), `cnn1`..`cnn5`,
  `feature_dim` 500.
* `resnet_widths`: CIFAR-style ResNet-18 scaled in width (HeteroFL, Diao et al., ICLR 2021;
  FedFD, Li et al., NeurIPS 2025): `resnet18` and `resnet18_w1`..`resnet18_w10`.
* `tiny2`: `tiny_a` and `tiny_b`, two very small heterogeneous models for tests.

pFedES proxies, registered so `rayfl ls` lists them but normally used through their classes:
`proxy_kd` (`ProxyExtractor`, the design document's proxy feature extractor) and
`proxy_input` (`InputProxy`, the official code's image-to-image proxy; its builder returns
the bare module because it is not a classifier).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Sequence

import torch
from torch import nn

from rayfl.errors import ConfigError
from rayfl.models.base import MODELS, SplitModel

logger = logging.getLogger(__name__)

__all__ = [
    "AUXILIARY_MODELS",
    "RESNET18_WIDTHS",
    "BasicBlock",
    "InputProxy",
    "ProxyExtractor",
    "ResNet18",
    "Scaler",
    "resnet_width",
]

#: Registered names whose builder does not return a classifier (`SplitModel`); they cannot
#: be client architectures in a family.
AUXILIARY_MODELS = frozenset({"proxy_input"})

#: Width multipliers of `resnet18_w1`..`resnet18_w10` (HeteroFL/FedFD's ten complexity levels).
RESNET18_WIDTHS: tuple[float, ...] = tuple(k / 10 for k in range(1, 11))

_RESNET18_CHANNELS = (64, 128, 256, 512)


# --------------------------------------------------------------------------------------------
# input-shape helpers
# --------------------------------------------------------------------------------------------


def _check_common(arch: str, in_shape: Sequence[int], num_classes: int) -> tuple[int, ...]:
    shape = tuple(int(d) for d in in_shape)
    if not shape or any(d < 1 for d in shape):
        raise ConfigError(
            f"model {arch!r}: input shape {shape} is invalid; every dimension must be >= 1"
        )
    if int(num_classes) < 1:
        raise ConfigError(f"model {arch!r}: num_classes is {num_classes}; it must be >= 1")
    return shape


def _image_shape(arch: str, in_shape: Sequence[int], num_classes: int) -> tuple[int, int, int]:
    """Validate `in_shape` as an image `(C, H, W)` for the convolutional net `arch`."""
    shape = _check_common(arch, in_shape, num_classes)
    if len(shape) != 3:
        raise ConfigError(
            f"model {arch!r} is convolutional and needs image inputs (C, H, W), got in_shape "
            f"{shape}; use 'mlp' (or 'tiny_a'/'tiny_b') for flat features"
        )
    return shape[0], shape[1], shape[2]


def _require_min_side(arch: str, shape: tuple[int, int, int], min_side: int) -> None:
    if min(shape[1], shape[2]) < min_side:
        raise ConfigError(
            f"model {arch!r} needs images of at least {min_side}x{min_side}, got "
            f"{shape[1]}x{shape[2]}; use a larger input or 'mlp'"
        )


def _flat_size(module: nn.Module, in_shape: tuple[int, ...]) -> int:
    """Number of features per sample that `module` outputs for inputs of `in_shape`."""
    with torch.no_grad():
        out = module(torch.zeros(1, *in_shape))
    return int(out[0].numel())


# --------------------------------------------------------------------------------------------
# building blocks
# --------------------------------------------------------------------------------------------


class Scaler(nn.Module):
    """HeteroFL's scaler: divides activations by the width `rate` in training, identity in eval.

    A sub-model of width `rate` sees fewer input channels per unit, so its activations are
    smaller than the full model's; scaling them during local training keeps the magnitudes of
    all width levels comparable (Diao et al., "HeteroFL", ICLR 2021, Sec. 3.1).

    Args:
        rate: the width multiplier of the model the scaler sits in (0 < rate <= 1).
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


def _batch_norm(static: bool) -> Callable[[int], nn.Module]:
    """BatchNorm factory; `static=True` is HeteroFL's static BN (no running statistics)."""
    if static:
        return lambda c: nn.BatchNorm2d(c, momentum=None, track_running_stats=False)
    return nn.BatchNorm2d


class BasicBlock(nn.Module):
    """ResNet basic block (two 3x3 convs) with an optional HeteroFL scaler after each conv.

    Args:
        in_planes: input channels.
        planes: output channels.
        stride: stride of the first conv (and of the projection shortcut).
        norm: factory `channels -> normalization module`.
        scaler_rate: when given, a `Scaler(scaler_rate)` follows every conv; else identity.
    """

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


# --------------------------------------------------------------------------------------------
# family seed3: the pFedES design document's three groups (feature_dim 128)
# --------------------------------------------------------------------------------------------

_SEED3_FEATURES = 128


@MODELS.register("cnn_small")
def cnn_small(in_shape: tuple[int, ...], num_classes: int) -> SplitModel:
    """Two conv layers (32, 64 channels, 3x3, ReLU, 2x2 max-pool), then linear to 128."""
    shape = _image_shape("cnn_small", in_shape, num_classes)
    _require_min_side("cnn_small", shape, 4)
    trunk = nn.Sequential(
        nn.Conv2d(shape[0], 32, 3, padding=1),
        nn.ReLU(inplace=True),
        nn.MaxPool2d(2),
        nn.Conv2d(32, 64, 3, padding=1),
        nn.ReLU(inplace=True),
        nn.MaxPool2d(2),
        nn.Flatten(),
    )
    flat = _flat_size(trunk, shape)
    encoder = nn.Sequential(*trunk, nn.Linear(flat, _SEED3_FEATURES), nn.ReLU(inplace=True))
    return SplitModel(encoder, nn.Linear(_SEED3_FEATURES, num_classes), _SEED3_FEATURES)


@MODELS.register("resnet_small")
def resnet_small(in_shape: tuple[int, ...], num_classes: int) -> SplitModel:
    """A small residual CNN: 16-channel stem, BasicBlocks 32/stride 2 and 64/stride 2, GAP, 128.

    No block runs at full resolution, which keeps it about as cheap as `cnn_small` on CPU.
    """
    shape = _image_shape("resnet_small", in_shape, num_classes)
    encoder = nn.Sequential(
        nn.Conv2d(shape[0], 16, 3, padding=1, bias=False),
        nn.BatchNorm2d(16),
        nn.ReLU(inplace=True),
        BasicBlock(16, 32, stride=2),
        BasicBlock(32, 64, stride=2),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(64, _SEED3_FEATURES),
        nn.ReLU(inplace=True),
    )
    return SplitModel(encoder, nn.Linear(_SEED3_FEATURES, num_classes), _SEED3_FEATURES)


@MODELS.register("mlp")
def mlp(in_shape: tuple[int, ...], num_classes: int) -> SplitModel:
    """Flatten, hidden layer of 256, hidden layer of 128 (the features); any input shape."""
    shape = _check_common("mlp", in_shape, num_classes)
    encoder = nn.Sequential(
        nn.Flatten(),
        nn.Linear(math.prod(shape), 256),
        nn.ReLU(inplace=True),
        nn.Linear(256, _SEED3_FEATURES),
        nn.ReLU(inplace=True),
    )
    return SplitModel(encoder, nn.Linear(_SEED3_FEATURES, num_classes), _SEED3_FEATURES)


# --------------------------------------------------------------------------------------------
# family cnn5: CNN-1..CNN-5 of the official pFedES code (feature_dim 500)
# --------------------------------------------------------------------------------------------

# (conv2 output channels, fc1 output size) of CNN-1..CNN-5; conv1 is C->16 in all of them.
_CNN5_SPECS = {1: (32, 2000), 2: (16, 2000), 3: (32, 1000), 4: (32, 800), 5: (32, 500)}
_CNN5_FEATURES = 500


def _cnn5(index: int, in_shape: tuple[int, ...], num_classes: int) -> SplitModel:
    """CNN-`index` of pFedES's official code (Yi et al., AAAI 2025).

    conv 5x5 (C->16) + ReLU + 2x2 max-pool, conv 5x5 (16->32, CNN-2: 16->16) + ReLU +
    2x2 max-pool, fc1 (flat->2000/2000/1000/800/500) + ReLU, fc2 (->500) + ReLU = the
    500-d features; head fc3 (500->classes). fc1's input size follows the image size
    (800 for 3x32x32, 512 for 1x28x28).

    Images smaller than 16x16 cannot pass two unpadded 5x5 convs and pools, so for them the
    convs use padding=2 (size-preserving); this is a deviation from the official code that
    only lets the family run on tiny synthetic inputs such as 1x8x8.
    """
    arch = f"cnn{index}"
    shape = _image_shape(arch, in_shape, num_classes)
    conv2_out, fc1_out = _CNN5_SPECS[index]
    padding = 0 if min(shape[1], shape[2]) >= 16 else 2
    if padding:
        _require_min_side(arch, shape, 4)
        logger.debug("%s: input %s is smaller than 16x16, using padding=2", arch, shape)
    trunk = nn.Sequential(
        nn.Conv2d(shape[0], 16, 5, padding=padding),
        nn.ReLU(inplace=True),
        nn.MaxPool2d(2, 2),
        nn.Conv2d(16, conv2_out, 5, padding=padding),
        nn.ReLU(inplace=True),
        nn.MaxPool2d(2, 2),
        nn.Flatten(),
    )
    flat = _flat_size(trunk, shape)
    encoder = nn.Sequential(
        *trunk,
        nn.Linear(flat, fc1_out),
        nn.ReLU(inplace=True),
        nn.Linear(fc1_out, _CNN5_FEATURES),
        nn.ReLU(inplace=True),
    )
    return SplitModel(encoder, nn.Linear(_CNN5_FEATURES, num_classes), _CNN5_FEATURES)


def _register_cnn5(index: int) -> None:
    def builder(in_shape: tuple[int, ...], num_classes: int) -> SplitModel:
        return _cnn5(index, in_shape, num_classes)

    builder.__name__ = f"cnn{index}"
    builder.__qualname__ = f"cnn{index}"
    builder.__doc__ = _cnn5.__doc__.replace("`index`", str(index)) if _cnn5.__doc__ else None
    MODELS.add(f"cnn{index}", builder)


for _index in _CNN5_SPECS:
    _register_cnn5(_index)


# --------------------------------------------------------------------------------------------
# pFedES proxies
# --------------------------------------------------------------------------------------------


class ProxyExtractor(nn.Module):
    """pFedES's proxy feature extractor (design document, variant `kd`).

    Two conv blocks (32 and 64 channels, 3x3 padding 1, ReLU, 2x2 max-pool), global average
    pool, linear embedding to `embed_dim` (+ReLU) and a linear head to the classes. For inputs
    that are not images (`len(in_shape) != 3`) the conv blocks are replaced by an MLP.

    Its `encoder`/`head` attributes match a `SplitModel`, so the state dict of the registered
    `proxy_kd` SplitModel loads into it and back.

    Args:
        in_shape: input shape without the batch dimension.
        num_classes: number of classes.
        embed_dim: size of the embedding (the proxy's `feature_dim`).
    """

    def __init__(self, in_shape: Sequence[int], num_classes: int, embed_dim: int = 128) -> None:
        super().__init__()
        shape = _check_common("proxy_kd", in_shape, num_classes)
        if embed_dim < 1:
            raise ConfigError(f"proxy embed_dim is {embed_dim}; it must be >= 1")
        trunk: nn.Module
        if len(shape) == 3:
            _require_min_side("proxy_kd", (shape[0], shape[1], shape[2]), 4)
            trunk = nn.Sequential(
                nn.Conv2d(shape[0], 32, 3, padding=1),
                nn.ReLU(inplace=True),
                nn.MaxPool2d(2),
                nn.Conv2d(32, 64, 3, padding=1),
                nn.ReLU(inplace=True),
                nn.MaxPool2d(2),
                nn.AdaptiveAvgPool2d(1),
                nn.Flatten(),
            )
        else:
            # Mirrors the conv trunk: it too ends in a non-negative 64-vector.
            trunk = nn.Sequential(
                nn.Flatten(),
                nn.Linear(math.prod(shape), 128),
                nn.ReLU(inplace=True),
                nn.Linear(128, 64),
                nn.ReLU(inplace=True),
            )
        self.encoder = nn.Sequential(*trunk, nn.Linear(64, embed_dim), nn.ReLU(inplace=True))
        self.head = nn.Linear(embed_dim, num_classes)
        self.feature_dim = int(embed_dim)

    def features(self, x: torch.Tensor) -> torch.Tensor:
        """The `embed_dim`-sized embedding of `x`."""
        return self.encoder(x)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Return `(logits, embedding)`."""
        embedding = self.encoder(x)
        return self.head(embedding), embedding


@MODELS.register("proxy_kd")
def proxy_kd(in_shape: tuple[int, ...], num_classes: int) -> SplitModel:
    """`ProxyExtractor` (embed_dim 128) viewed as a SplitModel (same state-dict keys)."""
    proxy = ProxyExtractor(in_shape, num_classes)
    return SplitModel(proxy.encoder, proxy.head, proxy.feature_dim)


class InputProxy(nn.Module):
    """pFedES's input proxy (official code, variant `input`): image -> image of the same shape.

    conv3x3 C->8, ReLU, conv3x3 8->C, ReLU, padding 'same'; 443 parameters for C=3.

    Args:
        channels: image channels C.
    """

    def __init__(self, channels: int) -> None:
        super().__init__()
        if channels < 1:
            raise ConfigError(f"InputProxy channels is {channels}; it must be >= 1")
        self.conv1 = nn.Conv2d(channels, 8, 3, padding="same")
        self.conv2 = nn.Conv2d(8, channels, 3, padding="same")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.conv2(torch.relu(self.conv1(x))))


@MODELS.register("proxy_input")
def proxy_input(in_shape: tuple[int, ...], num_classes: int) -> nn.Module:
    """`InputProxy(C)` for images `(C, H, W)`; returns the bare module (not a classifier).

    `num_classes` is accepted for the common builder signature and otherwise ignored.
    """
    shape = _image_shape("proxy_input", in_shape, num_classes)
    return InputProxy(shape[0])


# --------------------------------------------------------------------------------------------
# family resnet_widths: width-scaled CIFAR-style ResNet-18 (HeteroFL / FedFD)
# --------------------------------------------------------------------------------------------


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
    parameter of a wider one, which `rayfl.models.slicing` relies on.

    Args:
        in_channels: image channels.
        num_classes: number of classes.
        width: width multiplier in (0, 1] (values above 1 also work).
        static_bn: HeteroFL's static batch norm: `track_running_stats=False`, so batch
            statistics are used in training and evaluation and no running buffers exist.
        scaler: put a HeteroFL `Scaler(width)` after every conv (active in training only).
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
        channels = tuple(max(1, round(c * width)) for c in _RESNET18_CHANNELS)
        c0, c1, c2, c3 = channels
        encoder = _ResNetEncoder(
            in_channels, (c0, c1, c2, c3), _batch_norm(static_bn), width if scaler else None
        )
        super().__init__(encoder, nn.Linear(c3, num_classes), c3)
        self.width = float(width)
        self.static_bn = bool(static_bn)


def resnet_width(arch: str) -> float:
    """Width multiplier of a `resnet_widths` architecture name (`resnet18` is 1.0).

    Raises:
        ConfigError: `arch` is not `resnet18` or `resnet18_w1`..`resnet18_w10`.
    """
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


def _resnet18_builder(arch: str) -> Callable[[tuple[int, ...], int], SplitModel]:
    width = resnet_width(arch)

    def builder(in_shape: tuple[int, ...], num_classes: int) -> SplitModel:
        shape = _image_shape(arch, in_shape, num_classes)
        return ResNet18(shape[0], num_classes, width)

    builder.__name__ = arch
    builder.__qualname__ = arch
    builder.__doc__ = (
        f"CIFAR-style ResNet-18 of width {width:g} (feature_dim {round(512 * width)})."
    )
    return builder


MODELS.add("resnet18", _resnet18_builder("resnet18"))
for _level in range(1, len(RESNET18_WIDTHS) + 1):
    MODELS.add(f"resnet18_w{_level}", _resnet18_builder(f"resnet18_w{_level}"))


# --------------------------------------------------------------------------------------------
# family tiny2: two very fast heterogeneous models for tests (feature_dim 16)
# --------------------------------------------------------------------------------------------

_TINY_FEATURES = 16


@MODELS.register("tiny_a")
def tiny_a(in_shape: tuple[int, ...], num_classes: int) -> SplitModel:
    """Flatten, one linear layer to 16 + ReLU (the features); any input shape."""
    shape = _check_common("tiny_a", in_shape, num_classes)
    encoder = nn.Sequential(
        nn.Flatten(), nn.Linear(math.prod(shape), _TINY_FEATURES), nn.ReLU(inplace=True)
    )
    return SplitModel(encoder, nn.Linear(_TINY_FEATURES, num_classes), _TINY_FEATURES)


@MODELS.register("tiny_b")
def tiny_b(in_shape: tuple[int, ...], num_classes: int) -> SplitModel:
    """Flatten, linear to 32 + ReLU, linear to 16 + ReLU (the features); any input shape."""
    shape = _check_common("tiny_b", in_shape, num_classes)
    encoder = nn.Sequential(
        nn.Flatten(),
        nn.Linear(math.prod(shape), 32),
        nn.ReLU(inplace=True),
        nn.Linear(32, _TINY_FEATURES),
        nn.ReLU(inplace=True),
    )
    return SplitModel(encoder, nn.Linear(_TINY_FEATURES, num_classes), _TINY_FEATURES)
