"""`Background`: one call in a thread, its result (or its error) taken later.

For the driver's slow steps that nothing waits for at once: Ray's shutdown while the run
directory's plots are drawn, the partition's Parquet files while the first round trains.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any


class Background:
    """`fn(*args)` in a (daemon) thread; `result()` waits and returns its value, or raises what
    it raised, on the caller's thread."""

    def __init__(self, fn: Callable[..., Any], *args: Any, name: str = "rayfl-background") -> None:
        self._value: Any = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._call, args=(fn, args), name=name, daemon=True)
        self._thread.start()

    def _call(self, fn: Callable[..., Any], args: tuple[Any, ...]) -> None:
        try:
            self._value = fn(*args)
        except BaseException as exc:  # noqa: BLE001 (raised by `result`)
            self._error = exc

    def result(self) -> Any:
        self._thread.join()
        if self._error is not None:
            raise self._error
        return self._value
