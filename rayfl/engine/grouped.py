"""Grouped training (`engine.grouped: true`): a worker trains the clients of one architecture in
its call as one batched computation with `torch.func`, with the numbers of the one-client loop.

How it works. Each client of the call runs its usual round (`ClientRunner.client_round`: load
state, receive, the algorithm's own `fit`, upload, evaluate) on its own instance of the client
half, in its own thread; only one thread runs at a time, in client order, so the run is as
deterministic as the loop. When a client's `fit` calls `trainer.run(step, modules, ...)`, its
thread stops there and hands the request to the coordinator. Once every client has stopped (or
finished), the coordinator trains the compatible requests together:

- the clients' parameters and buffers are stacked (`torch.func.stack_module_state`);
- the algorithm's own step (`step(x, y)`, a method of the client half) runs under
  `torch.func.functional_call` with each client's slice of the stack, vectorized over clients by
  `torch.func.vmap(torch.func.grad(...))`;
- each client draws its batches from its own generator exactly as `LocalTrainer.run` does;
  clients whose batches have different sizes at a step (the last batch of an epoch) are trained
  in separate vmapped calls at that step, and a client with fewer batches is simply left out of
  the steps after its last one (masked), so every loss is the one the loop computes;
- the optimizer (SGD with momentum and weight decay, or Adam), gradient clipping and the loss
  metric are applied per client on stacked state, with `torch.optim`'s formulas.

The trained weights are written back into each client's modules and the threads resume, so
whatever `fit` does after `trainer.run` (prototypes, logits, a second `run`) happens as usual.

What a step may not do, checked before or during the first step (when a check fails the
clients of that request are trained one after another by `LocalTrainer.run` instead, with a
warning naming the reason; the numbers are the loop's either way):

- be anything but a method of the client half (`self.training_step`, `self._stage2_step`);
- use modules the client does not hold as direct attributes, or train parameters outside them;
- read tensors kept on the client (not in its modules) that differ between clients: those must
  be the round's broadcast, the same for every client of the architecture;
- use BatchNorm (its running statistics are in-place buffer updates, and its batch statistics
  amplify float32 rounding until grouped and one-by-one numbers drift apart), or change any
  buffer in place;
- draw random numbers (dropout): `vmap(randomness="error")` refuses them;
- branch in Python on tensor values (`if loss > 0`, `.item()`): vmap refuses them;
- return anything but a scalar loss.

Reference: the `torch.func` model-ensembling recipe (stack_module_state + functional_call +
vmap), https://pytorch.org/tutorials/intermediate/ensembling.html.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.func import functional_call, grad, stack_module_state, vmap

from rayfl.algorithms.base import Client, Payload, Reply, TrainSettings
from rayfl.engine.training import LocalTrainer, per_module
from rayfl.errors import ConfigError

if TYPE_CHECKING:
    from rayfl.engine.worker import ClientMetrics, ClientRunner

log = logging.getLogger(__name__)
_warned: set[str] = set()
# Requests trained in groups / one at a time in this process (tests and benchmarks read it).
COUNTS: Counter[str] = Counter()


class CannotGroup(Exception):
    """A request that must be trained one client at a time; the message says why."""


# ----------------------------------------------------------------------------- stacked optimizer


class StackedOptimizer:
    """`torch.optim.SGD` / `Adam` (as `make_optimizer` builds them) over stacked per-client
    parameters `{name: (K, ...)}`; `step` updates the clients `idx` (all of them when None).

    Every client in a call to `step` has taken the same number of steps before (`step_idx`):
    clients train their batches in order and only skip steps after their last one.
    """

    def __init__(
        self,
        params: dict[str, torch.Tensor],
        settings: TrainSettings,
        lr: float,
        clip_groups: Sequence[Sequence[str]] | None = None,
    ):
        self.params = params
        # gradient clipping per group of names, as `minibatch_loop` clips per module
        self.clip_groups = [list(params)] if clip_groups is None else [list(g) for g in clip_groups]
        self.s = settings
        self.lr = lr
        self.state: dict[str, dict[str, torch.Tensor]] = {
            name: {} for name in params
        }  # momentum_buffer | exp_avg, exp_avg_sq

    def _get(self, t: torch.Tensor, idx: torch.Tensor | None) -> torch.Tensor:
        return t if idx is None else t.index_select(0, idx)

    def _put(self, t: torch.Tensor, idx: torch.Tensor | None, value: torch.Tensor) -> None:
        if idx is None:
            t.copy_(value)
        else:
            t.index_copy_(0, idx, value)

    @torch.no_grad()
    def step(self, grads: dict[str, torch.Tensor], idx: torch.Tensor | None, step_idx: int) -> None:
        s = self.s
        if s.grad_clip is not None:
            for group in self.clip_groups:
                part = {n: grads[n] for n in group if n in grads}
                if part:
                    clip_(part, s.grad_clip)
        for name, g in grads.items():
            full = self.params[name]
            p = self._get(full, idx)
            state = self.state[name]
            if s.weight_decay != 0:
                g = g.add(p, alpha=s.weight_decay)
            if s.optimizer == "adam":
                if step_idx == 0:
                    state.setdefault("exp_avg", torch.zeros_like(full))
                    state.setdefault("exp_avg_sq", torch.zeros_like(full))
                m = self._get(state["exp_avg"], idx)
                v = self._get(state["exp_avg_sq"], idx)
                beta1, beta2, eps = 0.9, 0.999, 1e-8
                m.lerp_(g, 1 - beta1)
                v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
                t = step_idx + 1
                step_size = self.lr / (1 - beta1**t)
                denom = (v.sqrt() / (1 - beta2**t) ** 0.5).add_(eps)
                p = p.addcdiv(m, denom, value=-step_size)
                self._put(state["exp_avg"], idx, m)
                self._put(state["exp_avg_sq"], idx, v)
            else:
                if s.momentum != 0:
                    if step_idx == 0:
                        state.setdefault("momentum_buffer", torch.zeros_like(full))
                        buf = g.clone()
                    else:
                        buf = self._get(state["momentum_buffer"], idx).mul_(s.momentum).add_(g)
                    self._put(state["momentum_buffer"], idx, buf)
                    g = buf
                p = p.add(g, alpha=-self.lr)
            self._put(full, idx, p)


def clip_(grads: dict[str, torch.Tensor], max_norm: float) -> None:
    """`nn.utils.clip_grad_norm_` per client over stacked gradients `{name: (K, ...)}`."""
    norms = torch.stack([g.flatten(1).norm(dim=1) for g in grads.values()], dim=1)
    total = norms.norm(dim=1)
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for g in grads.values():
        g.mul_(coef.view(-1, *([1] * (g.dim() - 1))))


# ----------------------------------------------------------------------------- one request


class _StepModule(nn.Module):
    """The client's modules as one module whose forward is the algorithm's step, so that
    `functional_call` can swap in a client's parameters for every module the step touches."""

    def __init__(self, client: Client, func: Callable[..., torch.Tensor]) -> None:
        super().__init__()
        self.parts = nn.ModuleDict(
            {k: v for k, v in vars(client).items() if isinstance(v, nn.Module)}
        )
        self._call = (func, client)  # a tuple: nn.Module does not register it

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        func, client = self._call
        return func(client, x, y)


