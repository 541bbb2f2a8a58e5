"""Model families: assignment of architectures to clients, feature sizes, config lookup."""

from __future__ import annotations

import pytest

from rayfl.errors import ConfigError
from rayfl.models import FAMILIES, MODELS, build_model
from rayfl.models.families import Family, family_from_config, get_family


def test_registered_families() -> None:
    assert {"seed3", "cnn5", "resnet_widths", "homo_cnn_small", "tiny2"} <= set(FAMILIES.names())
    assert get_family("seed3").architectures == ("cnn_small", "resnet_small", "mlp")
    assert get_family("cnn5").architectures == ("cnn1", "cnn2", "cnn3", "cnn4", "cnn5")
    assert get_family("resnet_widths").architectures == tuple(
        f"resnet18_w{k}" for k in range(1, 11)
    )
    assert get_family("tiny2").architectures == ("tiny_a", "tiny_b")
    for name in FAMILIES.names():
        family = get_family(name)
        assert family.name == name
        assert all(arch in MODELS for arch in family.architectures)


def test_round_robin_golden() -> None:
    assert get_family("seed3").assign(7) == [
        "cnn_small",
        "resnet_small",
        "mlp",
        "cnn_small",
        "resnet_small",
        "mlp",
        "cnn_small",
    ]
    # pFedES's official code: client k gets CNN-(k % 5 + 1).
    assert get_family("cnn5").assign(12) == [f"cnn{k % 5 + 1}" for k in range(12)]
    assert get_family("homo_cnn_small").assign(3) == ["cnn_small"] * 3
    assert get_family("tiny2").assign(1) == ["tiny_a"]


def test_proportions_golden() -> None:
    seed3 = get_family("seed3")
    # quotas 3.5 / 2.1 / 1.4 -> floors 3/2/1, the spare client goes to the largest remainder.
    assert seed3.assign(7, [0.5, 0.3, 0.2]) == ["cnn_small"] * 4 + ["resnet_small"] * 2 + ["mlp"]
    # quotas 4.5 / 3.5 / 2.0: a tie of remainders goes to the earlier architecture.
    assert seed3.assign(10, [0.45, 0.35, 0.2]) == (
        ["cnn_small"] * 5 + ["resnet_small"] * 3 + ["mlp"] * 2
    )
    # quotas 1.4 / 4.2 / 8.4 tie at 0.4 for the first and last block, but in floating point
    # 0.6 * 14 - 8 = 0.40000000000000036 > 0.1 * 14 - 1 = 0.40000000000000013; the tie must
    # still go to the earlier architecture.
    assert seed3.assign(14, [0.1, 0.3, 0.6]) == (
        ["cnn_small"] * 2 + ["resnet_small"] * 4 + ["mlp"] * 8
    )
    cnn5 = get_family("cnn5")
    assert cnn5.assign(10, [0.1, 0.2, 0.3, 0.2, 0.2]) == (
        ["cnn1"] + ["cnn2"] * 2 + ["cnn3"] * 3 + ["cnn4"] * 2 + ["cnn5"] * 2
    )
    # more architectures than clients: each of the largest remainders gets one
    assert cnn5.assign(2, [0.1, 0.4, 0.1, 0.3, 0.1]) == ["cnn2", "cnn4"]


@pytest.mark.parametrize("n", [1, 2, 3, 7, 10, 33, 100])
def test_proportions_invariants(n: int) -> None:
    family = Family("f", ("a", "b", "c", "d"))
    props = [0.13, 0.27, 0.4, 0.2]
    out = family.assign(n, props)
    assert len(out) == n
    assert out == sorted(out)  # contiguous blocks in architecture order
    for arch, p in zip(family.architectures, props):
        assert abs(out.count(arch) - p * n) < 1  # every block within one of its quota
    assert family.assign(n, props) == out  # deterministic


@pytest.mark.parametrize(
    "props",
    [[0.5, 0.5], [0.5, 0.25, 0.25, 0.0], [0.6, -0.1, 0.3, 0.2], [0.3, 0.3, 0.3, 0.3]],
)
def test_bad_proportions_raise_config_error(props: list[float]) -> None:
    family = Family("f", ("a", "b", "c", "d"))
    with pytest.raises(ConfigError, match="model.proportions"):
        family.assign(10, props)


def test_bad_family_arguments() -> None:
    with pytest.raises(ConfigError):
        Family("empty", ())
    with pytest.raises(ConfigError):
        get_family("seed3").assign(0)


def test_homogeneous() -> None:
    assert get_family("homo_cnn_small").homogeneous
    assert not get_family("seed3").homogeneous
    assert Family("dup", ("mlp", "mlp")).homogeneous


def test_feature_dims() -> None:
    assert get_family("tiny2").feature_dims((1, 8, 8), 3) == {"tiny_a": 16, "tiny_b": 16}
    assert get_family("tiny2").common_feature_dim((1, 8, 8), 3) == 16
    assert get_family("seed3").common_feature_dim((1, 28, 28), 10) == 128
    assert get_family("cnn5").common_feature_dim((1, 8, 8), 10) == 500
    dims = get_family("resnet_widths").feature_dims((1, 8, 8), 10)
    assert list(dims.values()) == [51, 102, 154, 205, 256, 307, 358, 410, 461, 512]
    assert get_family("resnet_widths").common_feature_dim((1, 8, 8), 10) is None
    # the cached answer agrees with a freshly built model
    assert dims["resnet18_w4"] == build_model("resnet18_w4", (1, 8, 8), 10).feature_dim


def test_get_family_unknown_name_suggests() -> None:
    with pytest.raises(ConfigError, match=r"model\.family.*did you mean 'seed3'"):
        get_family("seed33")


def test_family_from_config() -> None:
    assert family_from_config("cnn5", None) is get_family("cnn5")
    custom = family_from_config("ignored", ["mlp", "cnn1", "mlp"])
    assert custom == Family("custom", ("mlp", "cnn1", "mlp"))
    assert custom.assign(4) == ["mlp", "cnn1", "mlp", "mlp"]
    with pytest.raises(ConfigError, match=r"model\.architectures.*did you mean 'cnn1'"):
        family_from_config("seed3", ["mlp", "cnn11"])
    with pytest.raises(ConfigError, match=r"model\.architectures.*not a classifier"):
        family_from_config("seed3", ["proxy_input"])
    with pytest.raises(ConfigError, match=r"model\.architectures"):
        family_from_config("seed3", [])
    with pytest.raises(ConfigError, match=r"model\.family"):
        family_from_config("nope", None)
