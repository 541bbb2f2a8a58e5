"""Feature shift: clients living in domains, and NIID-Bench's noise-based feature skew.

The label partition decides which samples a client holds, this module what its inputs look
like. A `DomainPlan` (`data.domains`) assigns clients to domains in contiguous blocks, sized by
`clients_per_domain` or `proportions` (largest remainder), equal by default. A dataset with
domains of its own (`rayfl.data.images`) has each domain's samples partitioned among its
clients only; otherwise every domain is a transformation (`rayfl.data.transforms`) of the base
data, applied to each client's train and test samples. NIID-Bench's feature skew (Li et al.,
ICDE 2022) adds Gaussian noise of std `noise * i / num_clients` to client i's inputs (pixels in
[0, 1]; NIID-Bench's code divides by N - 1, the paper by N as here). docs/data.md describes
the user's side: the server test set, held-out domains, determinism and metrics.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from rayfl.data import transforms
from rayfl.errors import ConfigError, require
from rayfl.seeding import Purpose, rng_of, seed_of, words

if TYPE_CHECKING:
    from rayfl.data.datasets import ArrayDataset
    from rayfl.schema import DomainsConfig

logger = logging.getLogger(__name__)


def client_counts(
    num_clients: int,
    names: tuple[str, ...],
    proportions: tuple[float, ...] | None,
    clients_per_domain: int | tuple[int, ...] | None,
) -> list[int]:
    """Clients per domain, in domain order; a ConfigError names the setting that cannot work."""
    d = len(names)
    key = "data.domains"
    if clients_per_domain is not None:
        counts = (
            [int(clients_per_domain)] * d
            if isinstance(clients_per_domain, int)
            else [int(c) for c in clients_per_domain]
        )
        require(
            len(counts) == d,
            f"{key}.clients_per_domain",
            f"{len(counts)} counts for {d} domains",
        )
        require(min(counts) >= 1, f"{key}.clients_per_domain", "every domain needs >= 1 client")
        require(
            sum(counts) == num_clients,
            f"{key}.clients_per_domain",
            f"{sum(counts)} clients in all, but data.num_clients is {num_clients}; make them equal",
        )
        return counts
    shares = np.ones(d) if proportions is None else np.asarray(proportions, dtype=np.float64)
    require(len(shares) == d, f"{key}.proportions", f"{len(shares)} shares for {d} domains")
    require(bool((shares > 0).all()), f"{key}.proportions", "every share must be > 0")
    quota = shares / shares.sum() * num_clients
    base = np.floor(quota).astype(np.int64)
    extra = num_clients - int(base.sum())
    base[np.argsort(-(quota - base), kind="stable")[:extra]] += 1
    empty = [names[i] for i in np.flatnonzero(base == 0)]
    require(
        not empty,
        f"{key}.proportions" if proportions is not None else "data.num_clients",
        f"domain {empty[0] if empty else ''} gets no client of {num_clients}; raise data.num_clients",
    )
    return [int(b) for b in base]


@dataclasses.dataclass(frozen=True)
class DomainPlan:
    """Each client's domain index among `names` (recipes, or the dataset's own domains when
    `real`), the held-out domain's index, and NIID-Bench's `noise` level (0: none)."""

    names: tuple[str, ...]
    client_domain: np.ndarray
    real: bool
    held_out: int | None
    noise: float

    def partition(
        self,
        fn: Callable[..., list[np.ndarray]],
        labels: np.ndarray,
        domain_of: np.ndarray | None,
        seed: int,
        options: dict[str, Any],
    ) -> list[np.ndarray]:
        """Positions (into `labels`) per client. With the dataset's own domains, each domain's
        samples are split among its clients by `fn`, on the domain's own seed."""
        num_clients = len(self.client_domain)
        if not self.real or domain_of is None:
            return list(fn(labels, num_clients, seed, **options))
        parts: list[np.ndarray] = [np.empty(0, dtype=np.int64)] * num_clients
        for d, name in enumerate(self.names):
            members = np.flatnonzero(self.client_domain == d)
            pool = np.flatnonzero(domain_of == d)
            if len(pool) < len(members):
                raise ConfigError(
                    f"data.domains: domain {name!r} has {len(pool)} training samples for "
                    f"{len(members)} clients; give it fewer clients"
                )
            sub_seed = seed_of(words(Purpose.DATA_DOMAIN, seed, client=d))
            for cid, part in zip(
                members, fn(labels[pool], len(members), sub_seed, **options), strict=True
            ):
                parts[int(cid)] = pool[part]
        return parts

    def apply(
        self, ds: ArrayDataset, samples: Sequence[np.ndarray], seed: int
    ) -> tuple[ArrayDataset, tuple[str, ...] | None, tuple[int, ...]]:
        """The dataset with shifted inputs (client i's samples at positions `samples[i]` of
        `x_train`), and the federation's `client_domain` and `eval_only` fields."""
        rgb = not self.real and transforms.needs_rgb(self.names) and ds.x_train.shape[1] == 1
        # writable copies, grey replicated to three channels when a recipe makes RGB
        x_train, x_test = (
            np.repeat(x, 3, axis=1) if rgb else np.array(x, copy=True)
            for x in (ds.x_train, ds.x_test)
        )
        n = len(samples)
        shifted = samples if (self.noise or not self.real) else ()
        for cid, idx in enumerate(shifted):
            rng = rng_of(words(Purpose.DATA_SHIFT, seed, client=cid))
            x = x_train[idx].astype(np.float32) / ds.scale
            if not self.real and self.names:
                x = transforms.apply(self.names[self.client_domain[cid]], x, rng)
            if self.noise:
                x = x + rng.normal(scale=self.noise * cid / n, size=x.shape).astype(np.float32)
            x_train[idx] = _back(x, ds)
        if not self.real:  # the server test set: sample j in domain j mod D
            rng = rng_of(words(Purpose.DATA_SHIFT, seed))
            for d, recipe in enumerate(self.names):
                idx = np.arange(d, len(x_test), len(self.names))
                x = x_test[idx].astype(np.float32) / ds.scale
                x_test[idx] = _back(transforms.apply(recipe, x, rng), ds)
        channels = x_train.shape[1]
        dataset = dataclasses.replace(
            ds,
            x_train=x_train,
            x_test=x_test,
            mean=ds.mean * channels if rgb else ds.mean,
            std=ds.std * channels if rgb else ds.std,
        )
        names = self.names
        return (
            dataset,
            tuple(names[d] for d in self.client_domain) if names else None,
            tuple(int(c) for c in np.flatnonzero(self.client_domain == self.held_out))
            if self.held_out is not None
            else (),
        )


