"""A callback that interrupts a run at the end of a round, shared by the resume tests."""

from __future__ import annotations

from rayfl.engine.callbacks import Callback


class InterruptAfterRound(Callback):
    """Ctrl-C at the end of round `at`. Placed after the checkpoint callback, the checkpoint of
    that round is written; placed before the tracker, it also stands for a SIGKILL between the
    checkpoint and the tracker callback (the tracker never sees that round)."""

    def __init__(self, at: int) -> None:
        self.at = at

    def on_round_end(self, sim, round_idx, metrics):
        if round_idx == self.at:
            raise KeyboardInterrupt