@dataclass
class RunRequest:
    """One client's `trainer.run(...)` call, waiting for the coordinator."""

    client: Client
    trainer: LocalTrainer
    step: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    modules: Sequence[nn.Module]
    epochs: int
    params: list[nn.Parameter]
    lr: float
    split: str
    targets: torch.Tensor | None
    result: dict[str, float] | None = None  # set when trained in a group; None: run it alone
    share_s: float = 0.0  # this client's share of the group's training time


def _module_names(client: Client, modules: Iterable[nn.Module]) -> tuple[str, ...]:
    attrs = {id(v): k for k, v in vars(client).items() if isinstance(v, nn.Module)}
    names = []
    for m in modules:
        if id(m) not in attrs:
            raise CannotGroup("the step trains a module that is not an attribute of the client")
        names.append(attrs[id(m)])
    return tuple(names)


def group_key(req: RunRequest) -> tuple[Any, ...]:
    """Requests with equal keys can be trained together (or CannotGroup says why none can)."""
    func = getattr(req.step, "__func__", None)
    if func is None or getattr(req.step, "__self__", None) is not req.client:
        raise CannotGroup("the step is not a method of the client half")
    return (
        type(req.client),
        req.client.ctx.arch,
        func,
        _module_names(req.client, req.modules),
        req.epochs,
        req.lr,
        req.split,
        req.targets is None,
    )


