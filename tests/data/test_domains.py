"""Feature shift: transformations, domains, NIID-Bench noise, per-domain metrics (rayfl.data.domains)."""

from __future__ import annotations

import copy
from types import SimpleNamespace

import numpy as np
import pytest

from rayfl.config import DomainsConfig, build_config
from rayfl.data import transforms
from rayfl.data.datasets import load_dataset
from rayfl.data.federated import build_federation
from rayfl.engine.loop import Simulation, summarize_clients
from rayfl.errors import ConfigError
from tests.conftest import SYNTHETIC

PARAMS = {"none": "", "number": ":0.7", "colour": ":red", "severity": ":3"}
RECIPES = [n + PARAMS[r.param] for n, r in transforms.TRANSFORMS.items()]


def images(seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).random((4, 1, 12, 12)).astype(np.float32)


@pytest.mark.parametrize("recipe", RECIPES)
def test_every_transformation_is_deterministic_per_seed_and_changes_the_data(recipe):
    x = images()
    first = transforms.apply(recipe, x, np.random.default_rng(5))
    again = transforms.apply(recipe, x, np.random.default_rng(5))
    np.testing.assert_array_equal(first, again)
    assert first.shape[1] == (3 if transforms.TRANSFORMS[recipe.split(":")[0]].rgb else 1)
    if recipe != "identity":
        assert not np.allclose(first, np.broadcast_to(x, first.shape))
    np.testing.assert_array_equal(x, images())  # the input is never modified


def test_rotation_back_by_minus_90_gives_the_base_and_turns_counter_clockwise():
    x = images()
    turned = transforms.apply("rotate:90", x, np.random.default_rng(0))
    np.testing.assert_array_equal(transforms.apply("rotate:-90", turned, None), x)
    # the top-right pixel goes to the top-left corner; a near-90 angle (resampled) agrees
    assert turned[0, 0, 0, 0] == x[0, 0, 0, -1]
    near = transforms.apply("rotate:89.99", x, None)
    np.testing.assert_allclose(near[:, :, 2:-2, 2:-2], turned[:, :, 2:-2, 2:-2], atol=0.01)


def test_severity_recipes_follow_cifar10c_constants():
    x = images()
    np.testing.assert_allclose(
        transforms.apply("contrast:2", x, None),
        (x - x.mean(axis=(1, 2, 3), keepdims=True)) * 0.5 + x.mean(axis=(1, 2, 3), keepdims=True),
        rtol=1e-6,
    )
    noisy = [
        transforms.apply(
            f"gaussian_noise:{s}", np.full((1, 1, 64, 64), 0.5), np.random.default_rng(0)
        )
        for s in (1, 5)
    ]
    assert [round(float((n - 0.5).std()), 2) for n in noisy] == [0.04, 0.10]
    haze = transforms.plasma_fractal(2, 32, 3.0, np.random.default_rng(0))
    assert haze.shape == (2, 32, 32) and haze.min() == 0.0 and haze.max() == 1.0
    assert not np.array_equal(haze[0], haze[1])  # one fractal per image
    # fog never brightens past an image's maximum: a black image stays black
    blank = np.zeros((1, 1, 8, 8), np.float32)
    assert transforms.apply("fog:1", blank, np.random.default_rng(0)).max() == 0.0


@pytest.mark.parametrize(
    "recipe, message",
    [
        ("rotat:90", "did you mean 'rotate'"),
        ("rotate", "needs a parameter"),
        ("tint:purple", "unknown colour"),
        ("blur:x", "is not a number"),
        ("contrast:6", "severity must be an integer 1-5"),
        ("invert:1", "takes no parameter"),
    ],
)
def test_a_bad_recipe_is_one_line_naming_the_key(recipe, message):
    with pytest.raises(ConfigError, match=message) as err:
        transforms.parse(recipe)
    assert "\n" not in str(err.value) and str(err.value).startswith("data.domains.transforms")


def synthetic(**options):
    return load_dataset("synthetic", num_samples=600, num_test=100, shape=(1, 8, 8), **options)


