"""The checks a config passes once every key is valid on its own (`rayfl.config`): across keys
(registry names, resources, devices, domains), what is known infeasible before any data is
loaded or Ray started (`check_feasible`), and whether the algorithm can run on the federation
(`check_algorithm_fits`; the round loop calls it again once the data is known). `rayfl
validate`, suites, sweeps and `rayfl run` refuse the same configs, before the work. Torch-heavy
domains are imported only once every key is valid.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from rayfl.errors import ConfigError, require
from rayfl.resources import check_engine
from rayfl.schema import RunConfig, clients_per_round

if TYPE_CHECKING:
    from rayfl.algorithms.base import Algorithm


def check(cfg: RunConfig) -> None:
    """Checks across keys that need no data: registry names, resources, devices, domains."""
    from rayfl.data import DATASETS, PARTITIONERS  # torch: only once every key is valid

    d, e = cfg.data, cfg.engine
    DATASETS.get(d.dataset, key="data.dataset")  # an unknown name: one line with the choices
    PARTITIONERS.get(d.partition.name, key="data.partition.name")
    if e.clients_per_round is not None:
        require(
            e.clients_per_round <= d.num_clients,
            "engine.clients_per_round",
            f"{e.clients_per_round} sampled clients but only {d.num_clients} exist; "
            f"lower it or raise data.num_clients",
        )
    check_engine(e)  # reservations; a private Ray too small for one worker fails after its start
    check_devices(cfg)
    check_domains(cfg)
    if cfg.model.proportions is not None:
        require(
            all(p > 0 for p in cfg.model.proportions),
            "model.proportions",
            "every proportion must be > 0",
        )
    require(
        all(0 < t <= 1 for t in cfg.eval.targets),
        "eval.targets",
        f"every target accuracy must be in (0, 1] (got {list(cfg.eval.targets)})",
    )
    check_feasible(cfg)


def check_devices(cfg: RunConfig) -> None:
    """`devices`: tier names, the clients' assignment to tiers and the waiting policy."""
    d = cfg.devices
    for tier in d.tiers:
        require(
            all(v in (0, 1) for v in tier.trace),
            f"devices.tiers[{tier.name}].trace",
            f"must list 1 (available) or 0 per round (got {list(tier.trace)})",
        )
    names = [t.name for t in d.tiers]
    require(len(set(names)) == len(names), "devices.tiers", f"tier names repeat: {names}")
    for arch, tier_name in d.by_arch.items():
        require(
            tier_name in names,
            f"devices.by_arch.{arch}",
            f"{tier_name!r} is not a tier; choose one of {', '.join(names) or '(no tiers)'}",
        )
    require(
        not d.by_arch or not d.proportions,
        "devices.proportions",
        "give by_arch or proportions, not both",
    )
    require(
        not d.proportions or (len(d.proportions) == len(names) and sum(d.proportions) > 0),
        "devices.proportions",
        f"needs one non-negative share per tier ({len(names)}), got {list(d.proportions)}",
    )
    require(
        d.policy != "deadline" or (d.deadline_s is not None and d.deadline_s > 0),
        "devices.deadline_s",
        "policy deadline needs deadline_s > 0 (simulated seconds)",
    )
    require(
        d.policy != "first_k" or (d.first_k is not None and d.first_k >= 1),
        "devices.first_k",
        "policy first_k needs first_k >= 1",
    )
    require(
        d.work == "flops" or d.policy == "all",
        "devices.work",
        "measured times are known only after training; use policy all, or work flops",
    )


def check_domains(cfg: RunConfig) -> None:
    """`data.domains`: recipes, counts and the held-out domain, before any data is read."""
    from rayfl.data import transforms
    from rayfl.data.domains import client_counts

    d = cfg.data.domains
    for i, recipe in enumerate(d.transforms):
        transforms.parse(recipe, f"data.domains.transforms[{i}]")
    if d.transforms:
        client_counts(cfg.data.num_clients, d.transforms, d.proportions, d.clients_per_domain)
    if d.held_out is not None:
        require(
            cfg.eval.protocol == "deployed",
            "data.domains.held_out",
            "held-out clients never train, so only eval.protocol=deployed scores them",
        )
        require(
            not cfg.privacy.dp.enabled,
            "data.domains.held_out",
            "DP accounting assumes every client can be sampled; drop held_out or privacy.dp",
        )
        require(
            not d.transforms or d.held_out in d.transforms,
            "data.domains.held_out",
            f"{d.held_out!r} is not one of data.domains.transforms",
        )


# Training-set size and classes of the built-in datasets, known without loading them, so that
# an impossible partition is refused before any data is read or Ray started. A dataset not
# named here (a plugin's) is checked when its data is loaded.
DATASET_SIZES: dict[str, tuple[int, int]] = {
    "fmnist": (60_000, 10),
    "mnist": (60_000, 10),
    "cifar10": (50_000, 10),
    "cifar100": (50_000, 100),
    "tinyimagenet": (100_000, 200),
    "digits": (1_797, 10),  # before its own test split
}
SYNTHETIC_MAX_SAMPLES = 10_000_000  # 8x8 floats: 2.5 GB; more is a typo (1e12 was tried)


