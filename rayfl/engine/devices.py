"""Simulated devices: tiers of speed, availability and bandwidth, and a virtual clock.

Model heterogeneity exists because devices differ. The `devices:` section maps every client to a
tier (by architecture, or drawn with proportions), and each round:

1. a sampled client is *available* with its tier's probability (or per its tier's trace), and an
   available one may *drop out* mid-training (its upload never arrives);
2. every other client gets a simulated duration: its training work divided by its tier's speed,
   plus its payload's transfer time over the tier's bandwidth;
3. the round's policy decides who the server waits for: `all` (round = the slowest), `deadline`
   (clients slower than `deadline_s` are stragglers and dropped) or `first_k` (the K fastest).

Work is an estimate, not a measurement: the forward FLOPs of the client's architecture on one
sample (counted once with `torch.utils.flop_counter`), times 3 for the backward pass, times the
client's training samples and `train.local_epochs`. The clock therefore never depends on the
real machine's speed; `work: measured` uses the seconds each client's training took on this
machine instead, for the clock only (with the `all` policy: a deadline decided after training
would need the work undone). Everything is drawn from the run's seed: the same config gives the
same participants and clock on every executor and worker count.

Dropped clients (unavailable, dropped out, stragglers) do not train this round: their state stays
as it was, as a device whose work never reached the server would restart from it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import torch
from torch.utils.flop_counter import FlopCounterMode

from rayfl.errors import require
from rayfl.models.base import build_model
from rayfl.seeding import Purpose, rng_of, words

if TYPE_CHECKING:
    from rayfl.schema import DevicesConfig, RunConfig

BACKWARD_FACTOR = 3.0  # a training step costs about three forward passes (forward + backward)


@dataclass
class RoundPlan:
    """Who trains this round and the simulated times behind that decision."""

    participants: list[int]
    times: dict[int, float] = field(default_factory=dict)  # simulated seconds per timed client
    unavailable: list[int] = field(default_factory=list)
    dropped_out: list[int] = field(default_factory=list)
    stragglers: list[int] = field(default_factory=list)
    round_s: float = 0.0

    def metrics(self) -> dict[str, float]:
        return {
            "time/virtual_round_s": self.round_s,
            "devices/participants": float(len(self.participants)),
            "devices/unavailable": float(len(self.unavailable)),
            "devices/dropped_out": float(len(self.dropped_out)),
            "devices/stragglers": float(len(self.stragglers)),
        }


def forward_flops(arch: str, in_shape: Sequence[int], num_classes: int) -> float:
    """FLOPs of one sample's forward pass through architecture `arch` (counted, not timed)."""
    model = build_model(arch, in_shape, num_classes).eval()
    counter = FlopCounterMode(display=False)
    with torch.no_grad(), counter:
        model(torch.zeros(1, *in_shape))
    return float(counter.get_total_flops())


def assign_tiers(d: DevicesConfig, seed: int, archs: Sequence[str]) -> list[str]:
    """Each client's tier name: by its architecture (`devices.by_arch`), else drawn once with
    `devices.proportions` (a seeded permutation cut into blocks), else the first tier."""
    names = [t.name for t in d.tiers]
    n = len(archs)
    if d.by_arch:
        return [d.by_arch[a] for a in archs]
    if not d.proportions:
        return [names[0]] * n
    p = np.asarray(d.proportions, dtype=float) / sum(d.proportions)
    counts = np.floor(p * n).astype(int)
    # largest remainders first, ties to the earlier tier: the counts add up to n
    for i in sorted(range(len(p)), key=lambda i: (-(p[i] * n - counts[i]), i))[: n - counts.sum()]:
        counts[i] += 1
    order = rng_of(words(Purpose.DEVICE_TIER, seed)).permutation(n)
    tiers = [""] * n
    start = 0
    for name, count in zip(names, counts):
        for c in order[start : start + count]:
            tiers[int(c)] = name
        start += count
    return tiers


