"""Width slicing (HeteroFL / FedFD): slices load into sub-models, aggregation is per entry."""

from __future__ import annotations

import pytest
import torch

from rayfl.models.resnet import RESNET18_WIDTHS, ResNet18
from rayfl.models.slicing import aggregate_sliced, slice_state, state_shapes


@pytest.fixture(scope="module")
def global_model() -> ResNet18:
    torch.manual_seed(0)
    model = ResNet18(3, 10, 1.0)
    # make the BN buffers non-trivial so that slicing them is actually checked
    with torch.no_grad():
        for name, buf in model.named_buffers():
            if buf.is_floating_point():
                buf.copy_(torch.randn_like(buf).abs() if "var" in name else torch.randn_like(buf))
            else:
                buf.fill_(7)
    return model


@pytest.fixture(scope="module")
def sub_models() -> dict[float, ResNet18]:
    return {width: ResNet18(3, 10, width) for width in RESNET18_WIDTHS}


@pytest.mark.parametrize("width", RESNET18_WIDTHS)
def test_slices_load_into_every_width_level(
    global_model: ResNet18, sub_models: dict[float, ResNet18], width: float
) -> None:
    sub = sub_models[width]
    sliced = slice_state(global_model.state_dict(), state_shapes(sub.state_dict()))
    sub.load_state_dict(sliced, strict=True)
    g = global_model.state_dict()
    c = sub.encoder.conv1.out_channels
    assert torch.equal(sub.encoder.conv1.weight, g["encoder.conv1.weight"][:c])
    f = sub.feature_dim
    assert torch.equal(sub.head.weight, g["head.weight"][:, :f])  # all 10 classes kept
    assert torch.equal(sub.head.bias, g["head.bias"])
    assert torch.equal(sub.encoder.bn1.running_var, g["encoder.bn1.running_var"][:c])
    x = torch.randn(2, 3, 8, 8)
    assert sub.eval()(x).shape == (2, 10)


def test_slices_are_copies(global_model: ResNet18) -> None:
    g = global_model.state_dict()
    sub = ResNet18(3, 10, 0.5).state_dict()
    sliced = slice_state(g, state_shapes(sub))
    sliced["encoder.conv1.weight"].zero_()
    assert g["encoder.conv1.weight"].abs().sum() > 0


def test_static_bn_sub_model_takes_only_parameters(global_model: ResNet18) -> None:
    sub = ResNet18(3, 10, 0.3, static_bn=True, scaler=True)
    sliced = slice_state(global_model.state_dict(), state_shapes(sub.state_dict()))
    sub.load_state_dict(sliced, strict=True)
    assert not any("running" in k for k in sliced)


def test_slice_then_aggregate_identical_sub_models_is_identity(
    global_model: ResNet18, sub_models: dict[float, ResNet18]
) -> None:
    g = global_model.state_dict()
    subs = [slice_state(g, state_shapes(sub_models[w].state_dict())) for w in RESNET18_WIDTHS]
    weights = [float(k) for k in (3, 1, 4, 1, 5, 9, 2, 6, 5, 3)]
    out = aggregate_sliced(g, subs, weights)
    assert out.keys() == g.keys()
    for key, value in g.items():
        assert out[key].dtype == value.dtype
        assert torch.equal(out[key], value), key
    # only narrow clients: every entry beyond their slice keeps the global value too
    out = aggregate_sliced(g, subs[:2], [0.3, 0.7])
    assert all(torch.equal(out[k], g[k]) for k in g)


def test_per_entry_average_golden() -> None:
    g = {
        "w": torch.tensor([1.0, 2.0, 3.0, 4.0]),
        "m": torch.zeros(3, 3),
        "untouched": torch.tensor([7.0, 8.0]),
        "num_batches_tracked": torch.tensor(5),
    }
    a = {
        "w": torch.tensor([10.0, 20.0]),
        "m": torch.ones(2, 2),
        "num_batches_tracked": torch.tensor(9),
    }
    b = {"w": torch.tensor([30.0, 40.0, 50.0, 60.0]), "m": torch.full((3, 3), 4.0)}
    out = aggregate_sliced(g, [a, b], [1.0, 3.0])
    # entries 0-1: (1*10 + 3*30) / 4 = 25, (1*20 + 3*40) / 4 = 35; entries 2-3 only b holds.
    assert torch.equal(out["w"], torch.tensor([25.0, 35.0, 50.0, 60.0]))
    # top-left 2x2: (1*1 + 3*4) / 4 = 3.25; the rest only b.
    expected_m = torch.full((3, 3), 4.0)
    expected_m[:2, :2] = 3.25
    assert torch.equal(out["m"], expected_m)
    assert torch.equal(out["untouched"], g["untouched"])
    assert torch.equal(out["num_batches_tracked"], torch.tensor(5))
    # a client of weight 0 does not count; entries only it covers keep the global value
    out = aggregate_sliced(g, [a, b], [2.0, 0.0])
    assert torch.equal(out["w"], torch.tensor([10.0, 20.0, 3.0, 4.0]))
    # the inputs are not modified
    assert torch.equal(g["w"], torch.tensor([1.0, 2.0, 3.0, 4.0]))


def test_slicing_errors() -> None:
    g = {"w": torch.zeros(2, 3)}
    with pytest.raises(ValueError, match="leading slice"):
        slice_state(g, {"w": torch.Size([3, 3])})
    with pytest.raises(ValueError, match="leading slice"):
        slice_state(g, {"w": torch.Size([2])})
    with pytest.raises(ValueError, match="not in the global state"):
        slice_state(g, {"v": torch.Size([1])})
    with pytest.raises(ValueError, match="weights"):
        aggregate_sliced(g, [{"w": torch.zeros(1, 1)}], [1.0, 2.0])
    with pytest.raises(ValueError, match="weights"):
        aggregate_sliced(g, [{"w": torch.zeros(1, 1)}], [-1.0])
    with pytest.raises(ValueError, match="leading slice"):
        aggregate_sliced(g, [{"w": torch.zeros(1, 4)}], [1.0])
