"""The one minibatch loop and the one evaluation loop. Every algorithm trains through these.

`minibatch_loop` is the loop; `shuffled_batches` the one batching rule. A client reaches them
through `LocalTrainer.run`, the server through `ServerData.run` (`rayfl.engine.server`), both by
way of `fit_tensors` or directly, so FedFD's distillation and FedGH's header training run the
very code the clients do.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from rayfl.algorithms.base import Batch, Client
from rayfl.data.datasets import ArrayDataset
from rayfl.models.sbn import batch_independent
from rayfl.schema import TrainConfig


def logits_of(output: torch.Tensor | tuple[torch.Tensor, ...]) -> torch.Tensor:
    """Models may return `(logits, embedding)` (pFedES proxies); the logits come first."""
    return output[0] if isinstance(output, tuple) else output


def make_optimizer(
    params: Iterable[nn.Parameter] | Iterable[dict[str, Any]],
    settings: TrainConfig,
    lr: float | None = None,
) -> torch.optim.Optimizer:
    """The configured optimizer over `params` (parameters, or torch parameter-group dicts)."""
    groups: Any = list(params)
    lr = settings.lr if lr is None else lr
    if settings.optimizer == "adam":
        return torch.optim.Adam(groups, lr=lr, weight_decay=settings.weight_decay)
    return torch.optim.SGD(
        groups, lr=lr, momentum=settings.momentum, weight_decay=settings.weight_decay
    )


def per_module(
    params: Sequence[nn.Parameter], modules: Sequence[nn.Module]
) -> list[list[nn.Parameter]]:
    """`params` grouped by the module of `modules` that owns them (the first one, in order): one
    group per module, aligned with `modules` (possibly empty), then the group of parameters no
    module owns. Gradient clipping is applied per group: a client that trains two models at once
    (pFedES's local model and proxy, FML's pair) clips each model's gradient on its own, so one
    model's gradient never rescales the other's step."""
    remaining = {id(p): p for p in params}
    groups = [[remaining.pop(id(p)) for p in m.parameters() if id(p) in remaining] for m in modules]
    groups.append(list(remaining.values()))
    return groups


Step = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def shuffled_batches(
    x: torch.Tensor, y: torch.Tensor, batch_size: int, generator: torch.Generator | None = None
) -> Iterator[Batch]:
    """One pass over `(x[i], y[i])` in minibatches, in order or shuffled by `generator` (None: the
    global torch RNG). The permutation is drawn when the first batch is asked for.

    A trailing batch of one breaks BatchNorm in train mode: it is skipped (unless it is all the
    data) and its sample is seen in the next pass.
    """
    n = len(y)
    order = torch.randperm(n, generator=generator).to(x.device)
    for start in range(0, n, batch_size):
        idx = order[start : start + batch_size]
        if len(idx) == 1 and n > 1:
            continue
        yield x[idx], y[idx]


def minibatch_loop(
    step: Step,
    modules: Sequence[nn.Module],
    batches: Iterable[Batch],
    params: Sequence[nn.Parameter],
    optimizer: torch.optim.Optimizer,
    grad_clip: float | None = None,
) -> dict[str, float]:
    """The one minibatch loop: `modules` in train mode, then for every batch
    `loss = step(x, y)`, backward, optional gradient clipping (each module's gradient on its
    own, `per_module`), optimizer step.

    Returns:
        `{"loss": mean of the batch losses weighted by batch size}` (NaN without batches).
    """
    for m in modules:
        m.train()
    clip_groups = [g for g in per_module(params, modules) if g]
    total: torch.Tensor | None = None
    count = 0
    for x, y in batches:
        loss = step(x, y)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        if grad_clip is not None:
            for group in clip_groups:
                nn.utils.clip_grad_norm_(group, grad_clip)
        optimizer.step()
        weighted = loss.detach() * len(y)
        total = weighted if total is None else total + weighted
        count += len(y)
    return {"loss": float(total) / count if total is not None and count else float("nan")}


def trainable(modules: Sequence[nn.Module]) -> list[nn.Parameter]:
    return [p for m in modules for p in m.parameters() if p.requires_grad]


def fit_tensors(
    step: Step,
    modules: Sequence[nn.Module],
    x: torch.Tensor,
    y: torch.Tensor,
    settings: TrainConfig,
    epochs: int | None = None,
    steps: int | None = None,
    params: Iterable[nn.Parameter] | None = None,
    lr: float | None = None,
    batch_size: int | None = None,
    generator: torch.Generator | None = None,
    module_lrs: Sequence[float | None] | None = None,
) -> dict[str, float]:
    """Train on the tensors `(x, y)` with `settings`' optimizer: `epochs` passes of shuffled
    minibatches (default `settings.local_epochs`), or exactly `steps` minibatches, drawing a new
    pass whenever one is used up (`steps` wins when both are given). `module_lrs`, aligned with
    `modules`, gives a module its own learning rate (None: `lr`)."""
    params = trainable(modules) if params is None else list(params)
    size = batch_size or settings.batch_size
    passes = (
        itertools.count()
        if steps is not None
        else range(settings.local_epochs if epochs is None else epochs)
    )
    batches: Iterable[Batch] = (b for _ in passes for b in shuffled_batches(x, y, size, generator))
    if steps is not None:
        batches = itertools.islice(batches, steps)
    if module_lrs is None:
        optimizer = make_optimizer(params, settings, lr)
    else:
        if len(module_lrs) != len(modules):
            raise ValueError("module_lrs must have one entry per module")
        base = settings.lr if lr is None else lr
        rates = [*module_lrs, None]  # parameters outside every module train at `lr`
        groups = per_module(params, modules)
        optimizer = make_optimizer(
            [{"params": g, "lr": base if r is None else r} for g, r in zip(groups, rates) if g],
            settings,
            base,
        )
    return minibatch_loop(step, modules, batches, params, optimizer, settings.grad_clip)


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
        if generator is not None:
            yield from shuffled_batches(self.x[: len(y)], y, batch_size, generator)
            return
        for start in range(0, len(y), batch_size):
            yield self.x[start : start + batch_size], y[start : start + batch_size]


def stat_batches(data: ArrayBatches, batch_size: int) -> Iterator[torch.Tensor]:
    """The inputs of `data` in training-sized batches, in one fixed shuffled order: the pass
    over which batch-statistics batch norm collects its running statistics before a model is
    scored (`rayfl.models.sbn`). The order depends on nothing of the run, so the same model
    on the same data always gets the same statistics."""
    order = torch.Generator().manual_seed(0)
    return (x for x, _ in shuffled_batches(data.x, data.y, batch_size, order))


class LocalTrainer:
    """`rayfl.algorithms.base.Trainer` over one client's train/test/validation splits and the
    public split."""

    def __init__(
        self,
        dataset: ArrayDataset,
        train_idx: np.ndarray,
        test_idx: np.ndarray,
        settings: TrainConfig,
        device: torch.device,
        generator: torch.Generator,
        public: Callable[[], ArrayBatches] | None = None,
        val_idx: np.ndarray | None = None,
    ) -> None:
        self.settings = settings
        self.device = device
        self.generator = generator
        self._dataset = dataset
        self._indices = {"train": train_idx, "test": test_idx}
        if val_idx is not None and len(val_idx):
            self._indices["val"] = val_idx
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

    @property
    def has_val(self) -> bool:
        """Whether the client has a validation split (`data.val_fraction`)."""
        return "val" in self._indices

    def batches(self, split: str = "train", shuffle: bool = False) -> Iterator[Batch]:
        size = self.settings.batch_size if shuffle else eval_batch_size(self.settings, self.device)
        return self.data(split).iterate(size, self.generator if shuffle else None)

    def stat_batches(self) -> Iterator[torch.Tensor]:
        """The client's training inputs for batch-norm statistics (`stat_batches`)."""
        return stat_batches(self.data("train"), self.settings.batch_size)

    def run(
        self,
        step: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
        modules: Sequence[nn.Module],
        epochs: int | None = None,
        params: Iterable[nn.Parameter] | None = None,
        lr: float | None = None,
        split: str = "train",
        targets: torch.Tensor | None = None,
        module_lrs: Sequence[float | None] | None = None,
    ) -> dict[str, float]:
        data = self.data(split)
        y = data.y if targets is None else targets.to(data.x.device)
        return fit_tensors(
            step,
            modules,
            data.x[: len(y)],
            y,
            self.settings,
            epochs,
            None,
            params,
            lr,
            None,
            self.generator,
            module_lrs,
        )