def _client_tensors(client: Client) -> list[tuple[str, torch.Tensor]]:
    """Tensors a step could read that are not in the client's modules."""
    out = []
    for k, v in vars(client).items():
        items: Iterable[tuple[str, Any]]
        if isinstance(v, Mapping):
            items = ((f"{k}[{i!r}]", x) for i, x in v.items())
        elif isinstance(v, list | tuple):
            items = ((f"{k}[{i}]", x) for i, x in enumerate(v))
        else:
            items = [(k, v)]
        for name, x in items:
            if isinstance(x, torch.Tensor) and not isinstance(x, nn.Parameter):
                out.append((name, x))
    return out


def check_group(reqs: Sequence[RunRequest]) -> None:
    """The checks that need no computation (see the module docstring)."""
    first = reqs[0].client
    for m in first.modules():
        for sub in m.modules():
            if isinstance(sub, nn.modules.batchnorm._BatchNorm):
                # Running statistics are in-place buffer updates; and even static BN's batch
                # statistics amplify float32 rounding until grouped and one-by-one drift apart.
                raise CannotGroup("the model has BatchNorm")
    base = _client_tensors(first)
    for r in reqs[1:]:
        other = _client_tensors(r.client)
        same = len(other) == len(base) and all(
            a == b and x.shape == y.shape and torch.equal(x, y)
            for (a, x), (b, y) in zip(base, other)
        )
        if not same:
            raise CannotGroup(
                "the clients hold different tensors outside their modules "
                f"({', '.join(n for n, _ in base) or 'none'}); keep per-client values in modules"
            )


def _batches(req: RunRequest) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """This client's batches over all epochs, drawn exactly as `LocalTrainer.run` draws them."""
    t = req.trainer
    out: list[tuple[torch.Tensor, torch.Tensor]] = []
    for _ in range(req.epochs):
        out.extend(t.data(req.split).iterate(t.settings.batch_size, t.generator, req.targets))
    return out


def train_group(reqs: Sequence[RunRequest], settings: TrainSettings) -> list[dict[str, float]]:
    """Train the requests (same key) as one stacked computation; write the weights back.

    Raises CannotGroup, with the clients' modules and generators untouched, when the step
    cannot run vectorized.
    """
    check_group(reqs)
    k = len(reqs)
    lead = reqs[0]
    func = lead.step.__func__  # type: ignore[attr-defined]
    containers = [_StepModule(r.client, func) for r in reqs]
    for r in reqs:
        for m in r.modules:
            m.train()
    params, buffers = stack_module_state(containers)  # type: ignore[arg-type]
    names = {id(p): n for n, p in containers[0].named_parameters()}
    if any(id(p) not in names for p in lead.params):
        raise CannotGroup("the step trains parameters outside the client's modules")
    trained_names = [names[id(p)] for p in lead.params]
    clip_groups = [[names[id(p)] for p in g] for g in per_module(lead.params, lead.modules)]
    stacked = {n: v.detach() for n, v in params.items()}
    fixed = {n: v for n, v in stacked.items() if n not in trained_names}
    fixed.update(buffers)
    trained = {n: stacked[n] for n in trained_names}
    states = [r.trainer.generator.get_state() for r in reqs]
    batches = [_batches(r) for r in reqs]
    try:
        return _train(reqs, containers[0], trained, fixed, batches, settings, k, clip_groups)
    except CannotGroup:
        for r, s in zip(reqs, states):
            r.trainer.generator.set_state(s)
        raise
    except RuntimeError as exc:  # vmap's refusals: randomness, data-dependent control flow
        for r, s in zip(reqs, states):
            r.trainer.generator.set_state(s)
        raise CannotGroup(f"the step cannot run under vmap ({str(exc).splitlines()[0]})") from exc


