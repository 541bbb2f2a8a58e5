"""Federated algorithms: one module each, holding both halves. Importing this registers them
in `ALGORITHMS` (defined in `rayfl.algorithms.base`, which every algorithm imports)."""

from rayfl.algorithms import (  # noqa: F401  (registration)
    apfl,
    ditto,
    fd,
    fedala,
    fedavg,
    fedbabu,
    fedbn,
    feddf,
    fedfd,
    fedgen,
    fedgh,
    fedkd,
    fedl2g,
    fedmd,
    fedmrl,
    fedper,
    fedproto,
    fedprox,
    fedrep,
    fedrod,
    fedtgp,
    fml,
    heterofl,
    lg_fedavg,
    local,
    pfedes,
    pfedes_input,
)
from rayfl.algorithms.base import ALGORITHMS, Algorithm, Client, Reply, Server

__all__ = ["ALGORITHMS", "Algorithm", "Client", "Reply", "Server"]
