"""Checks that an algorithm can run on a federation: no data loaded, no Ray imported.

`rayfl validate`, suites and sweeps call these before any work starts; the round loop calls
them again once the data (feature sizes, the public split) is known.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from rayfl.algorithms.base import Algorithm
from rayfl.errors import ConfigError
from rayfl.privacy import check_fits as check_privacy_fits
from rayfl.privacy.hook import check_accounting
from rayfl.schema import RunConfig


def check_algorithm_fits(
    algo: Algorithm,
    cfg: RunConfig,
    archs: Sequence[str],
    feature_dims: Mapping[str, int] | None = None,
    public_size: int | None = None,
) -> None:
    """Refuse algorithm/family/data combinations that cannot work, naming the fix.

    Without `feature_dims` / `public_size` (no data loaded yet, as in `rayfl validate`) the
    checks that need them are made from the config alone.
    """
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