def _train(
    reqs: Sequence[RunRequest],
    container: nn.Module,
    trained: dict[str, torch.Tensor],
    fixed: dict[str, torch.Tensor],
    batches: list[list[tuple[torch.Tensor, torch.Tensor]]],
    settings: TrainSettings,
    k: int,
    clip_groups: list[list[str]],
) -> list[dict[str, float]]:
    device = next(iter(trained.values())).device if trained else torch.device("cpu")

    def loss_of(
        tr: dict[str, torch.Tensor], fx: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        loss = functional_call(container, (tr, fx), (x, y))
        return loss, loss.detach()

    step_fn = vmap(grad(loss_of, has_aux=True), randomness="error")
    if batches[0]:
        # Parameters the step never reaches get no gradient in the loop, so the optimizer
        # leaves them alone (no weight decay, no momentum): find them once, on client 0.
        used = _used(loss_of, trained, fixed, batches[0][0])
        trained = {n: v for n, v in trained.items() if n in used}
    opt = StackedOptimizer(trained, settings, reqs[0].lr, clip_groups)
    totals = torch.zeros(k, device=device)
    counts = [0] * k
    steps = max((len(b) for b in batches), default=0)
    before = {n: v.clone() for n, v in fixed.items()}
    for t in range(steps):
        by_size: dict[int, list[int]] = defaultdict(list)
        for i, b in enumerate(batches):
            if t < len(b):
                by_size[len(b[t][1])].append(i)
        for size, members in sorted(by_size.items()):
            full = len(members) == k
            idx = None if full else torch.tensor(members, device=device)
            tr = trained if full else {n: v.index_select(0, idx) for n, v in trained.items()}  # type: ignore[arg-type]
            fx = fixed if full else {n: v.index_select(0, idx) for n, v in fixed.items()}  # type: ignore[arg-type]
            x = torch.stack([batches[i][t][0] for i in members])
            y = torch.stack([batches[i][t][1] for i in members])
            grads, losses = step_fn(tr, fx, x, y)
            if losses.dim() != 1:
                raise CannotGroup("the step does not return a scalar loss")
            opt.step(grads, idx, t)
            with torch.no_grad():
                if full:
                    totals += losses * size
                else:
                    totals.index_add_(0, idx, losses * size)  # type: ignore[arg-type]
            for i in members:
                counts[i] += size
        if t == 0 and any(not torch.equal(before[n], v) for n, v in fixed.items()):
            raise CannotGroup("the step changes buffers in place")
    del before
    with torch.no_grad():
        for j, r in enumerate(reqs):
            current = dict(_StepModule(r.client, lambda *a: a[0]).named_parameters())
            for n, v in trained.items():
                current[n].copy_(v[j])
    return [{"loss": float(totals[i]) / counts[i] if counts[i] else float("nan")} for i in range(k)]


def _used(
    loss_of: Callable[..., tuple[torch.Tensor, torch.Tensor]],
    trained: dict[str, torch.Tensor],
    fixed: dict[str, torch.Tensor],
    batch: tuple[torch.Tensor, torch.Tensor],
) -> set[str]:
    """Names of the trained parameters client 0's first step differentiates (on copies)."""
    tr = {n: v[0].clone().requires_grad_(True) for n, v in trained.items()}
    fx = {n: v[0].clone() for n, v in fixed.items()}
    loss, _ = loss_of(tr, fx, *batch)
    if loss.dim() != 0:
        raise CannotGroup("the step does not return a scalar loss")
    grads = torch.autograd.grad(loss, list(tr.values()), allow_unused=True)
    return {n for n, g in zip(tr, grads) if g is not None}


# ----------------------------------------------------------------------------- the coordinator


class GroupedTrainer(LocalTrainer):
    """A `LocalTrainer` whose `run` waits for the coordinator to train this client with the others
    of its group; when the coordinator cannot group it, the usual loop runs here instead."""

    def __init__(self, lane: _Lane, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.lane = lane

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
        if module_lrs is not None:
            raise ConfigError(
                "engine.grouped=true trains one learning rate per client; unset engine.grouped "
                "or the algorithm's per-module rate (e.g. algorithm.proxy_lr)"
            )
        if params is None:
            params = [p for m in modules for p in m.parameters() if p.requires_grad]
        params = list(params)
        req = RunRequest(
            client=self.lane.client,
            trainer=self,
            step=step,
            modules=list(modules),
            epochs=self.settings.local_epochs if epochs is None else epochs,
            params=params,
            lr=self.settings.lr if lr is None else lr,
            split=split,
            targets=targets,
        )
        self.lane.pause(req)
        if req.result is not None:
            self.lane.share_s += req.share_s
            return req.result
        return super().run(step, modules, epochs, params, lr, split, targets)


@dataclass
class _Lane:
    """One client's thread; only one lane runs at a time (the coordinator hands over the turn)."""

    client: Client
    body: Callable[[], Any] = lambda: None
    go: threading.Event = field(default_factory=threading.Event)
    stopped: threading.Event = field(default_factory=threading.Event)
    request: RunRequest | None = None
    output: Any = None
    error: BaseException | None = None
    done: bool = False
    waited_s: float = 0.0  # time spent paused, waiting for the group
    share_s: float = 0.0  # this client's share of the groups' training time
    thread: threading.Thread | None = None

    def _main(self) -> None:
        self.go.wait()
        try:
            self.output = self.body()
        except BaseException as exc:  # handed to the coordinator, which re-raises it
            self.error = exc
        self.done = True
        self.stopped.set()

    def pause(self, req: RunRequest) -> None:
        # The global RNG is what the loop would have here; keep it for this client's own turn.
        rng = _rng_state()
        self.request = req
        start = time.perf_counter()
        self.go.clear()
        self.stopped.set()
        self.go.wait()
        self.waited_s += time.perf_counter() - start
        _set_rng_state(rng)

    def resume(self) -> None:
        """Let this lane run until it pauses at its next `run` or finishes."""
        self.request = None
        self.stopped.clear()
        if self.thread is None:
            self.thread = threading.Thread(target=self._main, daemon=True)
            self.thread.start()
        self.go.set()
        self.stopped.wait()


def _rng_state() -> tuple[torch.Tensor, list[torch.Tensor]]:
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else []
    return torch.get_rng_state(), cuda


def _set_rng_state(state: tuple[torch.Tensor, list[torch.Tensor]]) -> None:
    torch.set_rng_state(state[0])
    if state[1]:
        torch.cuda.set_rng_state_all(state[1])


def _warn_once(reason: str) -> None:
    if reason not in _warned:
        _warned.add(reason)
        log.warning("grouped training: %s; these clients train one at a time", reason)


def coordinate(lanes: Sequence[_Lane], settings: TrainSettings) -> None:
    """Run the lanes to completion, training their `trainer.run` requests in groups."""
    while True:
        for lane in lanes:
            if not lane.done:
                lane.resume()
                if lane.error is not None:
                    raise lane.error
        waiting = [lane.request for lane in lanes if not lane.done and lane.request is not None]
        if not waiting:
            return
        COUNTS["requests"] += len(waiting)
        groups: dict[tuple[Any, ...], list[RunRequest]] = defaultdict(list)
        for req in waiting:
            try:
                groups[group_key(req)].append(req)
            except CannotGroup as exc:
                _warn_once(str(exc))
        for reqs in groups.values():
            if len(reqs) < 2:
                continue  # one client: the loop itself is its batched computation
            start = time.perf_counter()
            try:
                results = train_group(reqs, settings)
            except CannotGroup as exc:
                _warn_once(str(exc))
                continue
            COUNTS["grouped"] += len(reqs)
            share = (time.perf_counter() - start) / len(reqs)
            for req, res in zip(reqs, results):
                req.result = res
                req.share_s += share


def fit_grouped(
    runner: ClientRunner,
    round_idx: int,
    client_ids: Sequence[int],
    payloads: Mapping[str, Payload],
    states: Sequence[Payload | None],
    evaluate: bool,
) -> tuple[list[ClientMetrics], list[Reply], list[Payload]]:
    """`ClientRunner.fit` for `engine.grouped`: the same rows, replies and states, grouped.

    Each client gets its own instance of the client half (slot `i` among the call's clients of
    its architecture), so their modules can be stacked.
    """
    lanes: list[_Lane] = []
    slots: dict[str, int] = defaultdict(int)
    for cid, state in zip(client_ids, states):
        arch = runner.spec.archs[cid]
        client = runner.client_for(cid, state, slot=slots[arch])
        slots[arch] += 1
        lane = _Lane(client)
        lane.body = partial(
            runner.client_round,
            client,
            cid,
            round_idx,
            payloads,
            evaluate,
            partial(GroupedTrainer, lane),
            state=state,
        )
        lanes.append(lane)
    coordinate(lanes, runner.spec.train)
    metrics, replies, new_states = [], [], []
    for lane in lanes:
        row, reply, state = lane.output
        # Training time of this client: its own work plus its share of the group's steps.
        row["train_s"] = max(0.0, row["train_s"] - lane.waited_s) + lane.share_s
        metrics.append(row)
        replies.append(reply)
        new_states.append(state)
    return metrics, replies, new_states
