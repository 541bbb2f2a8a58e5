"""The architecture zoo: every model a config can name, registered in `MODELS`.

Each builder has the signature `builder(in_shape, num_classes) -> SplitModel`, where
`in_shape` excludes the batch dimension: `(C, H, W)` for images, `(D,)` for flat features.
Flattened sizes are computed from `in_shape`, so every image model runs on 1x28x28
(Fashion-MNIST), 3x32x32 (CIFAR) and small synthetic images such as 1x8x8. The families that
group them are in `rayfl.models.families`.

pFedES proxies, registered so `rayfl ls` lists them but normally used through their classes:
`proxy_kd` (`ProxyExtractor`, the design document's proxy feature extractor) and
`proxy_input` (`InputProxy`, the official code's image-to-image proxy; its builder returns
the bare module because it is not a classifier).
"""

from __future__ import annotations

import functools
import logging
import math
from collections.abc import Sequence

import torch
from torch import nn

from rayfl.errors import ConfigError
from rayfl.models.base import MODELS, SplitModel
from rayfl.models.resnet import RESNET18_WIDTHS, BasicBlock, ResNet18, resnet_width

logger = logging.getLogger(__name__)

#: Registered names whose builder does not return a classifier (`SplitModel`); they cannot
#: be client architectures in a family.
AUXILIARY_MODELS = frozenset({"proxy_input"})

# -- input-shape helpers ---------------------------------------------------------------------------


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


def _classifier(encoder: nn.Module, features: int, num_classes: int) -> SplitModel:
    """`encoder` with a linear head from its `features` to the classes."""
    return SplitModel(encoder, nn.Linear(features, num_classes), features)


def _dense(in_features: int, widths: Sequence[int]) -> list[nn.Module]:
    """Flatten, then a linear layer + ReLU to each of `widths` in turn."""
    layers: list[nn.Module] = [nn.Flatten()]
    for width in widths:
        layers += [nn.Linear(in_features, width), nn.ReLU(inplace=True)]
        in_features = width
    return layers


def _two_convs(channels: int) -> list[nn.Module]:
    """Two conv blocks: 32 then 64 channels, 3x3 padding 1, ReLU, 2x2 max-pool."""
    return [
        *(nn.Conv2d(channels, 32, 3, padding=1), nn.ReLU(inplace=True), nn.MaxPool2d(2)),
        *(nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(inplace=True), nn.MaxPool2d(2)),
    ]


# -- family seed3: the pFedES design document's three groups (feature_dim 128) ---------------------
_SEED3_FEATURES = 128


@MODELS.register("cnn_small")
def cnn_small(in_shape: tuple[int, ...], num_classes: int) -> SplitModel:
    """Two conv layers (32, 64 channels, 3x3, ReLU, 2x2 max-pool), then linear to 128."""
    shape = _image_shape("cnn_small", in_shape, num_classes)
    _require_min_side("cnn_small", shape, 4)
    trunk = nn.Sequential(*_two_convs(shape[0]))
    encoder = nn.Sequential(*trunk, *_dense(_flat_size(trunk, shape), (_SEED3_FEATURES,)))
    return _classifier(encoder, _SEED3_FEATURES, num_classes)


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
    return _classifier(encoder, _SEED3_FEATURES, num_classes)


# -- dense models on any input shape: hidden widths, the last being the features -------------------
# `mlp` is seed3's third group; `tiny_a` and `tiny_b` are family tiny2's fast test models.
_DENSE = {"mlp": (256, _SEED3_FEATURES), "tiny_a": (16,), "tiny_b": (32, 16)}


def _dense_model(
    arch: str, widths: tuple[int, ...], in_shape: tuple[int, ...], num_classes: int
) -> SplitModel:
    shape = _check_common(arch, in_shape, num_classes)
    return _classifier(nn.Sequential(*_dense(math.prod(shape), widths)), widths[-1], num_classes)


for _arch, _widths in _DENSE.items():
    MODELS.add(_arch, functools.partial(_dense_model, _arch, _widths))


# -- family cnn5: CNN-1..CNN-5 of the official pFedES code (feature_dim 500) -----------------------
# (conv2 output channels, fc1 output size) of CNN-1..CNN-5; conv1 is C->16 in all of them.
_CNN5_SPECS = {1: (32, 2000), 2: (16, 2000), 3: (32, 1000), 4: (32, 800), 5: (32, 500)}
_CNN5_FEATURES = 500


def _cnn5(index: int, in_shape: tuple[int, ...], num_classes: int) -> SplitModel:
    """CNN-`index` of pFedES's official code (Yi et al., AAAI 2025): two 5x5 conv + ReLU + 2x2
    max-pool blocks, fc1 and fc2 + ReLU (the 500-d features), head fc3. fc1's input size
    follows the image size (800 for 3x32x32, 512 for 1x28x28).

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
    )
    encoder = nn.Sequential(*trunk, *_dense(_flat_size(trunk, shape), (fc1_out, _CNN5_FEATURES)))
    return _classifier(encoder, _CNN5_FEATURES, num_classes)


for _index in _CNN5_SPECS:
    MODELS.add(f"cnn{_index}", functools.partial(_cnn5, _index))


# -- pFedES proxies --------------------------------------------------------------------------------


class ProxyExtractor(nn.Module):
    """pFedES's proxy feature extractor (design document, variant `kd`).

    Two conv blocks (32 and 64 channels, 3x3 padding 1, ReLU, 2x2 max-pool), global average
    pool, linear embedding to `embed_dim` (+ReLU) and a linear head to the classes. For inputs
    that are not images (`len(in_shape) != 3`) the conv blocks are replaced by an MLP.

    Its `encoder`/`head` attributes match a `SplitModel`, so the state dict of the registered
    `proxy_kd` SplitModel loads into it and back.
    """

    def __init__(self, in_shape: Sequence[int], num_classes: int, embed_dim: int = 128) -> None:
        super().__init__()
        shape = _check_common("proxy_kd", in_shape, num_classes)
        if embed_dim < 1:
            raise ConfigError(f"proxy embed_dim is {embed_dim}; it must be >= 1")
        trunk: nn.Module
        if len(shape) == 3:
            _require_min_side("proxy_kd", (shape[0], shape[1], shape[2]), 4)
            trunk = nn.Sequential(*_two_convs(shape[0]), nn.AdaptiveAvgPool2d(1), nn.Flatten())
        else:
            # Mirrors the conv trunk: it too ends in a non-negative 64-vector.
            trunk = nn.Sequential(*_dense(math.prod(shape), (128, 64)))
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
    """`InputProxy(C)` for images `(C, H, W)`: the bare module (not a classifier)."""
    shape = _image_shape("proxy_input", in_shape, num_classes)
    return InputProxy(shape[0])


# -- family resnet_widths: width-scaled CIFAR-style ResNet-18 (HeteroFL / FedFD) -------------------


def _resnet18(arch: str, in_shape: tuple[int, ...], num_classes: int) -> SplitModel:
    shape = _image_shape(arch, in_shape, num_classes)
    return ResNet18(shape[0], num_classes, resnet_width(arch))


for _arch in ("resnet18", *(f"resnet18_w{k}" for k in range(1, len(RESNET18_WIDTHS) + 1))):
    MODELS.add(_arch, functools.partial(_resnet18, _arch))
