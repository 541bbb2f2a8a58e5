"""What a worker or the server needs to build an algorithm's halves: a small picklable spec."""

from __future__ import annotations

import ctypes
import functools
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch

from rayfl.algorithms import ALGORITHMS
from rayfl.algorithms.base import Algorithm, ClientContext, RoundContext, ServerContext
from rayfl.errors import UserError
from rayfl.schema import EngineConfig, TrainConfig


@dataclass(frozen=True)
class RunSpec:
    """Everything a worker, the server and the executors need of a run: small and picklable."""

    algorithm: str
    params: Any
    train: TrainConfig
    seed: int
    archs: tuple[str, ...]  # architecture of each client
    in_shape: tuple[int, ...]
    num_classes: int
    device: str = "auto"  # auto | cpu | cuda
    num_threads: int = 1  # torch threads while clients train (the same everywhere: same numbers)
    server_threads: int = 1  # torch threads for the server step (workers idle meanwhile)
    # The run's engine settings (executor, resources, deadlines, retries): the executors read
    # them here, so they need the spec alone, never the whole run config.
    engine: EngineConfig = field(default_factory=EngineConfig)
    per_round: int = 1  # clients sampled per round
    # also train a local-only shadow of each client (eval.local_baseline)
    local_baseline: bool = False
    # also run the algorithm's own client cut off from the federation (eval.federation_control)
    federation_control: bool = False
    privacy: Any = None  # a `rayfl.privacy.PrivacyHook` when a protection is on

    def round_context(self, round_idx: int) -> RoundContext:
        """What both halves learn of the schedule in round `round_idx`."""
        return RoundContext(index=round_idx, total=self.engine.rounds)

    @property
    def algo(self) -> Algorithm:
        return ALGORITHMS.get(self.algorithm, key="algorithm.name")

    def client_context(self, arch: str, device: torch.device) -> ClientContext:
        return ClientContext(
            arch=arch,
            in_shape=self.in_shape,
            num_classes=self.num_classes,
            device=device,
            train=self.train,
            family_archs=tuple(sorted(set(self.archs))),
        )

    def server_context(self, device: torch.device) -> ServerContext:
        counts = Counter(self.archs)
        return ServerContext(
            architectures=tuple(sorted(counts)),
            arch_counts=dict(counts),
            in_shape=self.in_shape,
            num_classes=self.num_classes,
            device=device,
            train=self.train,
            seed=self.seed,
            num_clients=len(self.archs),
        )


def keep_tensor_memory(mmap_mb: int = 64, trim_mb: int = 256) -> bool:
    """Let glibc's malloc keep freed tensor memory for reuse in this process (every process that
    trains or scores calls it): allocations up to `mmap_mb` come from the heap, and up to
    `trim_mb` of free heap stay mapped, so that batches do not map and fault in fresh pages each
    time. Returns False where the C library is not glibc (nothing is changed)."""
    try:
        mallopt = ctypes.CDLL("libc.so.6").mallopt
    except (OSError, AttributeError):
        return False
    m_trim_threshold, m_mmap_threshold = -1, -3  # <malloc.h>
    ok = mallopt(m_mmap_threshold, mmap_mb * 2**20) == 1
    return mallopt(m_trim_threshold, trim_mb * 2**20) == 1 and ok


@contextmanager
def torch_threads(n: int) -> Iterator[None]:
    """Run a phase with `n` torch threads (process-wide, so the serial executor's client and
    server phases each get their own count, exactly as in separate Ray actors)."""
    before = torch.get_num_threads()
    torch.set_num_threads(max(1, n))
    try:
        yield
    finally:
        torch.set_num_threads(before)


def seed_torch(seed: int) -> None:
    """`torch.manual_seed(seed)`, seeding the CPU generator alone where it is the only one (the
    same numbers, without queueing a seeding of every accelerator backend)."""
    if _has_accelerator():
        torch.manual_seed(seed)
    else:
        torch.default_generator.manual_seed(seed)


@functools.cache
def _has_accelerator() -> bool:
    return torch.accelerator.is_available()


def resolve_device(preference: str, gpu_ids: list | None = None) -> torch.device:
    """The device for this process. Under Ray, `gpu_ids` are the GPUs Ray assigned to the actor:
    an actor given no GPU picks none up, even where CUDA is visible."""
    has_cuda = torch.cuda.is_available()
    if preference == "cpu":
        return torch.device("cpu")
    if preference == "cuda":
        if not has_cuda or gpu_ids == []:
            raise UserError(
                "engine.device=cuda but no CUDA GPU is available to this process; "
                "use engine.device=auto (or cpu), or give workers a GPU share with engine.worker_resources.num_gpus"
            )
        return torch.device("cuda", 0)
    if has_cuda and (gpu_ids is None or len(gpu_ids) > 0):
        return torch.device("cuda", 0)
    return torch.device("cpu")
