"""A `ServerData` over a fixed public tensor that trains through the engine's real minibatch loop."""

import torch

from rayfl.config import TrainConfig
from rayfl.engine.training import fit_tensors


class FakeServerData:
    device = torch.device("cpu")

    def __init__(self, x: torch.Tensor | None = None, settings: TrainConfig | None = None) -> None:
        self.x = torch.zeros(0) if x is None else x
        self.settings = settings or TrainConfig()

    def batches(self, split="public", batch_size=None, shuffle=False):
        size = batch_size or len(self.x)
        for i in range(0, len(self.x), size):
            yield self.x[i : i + size], torch.zeros(len(self.x[i : i + size]), dtype=torch.long)

    def num_samples(self, split="public"):
        return len(self.x)

    def run(
        self,
        step,
        modules,
        epochs=None,
        steps=None,
        params=None,
        settings=None,
        split="public",
        data=None,
        batch_size=None,
    ):
        x, y = data if data is not None else (self.x, torch.zeros(len(self.x), dtype=torch.long))
        return fit_tensors(
            step,
            modules,
            x,
            y,
            settings or self.settings,
            epochs=epochs,
            steps=steps,
            params=params,
            batch_size=batch_size,
        )
