"""Executors: where clients train and the server runs. Both run the same runners.

`SerialExecutor` (here) runs everything in this process (debugging, tiny tests);
`rayfl.engine.ray_executor.RayExecutor` runs a pool of long-lived `ClientWorker` actors. Both
derive from `Executor`, which keeps the client states as handles (values or ObjectRefs).
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np

from rayfl.algorithms.base import Payload
from rayfl.data.federated import Federation
from rayfl.engine.server import ServerRunner
from rayfl.engine.spec import RunSpec, resolve_device
from rayfl.engine.worker import ClientMetrics, ClientRunner

log = logging.getLogger(__name__)


class Executor:
    """What both executors share: the client states as handles, resolved by `_get` and made by
    `_put` (values here, ObjectRefs on Ray), and the progress report."""

    # Optional listener of progress inside a round: `progress(phase, done, total)`, phase "fit"
    # or "eval", after each batch of clients (the terminal progress bar sets it).
    progress: Callable[[str, int, int], None] | None = None

    def __init__(self, spec: RunSpec) -> None:
        self.spec = spec
        self.states: dict[int, Any] = {}

    def _get(self, handle: Any) -> Any:
        return handle

    def _put(self, value: Any) -> Any:
        return value

    def _report(self, phase: str, done: int, total: int) -> None:
        if self.progress is not None:
            self.progress(phase, done, total)

    def payload_digests(self, payloads: dict[str, Any]) -> dict[str, str]:
        """A digest of each handle's payload in `payloads` (equal digests: equal payloads)."""
        return {arch: payload_digest(self._get(h)) for arch, h in payloads.items()}

    def client_states(self, client_ids: Sequence[int]) -> Iterator[tuple[int, Payload]]:
        """Yield `(client id, state)` one at a time (checkpoints stream them to disk)."""
        for c in client_ids:
            if c in self.states:
                yield c, self._get(self.states[c])

    def load_client_state(self, client_id: int, state: Payload) -> None:
        self.states[client_id] = self._put(state)

    def server_state(self) -> dict[str, Any]:
        raise NotImplementedError

    def close(self) -> None:
        """Release workers and the server."""


def payload_digest(payload: Any) -> str:
    """SHA-1 over a payload's keys, array dtypes, shapes and bytes (nested mappings too)."""
    h = hashlib.sha1()

    def walk(value: Any) -> None:
        if isinstance(value, np.ndarray):
            h.update(f"{value.dtype.str}{value.shape}".encode())
            h.update(np.ascontiguousarray(value).tobytes())
        elif isinstance(value, Mapping):
            for key in sorted(value, key=str):
                h.update(f"<{key}>".encode())
                walk(value[key])
            h.update(b"</>")
        else:
            h.update(repr(value).encode())

    walk(payload)
    return h.hexdigest()


class StateView:
    """States at the end of one round, as handles (values or ObjectRefs) resolved by `get`: what
    a checkpoint reads (`client_states`, `server_state`) while the next round already runs."""

    def __init__(self, clients: dict[int, Any], server: Any, get: Callable[[Any], Any]) -> None:
        self._clients = clients
        self._server = server
        self._get = get

    def client_states(self, client_ids: Sequence[int]) -> Iterator[tuple[int, Payload]]:
        for c in client_ids:
            if c in self._clients:
                yield c, self._get(self._clients[c])

    def server_state(self) -> dict[str, Any]:
        return self._get(self._server)


def batches(ids: Sequence[int], size: int) -> list[list[int]]:
    """`ids` in consecutive batches of `size` (the last one shorter)."""
    return [list(ids[i : i + size]) for i in range(0, len(ids), size)]


def longest_first(ids: Sequence[int], sizes: Sequence[int]) -> list[int]:
    """`ids` ordered for dispatch to whichever worker is free: most samples first, so that the
    round ends on the shortest calls and no worker waits long for another (longest processing
    time first). The numbers do not depend on the order: every client is seeded on its own,
    and the server and the metrics sort by client id."""
    return sorted(ids, key=lambda c: (-sizes[c], c))