def _train_size(cfg: RunConfig) -> tuple[int, int] | None:
    """(training samples the partition splits, classes), or None when unknown without data."""
    d = cfg.data
    if d.dataset == "synthetic":
        opts = d.options
        n, classes = opts.get("num_samples", 2000), opts.get("num_classes", 10)
        for key, value in (("num_samples", n), ("num_test", opts.get("num_test", 500))):
            require(
                isinstance(value, int) and 1 <= value <= SYNTHETIC_MAX_SAMPLES,
                f"data.options.{key}",
                f"must be a whole number in [1, {SYNTHETIC_MAX_SAMPLES}] (got {value!r})",
            )
        if not isinstance(classes, int) or classes < 1:
            return None  # the loader names the problem
    elif d.dataset in DATASET_SIZES:
        n, classes = DATASET_SIZES[d.dataset]
        if d.dataset == "digits":
            n = int(n * (1 - float(d.options.get("test_fraction", 0.2))))
    else:
        return None
    if d.train_samples is not None:
        n = min(n, d.train_samples)
    return int(n * (1 - d.public_fraction)), classes


def check_feasible(cfg: RunConfig) -> None:
    """Refuse what would fail only once the data is loaded or a round ran: a partition the
    training set cannot give, more required replies than sampled clients."""
    per_round = clients_per_round(cfg)
    require(
        cfg.engine.min_replies <= per_round,
        "engine.min_replies",
        f"{cfg.engine.min_replies} replies required but only {per_round} clients are sampled "
        "per round; lower it or sample more clients (engine.clients_per_round)",
    )
    size = _train_size(cfg)
    if size is None:
        return
    n, classes = size
    p, clients = cfg.data.partition, cfg.data.num_clients
    require(
        clients <= n,
        "data.num_clients",
        f"{clients} clients but {cfg.data.dataset} has {n} training samples to split; lower it",
    )
    if p.name == "pathological":
        require(
            p.classes_per_client <= classes,
            "data.partition.classes_per_client",
            f"{p.classes_per_client} classes per client but {cfg.data.dataset} has {classes}; "
            f"lower it to at most {classes}",
        )
    if p.name == "dirichlet":
        require(
            clients * p.min_samples <= n,
            "data.partition.min_samples",
            f"{clients} clients x {p.min_samples} samples exceeds the {n} training samples of "
            f"{cfg.data.dataset}; lower min_samples or data.num_clients",
        )


def check_algorithm_fits(
    algo: Algorithm,
    cfg: RunConfig,
    archs: Sequence[str],
    feature_dims: Mapping[str, int] | None = None,
    public_size: int | None = None,
) -> None:
    """Refuse algorithm/family/data combinations that cannot work, naming the fix; without
    `feature_dims` / `public_size` (no data loaded yet) from the config alone."""
    from rayfl.privacy import check_fits as check_privacy_fits
    from rayfl.privacy.hook import check_accounting

    family = cfg.model.family if cfg.model.architectures is None else "custom"
    distinct = sorted(set(archs))
    if algo.needs_homogeneous and len(distinct) > 1:
        raise ConfigError(
            f"algorithm.name={algo.name} averages whole models and needs one architecture, but model.family="
            f"{family} has {', '.join(distinct)}; use a homogeneous family (e.g. model.architectures=[cnn_small])"
        )
    if (
        algo.needs_common_feature_dim
        and feature_dims is not None
        and len({feature_dims[a] for a in distinct}) > 1
    ):
        raise ConfigError(
            f"algorithm.name={algo.name} shares heads/prototypes and needs one feature size, but model.family="
            f"{family} has feature sizes {dict(feature_dims)}; pick a family with a common feature size (seed3, cnn5)"
        )
    if algo.needs_public and (cfg.data.public_fraction <= 0 or public_size == 0):
        raise ConfigError(
            f"algorithm.name={algo.name} needs a public/distillation split; set data.public_fraction (e.g. 0.1)"
        )
    if algo.check_archs is not None:
        algo.check_archs(distinct, cfg.algorithm.params)
    check_privacy_fits(algo, cfg.privacy, cfg.algorithm.params)
    check_accounting(cfg)


def check_family(cfg: RunConfig) -> list[str]:
    """Checks that need the family but no data: names, proportions, the algorithm's needs."""
    from rayfl.algorithms import ALGORITHMS
    from rayfl.models.families import family_from_config

    family = family_from_config(cfg.model.family, cfg.model.architectures)
    archs = family.assign(cfg.data.num_clients, cfg.model.proportions)
    check_algorithm_fits(ALGORITHMS.get(cfg.algorithm.name, key="algorithm.name"), cfg, archs)
    return archs