def _back(x: np.ndarray, ds: ArrayDataset) -> np.ndarray:
    """Float images in [0, 1] back to the dataset's dtype and scale (uint8 clipped)."""
    if ds.x_train.dtype == np.uint8:
        return np.clip(np.rint(x * 255.0), 0, 255).astype(np.uint8)
    return (x * ds.scale).astype(ds.x_train.dtype)


def plan_for(
    spec: DomainsConfig | None, dataset: ArrayDataset, num_clients: int
) -> DomainPlan | None:
    """The plan of `data.domains` on this dataset, or None when nothing is shifted."""
    own = tuple(getattr(dataset, "domain_names", ()))  # a dataset's own (`rayfl.data.images`)
    recipes = tuple(spec.transforms) if spec is not None else ()
    noise = float(spec.noise) if spec is not None else 0.0
    if not own and not recipes and not noise:
        return None
    if own and recipes:
        raise ConfigError(
            f"data.domains.transforms: {dataset.name} has domains of its own "
            f"({', '.join(own)}); leave transforms empty"
        )
    for recipe in recipes:
        transforms.parse(recipe)
    require(
        not recipes or dataset.x_train.ndim == 4,
        "data.domains.transforms",
        f"transformations need images (N, C, H, W); {dataset.name}'s samples have shape "
        f"{dataset.in_shape} (data.domains.noise works on any shape)",
    )
    names = own or recipes
    require(
        len(set(names)) == len(names),
        "data.domains.transforms",
        "each domain must appear once",
    )
    held = spec.held_out if spec is not None else None
    if held is not None and held not in names:
        raise ConfigError(
            f"data.domains.held_out: {held!r} is not a domain; choose one of {', '.join(names)}"
        )
    if names:
        counts = client_counts(
            num_clients,
            names,
            spec.proportions if spec is not None else None,
            spec.clients_per_domain if spec is not None else None,
        )
        client_domain = np.repeat(np.arange(len(names)), counts)
        if held is not None:
            require(
                counts[names.index(held)] < num_clients,
                "data.domains.held_out",
                "every client would be held out; leave some to train",
            )
    else:
        client_domain = np.zeros(num_clients, dtype=np.int64)
    return DomainPlan(
        names=names,
        client_domain=client_domain,
        real=bool(own),
        held_out=names.index(held) if held is not None else None,
        noise=noise,
    )
