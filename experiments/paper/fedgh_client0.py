"""`fedgh_client0`: FedGH with HtFLlib's initial global header, as a plugin.

HtFLlib's FedGH server starts its global header from client 0's initial head
(`servergh.py`: `load_item(self.clients[0].role, 'model').head`) and sends it before the first
round; rayfl's `fedgh` builds a fresh head of the first architecture from the server's own
seed. This server rebuilds client 0's initial head from the engine's initialisation seed for
client 0 (its `Purpose.INIT` stream, as the worker seeds it). Everything else is `fedgh`.

    rayfl compare experiments/suites/fedgh_header_init.yaml --out runs/fedgh_header_init
"""

from __future__ import annotations

import torch

from rayfl.algorithms import ALGORITHMS
from rayfl.algorithms.base import Algorithm, ServerContext
from rayfl.algorithms.fedgh import FedGHClient, FedGHParams, FedGHServer
from rayfl.engine.spec import seed_torch
from rayfl.models import build_model
from rayfl.seeding import Purpose, seed_of, words


class ClientZeroHeaderServer(FedGHServer):
    """FedGH's server with HtFLlib's initial header: client 0's initial head."""

    def __init__(self, ctx: ServerContext, params: FedGHParams) -> None:
        super().__init__(ctx, params)
        state = torch.get_rng_state()
        seed_torch(seed_of(words(Purpose.INIT, ctx.seed, client=0)))  # as the worker seeds it
        head = build_model(ctx.architectures[0], ctx.in_shape, ctx.num_classes).head
        torch.set_rng_state(state)
        self.header.load_state_dict(head.state_dict())


ALGORITHMS.add(
    "fedgh_client0",
    Algorithm(
        "fedgh_client0",
        FedGHParams,
        FedGHClient,
        ClientZeroHeaderServer,
        needs_common_feature_dim=True,
    ),
)