class Devices:
    """The devices of one run: tiers, per-client work, and each round's plan."""

    def __init__(
        self,
        cfg: RunConfig,
        archs: Sequence[str],
        train_sizes: Sequence[int],
        in_shape: Sequence[int],
        num_classes: int,
    ) -> None:
        d = cfg.devices
        self.cfg = d
        self.seed = cfg.seed
        self.tiers = {t.name: t for t in d.tiers}
        self.client_tier = assign_tiers(d, cfg.seed, archs)
        self.archs = list(archs)
        per_sample = {
            a: BACKWARD_FACTOR * forward_flops(a, in_shape, num_classes) for a in sorted(set(archs))
        }
        epochs = cfg.train.local_epochs
        self.flops = [per_sample[a] * n * epochs for a, n in zip(archs, train_sizes)]

    def _available(self, rnd: int, client: int) -> bool:
        tier = self.tiers[self.client_tier[client]]
        if tier.trace:
            return bool(tier.trace[(rnd - 1) % len(tier.trace)])
        if tier.availability >= 1.0:
            return True
        return bool(
            rng_of(words(Purpose.DEVICE_AVAILABLE, self.seed, rnd, client)).random()
            < tier.availability
        )

    def _drops_out(self, rnd: int, client: int) -> bool:
        p = self.tiers[self.client_tier[client]].dropout
        return p > 0 and bool(
            rng_of(words(Purpose.DEVICE_DROPOUT, self.seed, rnd, client)).random() < p
        )

    def seconds(self, client: int, payload_bytes: float, measured_s: float | None = None) -> float:
        """Simulated seconds of `client`'s round: compute (estimated, or `measured_s` on this
        machine, scaled by its tier's speed) plus the payload down and up over its bandwidth
        (the upload is taken to be the broadcast's size)."""
        tier = self.tiers[self.client_tier[client]]
        if measured_s is None:
            compute = self.flops[client] / (tier.speed * self.cfg.reference_gflops * 1e9)
        else:
            compute = measured_s / tier.speed
        comm = 0.0
        if tier.bandwidth_mbps is not None:
            comm = 2.0 * payload_bytes * 8.0 / (tier.bandwidth_mbps * 1e6)
        return compute + comm

    def plan(
        self, rnd: int, sampled: Sequence[int], payload_bytes: Mapping[str, float]
    ) -> RoundPlan:
        """This round's participants among the `sampled` clients, by availability, dropout and
        the policy; `payload_bytes` is each architecture's broadcast size."""
        plan = RoundPlan(participants=[])
        ready: list[int] = []
        for c in sampled:
            if not self._available(rnd, c):
                plan.unavailable.append(c)
            elif self._drops_out(rnd, c):
                plan.dropped_out.append(c)
            else:
                ready.append(c)
        if self.cfg.work == "measured":  # times come after training (`measured`)
            plan.participants = ready
            return plan
        plan.times = {c: self.seconds(c, payload_bytes[self.archs[c]]) for c in ready}
        policy = self.cfg.policy
        if policy == "deadline":
            limit = float(self.cfg.deadline_s or math.inf)
            plan.participants = [c for c in ready if plan.times[c] <= limit]
            plan.stragglers = [c for c in ready if plan.times[c] > limit]
        elif policy == "first_k":
            by_time = sorted(ready, key=lambda c: (plan.times[c], c))
            k = int(self.cfg.first_k or len(ready))
            plan.participants = sorted(by_time[:k])
            plan.stragglers = sorted(by_time[k:])
        else:
            plan.participants = list(ready)
        done = [plan.times[c] for c in plan.participants]
        plan.round_s = max(done, default=0.0)
        if plan.stragglers and policy == "deadline":
            plan.round_s = float(self.cfg.deadline_s or 0.0)  # the server waited until then
        return plan

    def measured(
        self, plan: RoundPlan, train_s: Mapping[int, float], payload_bytes: Mapping[str, float]
    ) -> None:
        """`work: measured`: the clock from the seconds each participant trained here."""
        plan.times = {
            c: self.seconds(c, payload_bytes[self.archs[c]], train_s.get(c, 0.0))
            for c in plan.participants
        }
        plan.round_s = max(plan.times.values(), default=0.0)

    def round_metrics(self, plan: RoundPlan) -> dict[str, float]:
        """The plan's counts, with the participants per architecture (who the deadline kept)."""
        out = plan.metrics()
        for arch in sorted(set(self.archs)):
            out[f"devices/participants/arch={arch}"] = float(
                sum(self.archs[c] == arch for c in plan.participants)
            )
        return out

    def describe(self) -> dict[str, float]:
        """Clients per tier (logged once)."""
        out: dict[str, float] = {}
        for name in self.tiers:
            out[f"devices/clients/tier={name}"] = float(self.client_tier.count(name))
        return out


def check_arch_names(cfg: RunConfig, archs: Sequence[str]) -> None:
    """`engine.resources_by_arch` and `devices.by_arch` name architectures of this run, and
    `devices.by_arch` gives every one of them a tier.

    Raises:
        ConfigError: one line naming the key and the run's architectures.
    """
    present = sorted(set(archs))
    for key, mapping in (
        ("engine.resources_by_arch", cfg.engine.resources_by_arch),
        ("devices.by_arch", cfg.devices.by_arch),
    ):
        for arch in mapping:
            require(
                arch in present,
                f"{key}.{arch}",
                f"no client of this run has that architecture; the run's are {', '.join(present)}",
            )
    if cfg.devices.by_arch:
        missing = [a for a in present if a not in cfg.devices.by_arch]
        require(
            not missing,
            "devices.by_arch",
            f"gives no tier to {', '.join(missing)}; map every architecture of the run",
        )