def federation(domains: DomainsConfig, seed: int = 0, clients: int = 6):
    return build_federation(
        synthetic(),
        num_clients=clients,
        partitioner="dirichlet",
        partition_options={"alpha": 0.5, "min_samples": 10},
        seed=seed,
        domains=domains,
    )


def test_rotation_domains_rotate_each_clients_samples_once():
    base = synthetic()
    fed = federation(DomainsConfig(transforms=("identity", "rotate:90", "rotate:180")))
    assert fed.client_domain == ("identity",) * 2 + ("rotate:90",) * 2 + ("rotate:180",) * 2
    for cid, split in enumerate(fed.clients):
        idx = np.concatenate([split.train, split.test])
        back = np.rot90(fed.dataset.x_train[idx], k=-(cid // 2), axes=(2, 3))
        np.testing.assert_array_equal(back, base.x_train[idx])
    # the server test set: sample j in domain j mod 3
    np.testing.assert_array_equal(fed.dataset.x_test[1::3], np.rot90(base.x_test[1::3], 1, (2, 3)))
    # the same config and seed give the same arrays (one federation for every algorithm)
    again = federation(DomainsConfig(transforms=("identity", "rotate:90", "rotate:180")))
    np.testing.assert_array_equal(again.dataset.x_train, fed.dataset.x_train)


def test_noise_level_increases_with_the_client_index_as_niid_bench():
    base = synthetic()
    fed = federation(DomainsConfig(noise=0.3), clients=6)
    assert fed.client_domain is None
    stds = []
    for split in fed.clients:
        idx = np.concatenate([split.train, split.test])
        stds.append(float((fed.dataset.x_train[idx] - base.x_train[idx]).std()))
    assert stds[0] == 0.0
    np.testing.assert_allclose(stds[1:], [0.3 * i / 6 for i in range(1, 6)], rtol=0.1)
    other = federation(DomainsConfig(noise=0.3), seed=1)
    assert not np.array_equal(other.dataset.x_train, fed.dataset.x_train)


def test_tint_makes_the_whole_federation_rgb():
    fed = federation(DomainsConfig(transforms=("identity", "tint:red")))
    ds = fed.dataset
    assert ds.x_train.shape[1:] == ds.x_test.shape[1:] == (3, 8, 8)
    assert len(ds.mean) == len(ds.std) == 3
    first = fed.clients[0].train  # identity: grey copied into three equal channels
    np.testing.assert_array_equal(ds.x_train[first, 0], ds.x_train[first, 2])


def test_domain_counts_and_the_held_out_domain():
    spec = DomainsConfig(
        transforms=("identity", "rotate:90", "blur:1"),
        clients_per_domain=(3, 2, 1),
        held_out="blur:1",
    )
    fed = federation(spec)
    assert fed.client_domain[3:] == ("rotate:90", "rotate:90", "blur:1")
    assert fed.eval_only == (5,)
    sim = SimpleNamespace(
        cfg=build_config(SYNTHETIC, ["engine.clients_per_round=5"]), federation=fed, per_round=5
    )
    for rnd in range(1, 4):
        assert Simulation._sample(sim, rnd) == [0, 1, 2, 3, 4]
    shares = federation(DomainsConfig(transforms=("identity", "invert"), proportions=(2, 1)))
    assert shares.client_domain == ("identity",) * 4 + ("invert",) * 2


def test_transformations_refuse_data_that_are_not_images():
    flat = load_dataset("synthetic", num_samples=200, num_test=50, shape=(16,))
    kwargs = dict(num_clients=2, partitioner="iid", partition_options={}, seed=0)
    with pytest.raises(ConfigError, match="need images"):
        build_federation(flat, domains=DomainsConfig(transforms=("rotate:90",)), **kwargs)
    noisy = build_federation(flat, domains=DomainsConfig(noise=0.5), **kwargs)
    assert not np.array_equal(noisy.dataset.x_train, flat.x_train)


def test_per_domain_accuracy_and_the_worst_domain():
    rows = [
        {"client": 0, "arch": "a", "acc": 0.8, "num_test": 10, "num_train": 1, "train_s": 0.0},
        {"client": 1, "arch": "b", "acc": 0.5, "num_test": 30, "num_train": 1, "train_s": 0.0},
        {"client": 2, "arch": "a", "acc": 0.2, "num_test": 10, "num_train": 1, "train_s": 0.0},
    ]
    out = summarize_clients(rows, None, ("rot0", "rot0", "rot90"))
    assert out["personal/acc/domain=rot0"] == pytest.approx((0.8 * 10 + 0.5 * 30) / 40)
    assert out["personal/acc/domain=rot90"] == pytest.approx(0.2)
    assert out["personal/acc_worst_domain"] == pytest.approx(0.2)
    assert not any("domain" in k for k in summarize_clients(rows))


@pytest.mark.parametrize(
    "domains, message",
    [
        ({"transforms": ["rotate:90", "spin:3"]}, r"data.domains.transforms\[1\]: unknown"),
        ({"transforms": ["identity"], "held_out": "blur:1"}, "not one of data.domains.transforms"),
        ({"transforms": ["identity", "invert"], "clients_per_domain": 2}, "4 clients in all"),
        ({"transforms": ["identity", "invert"], "proportions": [1]}, "1 shares for 2 domains"),
        ({"noise": -1}, "must be >= 0"),
    ],
)
def test_domain_config_errors_are_one_line(domains, message):
    raw = copy.deepcopy(SYNTHETIC)
    raw["data"]["domains"] = domains
    with pytest.raises(ConfigError, match=message) as err:
        build_config(raw)
    assert "\n" not in str(err.value)


def test_a_held_out_domain_needs_the_deployed_protocol_and_no_dp():
    raw = copy.deepcopy(SYNTHETIC)
    raw["data"]["domains"] = {"transforms": ["identity", "invert"], "held_out": "invert"}
    raw["eval"] = {"protocol": "after_fit"}
    with pytest.raises(ConfigError, match="eval.protocol=deployed"):
        build_config(raw)
    with pytest.raises(ConfigError, match="DP accounting"):
        build_config(raw, ["eval.protocol=deployed", "privacy.dp.enabled=true"])


def domain_raw() -> dict:
    raw = copy.deepcopy(SYNTHETIC)
    raw["data"]["domains"] = {"transforms": ["identity", "rotate:90", "rotate:270"]}
    return raw


@pytest.mark.ray
def test_dirichlet_with_rotation_domains_gives_ray_the_serial_numbers(ray_local, tmp_path):
    def history(executor: str) -> list[dict]:
        cfg = build_config(domain_raw(), [f"engine.executor={executor}", "engine.num_workers=2"])
        rows = Simulation(cfg, tmp_path).run().history
        return [{k: v for k, v in r.items() if not k.startswith("time/")} for r in rows]

    serial = history("serial")
    assert "personal/acc/domain=rotate:90" in serial[-1]
    assert "personal/acc_worst_domain" in serial[-1]
    assert serial == history("ray")


@pytest.mark.slow
@pytest.mark.ray  # an end-to-end run
def test_the_run_report_and_the_suite_table_show_accuracy_per_domain(tmp_path):
    from rayfl.compare.results import DOMAIN_PREFIX, arch_rows, mean_col
    from rayfl.launch import simulate
    from rayfl.report import write_report

    raw = domain_raw()
    simulate(build_config(raw, ["engine.rounds=1"]), tmp_path / "run", progress=False)
    page = write_report(tmp_path / "run").read_text()
    assert "Personalized accuracy per domain" in page and "rotate:270" in page
    row = {"label": "fedavg", mean_col(DOMAIN_PREFIX + "rotate:90"): 0.5}
    assert arch_rows([row], DOMAIN_PREFIX) == (["algorithm", "rotate:90"], [["fedavg", "0.5000"]])


def test_ls_partitioners_lists_the_feature_shift_options(capsys):
    from rayfl.cli import main

    assert main(["ls", "partitioners"]) == 0
    out = capsys.readouterr().out
    assert "dirichlet" in out and "noise: X" in out and "held_out" in out
    for name in transforms.TRANSFORMS:
        assert f"  {name}" in out
