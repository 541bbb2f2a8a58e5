"""The hooks the round loop calls (`Callback`), apart from the loop and from the callbacks
themselves, so that both import this and neither imports the other. `sim` is the running
`rayfl.engine.loop.Simulation`."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from rayfl.schema import RunConfig

if TYPE_CHECKING:
    from rayfl.engine.executor import Executor


class Callback:
    """Hooks the round loop calls; `should_stop` ends the run after the current round.

    Callbacks read what the loop passes them and never write into the simulation: a callback
    that restores a run returns the state from `resume_state` and the loop applies it.
    """

    should_stop = False

    def resume_state(self, cfg: RunConfig) -> Any:
        """A checkpoint to continue from (a `rayfl.engine.checkpoint.Restored`) or None; called
        once before `on_run_start`."""
        return None

    def on_run_start(self, sim: Any) -> None:
        pass

    def on_round_state(
        self,
        cfg: RunConfig,
        round_idx: int,
        participants: Sequence[int],
        executor: Executor,
        history: list[dict[str, float]],
    ) -> None:
        """After a round, before `on_round_end`: the round's participants and where the client and
        server states live (checkpoints read them; nothing else should need this)."""

    def on_round_end(self, sim: Any, round_idx: int, metrics: dict[str, float]) -> None:
        pass

    def on_run_end(self, sim: Any, status: str) -> None:
        """After the last round (also when the run failed or was stopped), before the executor
        shuts down; `sim.result.error` holds what ended a FAILED run."""
