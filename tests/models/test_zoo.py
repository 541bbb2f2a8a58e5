"""The architecture zoo: every registered model builds, runs and has the documented sizes."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from rayfl.errors import ConfigError
from rayfl.models import MODELS, SplitModel, build_model
from rayfl.models.resnet import RESNET18_WIDTHS, ResNet18, Scaler, resnet_width
from rayfl.models.zoo import AUXILIARY_MODELS, InputProxy, ProxyExtractor

IMAGE_SHAPES = [(1, 28, 28), (3, 32, 32), (1, 8, 8)]
ZOO_MODELS = (
    [f"cnn{k}" for k in range(1, 6)]
    + ["cnn_small", "resnet_small", "mlp", "proxy_kd", "tiny_a", "tiny_b", "resnet18"]
    + [f"resnet18_w{k}" for k in range(1, 11)]
)
FLAT_OK = {"mlp", "proxy_kd", "tiny_a", "tiny_b"}


def n_params(module: torch.nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def test_every_zoo_model_is_registered() -> None:
    names = set(MODELS.names())
    assert set(ZOO_MODELS) | AUXILIARY_MODELS <= names


# The ten ResNet-18 widths are one class; running each on every shape only costs time.
RESNET_LEVELS = {f"resnet18_w{k}" for k in range(1, 11)}
IMAGE_CASES = (
    [(arch, shape) for arch in ZOO_MODELS if arch not in RESNET_LEVELS for shape in IMAGE_SHAPES]
    + [(arch, (1, 8, 8)) for arch in sorted(RESNET_LEVELS)]
    + [("resnet18_w1", (3, 32, 32)), ("resnet18_w5", (1, 28, 28))]
)


@pytest.mark.parametrize(
    ("arch", "shape"), IMAGE_CASES, ids=[f"{a}-{'x'.join(map(str, s))}" for a, s in IMAGE_CASES]
)
def test_builds_and_runs_on_images(arch: str, shape: tuple[int, ...]) -> None:
    torch.manual_seed(0)
    model = build_model(arch, shape, 7)
    assert isinstance(model, SplitModel)
    x = torch.randn(2, *shape)
    z = model.features(x)
    assert z.shape == (2, model.feature_dim)
    logits = model(x)
    assert logits.shape == (2, 7)
    assert torch.isfinite(logits).all()
    # forward is head(features): the split must be the whole model, nothing hidden in between
    model.eval()
    torch.testing.assert_close(model(x), model.head(model.features(x)))


@pytest.mark.parametrize("arch", ZOO_MODELS)
def test_flat_inputs_work_or_raise_config_error(arch: str) -> None:
    x = torch.randn(3, 20)
    if arch in FLAT_OK:
        model = build_model(arch, (20,), 4)
        assert model(x).shape == (3, 4)
        assert model.features(x).shape == (3, model.feature_dim)
    else:
        with pytest.raises(ConfigError, match="needs image inputs"):
            build_model(arch, (20,), 4)


def test_input_proxy_builder_and_param_counts() -> None:
    assert n_params(InputProxy(3)) == 443  # (3*8*9 + 8) + (8*3*9 + 3)
    assert n_params(InputProxy(1)) == 153  # (1*8*9 + 8) + (8*1*9 + 1)
    for shape in IMAGE_SHAPES:
        proxy = build_model("proxy_input", shape, 10)
        assert isinstance(proxy, InputProxy)
        x = torch.randn(2, *shape)
        y = proxy(x)
        assert y.shape == x.shape
        assert (y >= 0).all()  # ends in a ReLU
    with pytest.raises(ConfigError):
        build_model("proxy_input", (20,), 10)


def test_feature_dims_of_families() -> None:
    for arch in ("cnn_small", "resnet_small", "mlp", "proxy_kd"):
        assert build_model(arch, (1, 28, 28), 10).feature_dim == 128
    for k in range(1, 6):
        assert build_model(f"cnn{k}", (3, 32, 32), 10).feature_dim == 500
    assert build_model("tiny_a", (1, 8, 8), 3).feature_dim == 16
    assert build_model("tiny_b", (1, 8, 8), 3).feature_dim == 16
    # the ten width levels' feature sizes are checked in test_families.test_feature_dims
    assert build_model("resnet18", (3, 32, 32), 10).feature_dim == 512


@pytest.mark.parametrize(
    ("shape", "fc1_inputs"),
    [
        ((3, 32, 32), [800, 400, 800, 800, 800]),  # the official code's sizes
        ((1, 28, 28), [512, 256, 512, 512, 512]),  # 28 -> 24 -> 12 -> 8 -> 4
        ((1, 8, 8), [128, 64, 128, 128, 128]),  # padding=2: 8 -> 8 -> 4 -> 4 -> 2
    ],
)
def test_cnn5_fc1_sizes(shape: tuple[int, ...], fc1_inputs: list[int]) -> None:
    fc1_outputs = [2000, 2000, 1000, 800, 500]
    for k in range(1, 6):
        model = build_model(f"cnn{k}", shape, 10)
        linears = [m for m in model.encoder if isinstance(m, torch.nn.Linear)]
        assert [(m.in_features, m.out_features) for m in linears] == [
            (fc1_inputs[k - 1], fc1_outputs[k - 1]),
            (fc1_outputs[k - 1], 500),
        ]
        assert (model.head.in_features, model.head.out_features) == (500, 10)


def test_golden_param_counts() -> None:
    # CNN-1 on CIFAR-10: conv1 3*16*25+16, conv2 16*32*25+32, fc1 800*2000+2000,
    # fc2 2000*500+500, fc3 500*10+10.
    assert n_params(build_model("cnn1", (3, 32, 32), 10)) == 1216 + 12832 + 1602000 + 1000500 + 5010
    # The standard CIFAR ResNet-18 with a 10-class head.
    assert n_params(ResNet18(3, 10, 1.0)) == 11_173_962
    # cnn_small on Fashion-MNIST: conv 1->32, conv 32->64, fc 64*7*7->128, head 128->10.
    assert n_params(build_model("cnn_small", (1, 28, 28), 10)) == (
        (9 * 32 + 32) + (32 * 64 * 9 + 64) + (3136 * 128 + 128) + (128 * 10 + 10)
    )
    # resnet_small: stem 1->16 (+BN), block 16->32 (two convs, 1x1 shortcut, three BNs),
    # block 32->64 (same), linear 64->128, head 128->10.
    assert n_params(build_model("resnet_small", (1, 28, 28), 10)) == (
        (9 * 16 + 32)
        + (16 * 32 * 9 + 32 * 32 * 9 + 16 * 32 + 3 * 64)
        + (32 * 64 * 9 + 64 * 64 * 9 + 32 * 64 + 3 * 128)
        + (64 * 128 + 128)
        + (128 * 10 + 10)
    )
    # mlp on 1x8x8: 64->256, 256->128, 128->3.
    assert n_params(build_model("mlp", (1, 8, 8), 3)) == (64 * 256 + 256) + (256 * 128 + 128) + (
        128 * 3 + 3
    )


def test_too_small_images_raise_config_error() -> None:
    for arch in ("cnn_small", "cnn1", "proxy_kd"):
        with pytest.raises(ConfigError, match="at least 4x4"):
            build_model(arch, (1, 3, 3), 10)
    with pytest.raises(ConfigError, match="num_classes"):
        build_model("mlp", (1, 8, 8), 0)
    with pytest.raises(ConfigError, match="invalid"):
        build_model("mlp", (1, 0, 8), 2)


def test_proxy_extractor_returns_logits_and_embedding() -> None:
    torch.manual_seed(0)
    proxy = ProxyExtractor((3, 32, 32), 10, embed_dim=24)
    x = torch.randn(4, 3, 32, 32)
    logits, embedding = proxy(x)
    assert logits.shape == (4, 10)
    assert embedding.shape == (4, 24)
    assert proxy.feature_dim == 24
    torch.testing.assert_close(logits, proxy.head(embedding))
    convs = [m for m in proxy.encoder if isinstance(m, torch.nn.Conv2d)]
    assert [(c.in_channels, c.out_channels, c.kernel_size) for c in convs] == [
        (3, 32, (3, 3)),
        (32, 64, (3, 3)),
    ]
    flat = ProxyExtractor((20,), 5)
    logits, embedding = flat(torch.randn(3, 20))
    assert logits.shape == (3, 5)
    assert embedding.shape == (3, 128)
    assert not any(isinstance(m, torch.nn.Conv2d) for m in flat.modules())


def test_proxy_kd_state_dict_is_interchangeable_with_proxy_extractor() -> None:
    torch.manual_seed(0)
    split = build_model("proxy_kd", (1, 8, 8), 10)
    proxy = ProxyExtractor((1, 8, 8), 10)
    proxy.load_state_dict(split.state_dict(), strict=True)
    x = torch.randn(2, 1, 8, 8)
    torch.testing.assert_close(proxy(x)[0], split(x))


def test_resnet_width_levels_and_channels() -> None:
    assert RESNET18_WIDTHS == (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0)
    assert resnet_width("resnet18") == 1.0
    assert resnet_width("resnet18_w3") == 0.3
    for bad in ("resnet18_w0", "resnet18_w11", "cnn1", "resnet18_wx"):
        with pytest.raises(ConfigError):
            resnet_width(bad)
    model = ResNet18(3, 10, 0.1)
    assert model.encoder.conv1.out_channels == 6  # round(6.4)
    assert model.encoder.layer2[0].conv1.out_channels == 13  # round(12.8)
    assert model.encoder.layer3[0].conv1.out_channels == 26  # round(25.6)
    assert model.encoder.layer4[0].conv1.out_channels == 51  # round(51.2)
    tiny = ResNet18(1, 2, 0.001)
    assert tiny.feature_dim == 1  # channels never drop to 0
    assert tiny(torch.randn(2, 1, 8, 8)).shape == (2, 2)


def test_static_bn_has_no_running_stats_and_uses_batch_stats_in_eval() -> None:
    torch.manual_seed(0)
    static = ResNet18(1, 3, 0.2, static_bn=True)
    assert not any("running" in k or "num_batches" in k for k in static.state_dict())
    regular = ResNet18(1, 3, 0.2)
    assert any("running_mean" in k for k in regular.state_dict())
    static.eval()
    x = torch.randn(4, 1, 8, 8)
    # With batch statistics a sample's output depends on its batch-mates even in eval mode.
    alone = static(x[:2])
    together = static(torch.cat([x[:2], 10 * x[2:]]))[:2]
    assert not torch.allclose(alone, together)


def test_scaler_divides_in_training_only() -> None:
    scaler = Scaler(0.25)
    x = torch.tensor([1.0, -2.0])
    assert torch.equal(scaler(x), torch.tensor([4.0, -8.0]))
    scaler.eval()
    assert torch.equal(scaler(x), x)
    with pytest.raises(ValueError):
        Scaler(0.0)


def test_scaler_resnet_keeps_state_dict_keys_and_changes_training_output() -> None:
    torch.manual_seed(0)
    plain = ResNet18(1, 3, 0.5, static_bn=True)
    scaled = ResNet18(1, 3, 0.5, static_bn=True, scaler=True)
    assert plain.state_dict().keys() == scaled.state_dict().keys()
    scaled.load_state_dict(plain.state_dict(), strict=True)
    assert sum(isinstance(m, Scaler) for m in scaled.modules()) == 1 + 8 * 2 + 3
    x = torch.randn(4, 1, 8, 8)
    plain.eval()
    scaled.eval()
    torch.testing.assert_close(plain(x), scaled(x))  # identity in eval
    plain.train()
    scaled.train()
    assert not torch.allclose(plain(x), scaled(x))


def test_builders_are_deterministic_under_a_seed() -> None:
    torch.manual_seed(3)
    a = build_model("cnn2", (1, 28, 28), 10).state_dict()
    torch.manual_seed(3)
    b = build_model("cnn2", (1, 28, 28), 10).state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.slow
def test_importing_models_does_not_import_ray_or_mlflow() -> None:
    code = (
        "import sys, rayfl.models, rayfl.models.zoo, rayfl.models.families, "
        "rayfl.models.slicing; "
        "bad = [m for m in ('ray', 'mlflow') if m in sys.modules]; "
        "sys.exit(1 if bad else 0)"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


@pytest.mark.parametrize("arch", ["cnn_small", "cnn1", "proxy_kd", "resnet_small"])
def test_placed_on_a_cpu_a_conv_model_is_channels_last_and_trains_as_nchw_does(arch):
    """`place` changes the layout, not the model: forward values and one SGD step agree with
    the NCHW model's to float rounding (the convolutions sum in another order)."""
    from rayfl.models.base import place

    torch.manual_seed(0)
    nchw = build_model(arch, (3, 16, 16), 10)
    fast = place(build_model(arch, (3, 16, 16), 10), torch.device("cpu"))
    fast.load_state_dict(nchw.state_dict())
    convs = [m.weight for m in fast.modules() if isinstance(m, torch.nn.Conv2d)]
    assert convs and all(w.is_contiguous(memory_format=torch.channels_last) for w in convs)
    assert all(not w.is_contiguous() for w in convs if w.shape[1] > 1 and w.shape[2] > 1)
    x, y = torch.randn(16, 3, 16, 16), torch.randint(0, 10, (16,))
    for model in (nchw, fast):
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    for (name, a), b in zip(nchw.state_dict().items(), fast.state_dict().values()):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-6), name
    nchw.eval(), fast.eval()
    with torch.inference_mode():
        assert torch.allclose(nchw(x), fast(x), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("arch", ["cnn_small", "cnn1", "mlp", "proxy_kd"])
def test_in_place_relus_train_bit_for_bit_as_out_of_place_ones(arch):
    """The zoo's ReLUs overwrite their input (no activation buffer per layer): the values and
    the gradients are those of out-of-place ReLUs, exactly."""
    x, y = torch.randn(32, 1, 28, 28), torch.randint(0, 10, (32,))
    states = []
    for inplace in (True, False):
        torch.manual_seed(0)
        model = build_model(arch, (1, 28, 28), 10)
        relus = [m for m in model.modules() if isinstance(m, torch.nn.ReLU)]
        assert relus and all(m.inplace for m in relus)
        for m in relus:
            m.inplace = inplace
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for start in (0, 16):
            opt.zero_grad()
            loss = torch.nn.functional.cross_entropy(
                model(x[start : start + 16]), y[start : start + 16]
            )
            loss.backward()
            opt.step()
        states.append(model.state_dict())
    assert all(torch.equal(states[0][k], states[1][k]) for k in states[0])
