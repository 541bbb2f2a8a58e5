"""The one minibatch loop and the one evaluation loop. Every algorithm trains through these."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence

import numpy as np
import torch
from torch import nn

from rayfl.algorithms.base import Batch, Client
from rayfl.config import TrainConfig
from rayfl.data.datasets import ArrayDataset


def logits_of(output: torch.Tensor | tuple[torch.Tensor, ...]) -> torch.Tensor:
    """Models may return `(logits, embedding)` (pFedES proxies); the logits come first."""
    return output[0] if isinstance(output, tuple) else output


def make_optimizer(
    params: Iterable[nn.Parameter], settings: TrainConfig, lr: float | None = None
) -> torch.optim.Optimizer:
    params = list(params)
    lr = settings.lr if lr is None else lr
    if settings.optimizer == "adam":
        return torch.optim.Adam(params, lr=lr, weight_decay=settings.weight_decay)
    return torch.optim.SGD(
        params, lr=lr, momentum=settings.momentum, weight_decay=settings.weight_decay
    )


class ArrayBatches:
    """Batches of `dataset.x_train[indices]` (or the test set), normalized on the device."""

    def __init__(
        self,
        dataset: ArrayDataset,
        indices: np.ndarray | None,
        device: torch.device,
        test: bool = False,
    ):
        x = dataset.x_test if test else dataset.x_train
        y = dataset.y_test if test else dataset.y_train
        if indices is not None:
            x, y = x[indices], y[indices]
        self.x = dataset.as_tensor(x).to(device)
        self.y = torch.from_numpy(np.array(y, dtype=np.int64)).to(device)

    def __len__(self) -> int:
        return len(self.y)

    def iterate(
        self,
        batch_size: int,
        generator: torch.Generator | None = None,
        targets: torch.Tensor | None = None,
    ) -> Iterator[Batch]:
        """Batches in order, or shuffled by `generator`. With `targets`, the first `len(targets)`
        samples come paired with those per-sample targets instead of their labels."""
        y = self.y if targets is None else targets.to(self.x.device)
        n = len(y)
        order = (
            torch.randperm(n, generator=generator).to(self.x.device)
            if generator is not None
            else None
        )
        for start in range(0, n, batch_size):
            if order is None:
                yield self.x[start : start + batch_size], y[start : start + batch_size]
                continue
            idx = order[start : start + batch_size]
            # A trailing batch of one breaks BatchNorm in train mode; its sample is seen next epoch.
            if len(idx) == 1 and n > 1:
                continue
            yield self.x[idx], y[idx]


class LocalTrainer:
    """`rayfl.algorithms.base.Trainer` over one client's train/test splits and the public split."""

    def __init__(
        self,
        dataset: ArrayDataset,
        train_idx: np.ndarray,
        test_idx: np.ndarray,
        settings: TrainConfig,
        device: torch.device,
        generator: torch.Generator,
        public: Callable[[], ArrayBatches] | None = None,
    ) -> None:
        self.settings = settings
        self.device = device
        self.generator = generator
        self._dataset = dataset
        self._indices = {"train": train_idx, "test": test_idx}
        self._public = public
        self._cache: dict[str, ArrayBatches] = {}
        self.num_samples = len(train_idx)

    def data(self, split: str) -> ArrayBatches:
        if split == "public":
            if self._public is None:
                raise ValueError("this trainer has no public split")
            return self._public()  # shared by the worker's clients, built once
        if split not in self._cache:
            self._cache[split] = ArrayBatches(self._dataset, self._indices[split], self.device)
        return self._cache[split]

    def batches(self, split: str = "train", shuffle: bool = False) -> Iterator[Batch]:
        size = self.settings.batch_size if shuffle else self.settings.eval_batch_size
        return self.data(split).iterate(size, self.generator if shuffle else None)

    def run(
        self,
        step: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
        modules: Sequence[nn.Module],
        epochs: int | None = None,
        params: Iterable[nn.Parameter] | None = None,
        lr: float | None = None,
        split: str = "train",
        targets: torch.Tensor | None = None,
    ) -> dict[str, float]:
        epochs = self.settings.local_epochs if epochs is None else epochs
        for m in modules:
            m.train()
        if params is None:
            params = [p for m in modules for p in m.parameters() if p.requires_grad]
        params = list(params)
        optimizer = make_optimizer(params, self.settings, lr)
        total = torch.zeros((), device=self.device)
        count = 0
        for _ in range(epochs):
            data = self.data(split)
            for x, y in data.iterate(self.settings.batch_size, self.generator, targets):
                loss = step(x, y)
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                if self.settings.grad_clip is not None:
                    nn.utils.clip_grad_norm_(params, self.settings.grad_clip)
                optimizer.step()
                total += loss.detach() * len(y)
                count += len(y)
        return {"loss": float(total) / count if count else float("nan")}


@torch.inference_mode()
def accuracy(model: nn.Module, batches: Iterable[Batch]) -> tuple[int, int]:
    """(correct, total) of `model` over `batches` in eval mode."""
    model.eval()
    correct = total = 0
    for x, y in batches:
        correct += int((logits_of(model(x)).argmax(1) == y).sum())
        total += len(y)
    return correct, total


@torch.no_grad()
def evaluate_client(client: Client, trainer: LocalTrainer) -> dict[str, float]:
    """Personalized accuracy on the client's own test split, plus the algorithm's extra metrics."""
    for m in client.modules():
        m.eval()
    model = client.eval_model()
    correct = total = 0
    extra: dict[str, float] = {}
    for x, y in trainer.batches("test"):
        correct += int((logits_of(model(x)).argmax(1) == y).sum())
        total += len(y)
        for k, v in client.eval_metrics(x, y).items():
            extra[k] = extra.get(k, 0.0) + v * len(y)
    out = {"acc": correct / total if total else float("nan"), "num_test": float(total)}
    out.update({k: v / total for k, v in extra.items()} if total else {})
    return out