class SerialExecutor(Executor):
    # The clock of the round deadline (a test replaces it by a fake one).
    clock: Callable[[], float] = staticmethod(time.monotonic)

    def __init__(self, spec: RunSpec, federation: Federation) -> None:
        super().__init__(spec)
        device = resolve_device(spec.device)
        self.runner = ClientRunner(spec, federation, device)
        self.server = ServerRunner(spec, federation, device)

    def broadcast(
        self, round_idx: int, archs: Sequence[str]
    ) -> tuple[dict[str, int], dict[str, Any]]:
        sizes, payloads = self.server.broadcast(round_idx, archs)
        return sizes, dict(zip(archs, payloads))

    def fit(
        self, round_idx: int, client_ids: Sequence[int], payloads: dict[str, Any], evaluate: bool
    ) -> tuple[list[ClientMetrics], list[Any]]:
        """Train the clients in the batches a Ray worker would get; returns their metrics and
        the batches' reply lists. With a deadline they train one at a time and the ones not
        started when it passes are dropped, as on Ray (each client is seeded on its own, so the
        numbers are those of one call)."""
        timeout = self.spec.engine.round_timeout_s
        deadline = None if timeout is None else self.clock() + timeout
        size = self.spec.engine.clients_per_call if deadline is None else 1
        rows: list[ClientMetrics] = []
        reply_lists: list[Any] = []
        for chunk in batches(client_ids, size):
            if deadline is not None and self.clock() > deadline:
                log.warning(
                    "round %d: deadline engine.round_timeout_s=%s passed; %d clients dropped",
                    *(round_idx, timeout, len(client_ids) - len(rows)),
                )
                break
            states = [self.states.get(c) for c in chunk]
            chunk_rows, replies, new_states = self.runner.fit(
                round_idx, chunk, payloads, states, evaluate
            )
            self.states.update(zip(chunk, new_states))
            rows += chunk_rows
            reply_lists.append(replies)
            self._report("fit", len(rows), len(client_ids))
        return rows, reply_lists

    def evaluate(
        self, round_idx: int, client_ids: Sequence[int], payloads: dict[str, Any]
    ) -> list[ClientMetrics]:
        """Score every client's deployed model given the server's new broadcast (`payloads`, one
        per architecture among `client_ids`); client states are read, never changed."""
        rows: list[ClientMetrics] = []
        for chunk in batches(client_ids, self.spec.engine.clients_per_call):
            states = [self.states.get(c) for c in chunk]
            rows += self.runner.evaluate(round_idx, chunk, payloads, states)
            self._report("eval", len(rows), len(client_ids))
        return rows

    def server_step(self, round_idx: int, replies: list[Any], evaluate: bool) -> dict[str, float]:
        return self.server.step(round_idx, replies, evaluate)

    def server_step_deferred(
        self, round_idx: int, replies: list[Any], evaluate: bool, final: bool = False
    ) -> tuple[dict[str, float], Any]:
        """The server step without its evaluation, and a handle for `collect_eval`, so that the
        evaluation (which feeds no broadcast) can run while the next round's clients train, or,
        after the `final` round, while the clients evaluate."""
        return self.server.step_deferred(round_idx, replies, evaluate)

    def collect_eval(self, handle: Any) -> dict[str, float]:
        """The metrics of a deferred evaluation (waits for it)."""
        return self.server.score(handle) if handle else {}

    def snapshot(self) -> StateView:
        """The client and server states now, unaffected by later rounds (for checkpoints)."""
        # states are replaced, never changed in place: a shallow copy is a snapshot
        return StateView(dict(self.states), self.server.state_dict(), self._get)

    def server_state(self) -> dict[str, Any]:
        return self.server.state_dict()

    def load_server_state(self, state: dict[str, Any]) -> None:
        self.server.load_state_dict(state)