def eval_batch_size(settings: TrainConfig, device: torch.device) -> int:
    """`train.eval_batch_size`, or by default 128 on a CPU (larger batches' activation buffers
    outgrow malloc's reuse and are slower) and 1024 on a GPU."""
    if settings.eval_batch_size is not None:
        return settings.eval_batch_size
    return 128 if device.type == "cpu" else 1024


def score(
    model: nn.Module,
    batches: Iterable[Batch],
    extra: Callable[[torch.Tensor, torch.Tensor], dict[str, float]] | None = None,
) -> dict[str, float]:
    """`acc`, mean cross-entropy `loss` and sample count `n` of `model` (in the mode it is in)
    over `batches`, under inference mode, plus the sample-weighted means of `extra(x, y)`'s
    metrics. Empty batches give NaN accuracy and loss."""
    correct = total = 0
    loss = 0.0
    sums: dict[str, float] = {}
    with torch.inference_mode():
        for x, y in batches:
            logits = logits_of(model(x))
            correct += int((logits.argmax(1) == y).sum())
            loss += float(F.cross_entropy(logits.float(), y, reduction="sum"))
            total += len(y)
            for k, v in (extra(x, y) if extra is not None else {}).items():
                sums[k] = sums.get(k, 0.0) + v * len(y)
    nan = float("nan")
    out = {"acc": correct / total if total else nan, "loss": loss / total if total else nan}
    out["n"] = float(total)
    out.update({k: v / total for k, v in sums.items()} if total else {})
    return out


def evaluate_client(
    client: Client, trainer: LocalTrainer, model: nn.Module | None = None
) -> dict[str, float]:
    """Personalized accuracy and loss of `model` (default: `client.eval_model()`) on the
    client's own test split (`acc`, `loss`, `num_test`), plus the algorithm's extra metrics, and
    on its validation split when it has one (`val_acc`, `val_loss`, `num_val`).

    The model is scored in eval mode with batch-independent batch norm (`rayfl.models.sbn`), so
    no sample's score depends on the others in its batch, under `torch.inference_mode`;
    `eval_model()` and the split's cached tensors are made outside it, as training may later use
    them."""
    for m in client.modules():
        m.eval()
    with torch.no_grad():
        model = client.eval_model() if model is None else model
    test = trainer.batches("test")  # its tensors are cached: made outside inference mode
    val = trainer.batches("val") if trainer.has_val else None
    with batch_independent(model, trainer.stat_batches):
        scored = score(model, test, client.eval_metrics)
        out = {"acc": scored.pop("acc"), "loss": scored.pop("loss"), "num_test": scored.pop("n")}
        out.update(scored)
        if val is not None:
            v = score(model, val)
            out.update({"val_acc": v["acc"], "val_loss": v["loss"], "num_val": v["n"]})
    return out
