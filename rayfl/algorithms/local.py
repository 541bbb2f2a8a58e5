"""Standalone training: every client trains its own model on its own data, nothing is shared.

The lower bound every personalized method must beat.

Shares: nothing.
Keeps local: the whole model.
Server: nothing.
"""

from __future__ import annotations

from rayfl.algorithms.base import ALGORITHMS, Algorithm, ModelClient, NoParams, Server


class LocalClient(ModelClient[NoParams]):
    """Its own model, cross-entropy on its own data; nothing received, nothing uploaded."""

    deployed_uses_payload = False  # deploys its own model


ALGORITHMS.add(
    "local",
    Algorithm(
        "local", NoParams, LocalClient, Server, summary="standalone local training, no sharing"
    ),
)
