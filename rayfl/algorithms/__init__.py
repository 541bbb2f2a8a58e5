"""Federated algorithms: one module each, holding both halves. Importing this registers them."""

from rayfl.algorithms import fedavg, local, pfedes  # noqa: F401  (registration)
from rayfl.algorithms.base import Algorithm, Client, Reply, Server

__all__ = ["Algorithm", "Client", "Reply", "Server"]
