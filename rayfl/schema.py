"""The run configuration's schema: frozen dataclasses, one line of help and the range per key.

A YAML experiment file mirrors `RunConfig`. Every key is declared with `setting`, which keeps
its help (what `rayfl ls SECTION` prints) and its allowed range in the field's metadata, where
the loader (`rayfl.config`) checks it. This module imports nothing of rayfl, so every layer
(algorithms, data, engine) may use the types; loading, overrides and the checks across keys
live in `rayfl.config` and `rayfl.checks`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal


@dataclass(frozen=True)
class Range:
    """The allowed interval of a numeric setting; open ends exclude the bound."""

    lo: float | None = None
    hi: float | None = None
    lo_open: bool = False
    hi_open: bool = False

    def contains(self, v: float) -> bool:
        if self.lo is not None and (v <= self.lo if self.lo_open else v < self.lo):
            return False
        return not (self.hi is not None and (v >= self.hi if self.hi_open else v > self.hi))

    def describe(self) -> str:
        if self.hi is None:
            return f"must be {'>' if self.lo_open else '>='} {_num(self.lo or 0)}"
        left = "(" if self.lo_open else "["
        right = ")" if self.hi_open else "]"
        return f"must be in {left}{_num(self.lo or 0)}, {_num(self.hi)}{right}"


def setting(
    default: Any = dataclasses.MISSING,
    help: str = "",
    *,
    factory: Callable[[], Any] | None = None,
    ge: float | None = None,
    gt: float | None = None,
    le: float | None = None,
    lt: float | None = None,
    pattern: str | None = None,
) -> Any:
    """A config key: its default (or `factory`), one line of `help`, and its range (`ge`/`gt`
    below, `le`/`lt` above; every number is also finite and >= 0) or the `pattern` a string
    must match in full."""
    metadata: dict[str, Any] = {"help": help}
    if pattern is not None:
        metadata["pattern"] = pattern
    if (ge, gt, le, lt) != (None, None, None, None):
        metadata["range"] = Range(
            lo=gt if gt is not None else ge if ge is not None else 0,
            hi=lt if lt is not None else le,
            lo_open=gt is not None,
            hi_open=lt is not None,
        )
    if factory is not None:
        return field(default_factory=factory, metadata=metadata)
    return field(default=default, metadata=metadata)


def help_of(f: dataclasses.Field[Any]) -> str:
    """The help text of a schema field (empty when it has none)."""
    return str(f.metadata.get("help", ""))


def range_of(f: dataclasses.Field[Any]) -> Range | None:
    """The declared range of a schema field, if any."""
    rng = f.metadata.get("range")
    return rng if isinstance(rng, Range) else None


def _num(v: float) -> str:
    return str(int(v)) if float(v).is_integer() and abs(v) < 1e15 else f"{v:g}"


MAX_ROUNDS = 1_000_000  # more is a typo, and a run that would never end
NAME = r"[A-Za-z0-9_][A-Za-z0-9._-]{0,99}"  # one path component: no '/', no '..', no dot first


@dataclass(frozen=True)
class PartitionConfig:
    """How the training set is split across clients (see `rayfl.data.partition`)."""

    name: str = setting("dirichlet", "label partitioner (`rayfl ls partitioners`)")
    alpha: float = setting(0.5, "Dirichlet concentration: smaller = more skewed labels", gt=0)
    min_samples: int = setting(10, "dirichlet: resample until every client has this many")
    classes_per_client: int = setting(2, "pathological: k classes per client", ge=1)


@dataclass(frozen=True)
class DomainsConfig:
    """Feature shift (`rayfl.data.domains`): clients in domains, on top of any label partition."""

    transforms: tuple[str, ...] = setting(
        (), "one domain per recipe, e.g. [identity, 'rotate:90'] (`rayfl ls partitioners`)"
    )
    proportions: tuple[float, ...] | None = setting(
        None, "share of clients per domain (null: equal)"
    )
    clients_per_domain: int | tuple[int, ...] | None = setting(
        None, "clients per domain, one count or one per domain (overrides proportions)"
    )
    held_out: str | None = setting(None, "a domain whose clients are only evaluated, never trained")
    noise: float = setting(0.0, "NIID-Bench feature skew: client i gets noise of std noise*i/N")


@dataclass(frozen=True)
class DataConfig:
    """The dataset, how many clients share it, and the splits each client holds."""

    dataset: str = setting("fmnist", "dataset name (`rayfl ls`)")
    root: str | None = setting(None, "dataset folder (null: $RAYFL_DATA or ~/.cache/rayfl/data)")
    num_clients: int = setting(20, "clients in the federation", ge=1)
    partition: PartitionConfig = setting(help="label partition", factory=PartitionConfig)
    test_fraction: float = setting(0.2, "per-client test split (its labels as train's)", gt=0, lt=1)
    public_fraction: float = setting(0.0, "public/distillation split, taken first", lt=1)
    train_samples: int | None = setting(None, "seeded subset of the training set (null: all)", ge=1)
    val_fraction: float = setting(0.0, "per-client validation split (tune, best round)", lt=1)
    options: dict[str, Any] = setting(help="dataset-specific (e.g. synthetic sizes)", factory=dict)
    domains: DomainsConfig = setting(
        help="feature shift: clients in domains", factory=DomainsConfig
    )


@dataclass(frozen=True)
class ModelConfig:
    """Which architecture each client trains (`rayfl.models.families`)."""

    family: str = setting("seed3", "heterogeneity family (`rayfl ls`)")
    architectures: tuple[str, ...] | None = setting(None, "explicit list instead of a family")
    proportions: tuple[float, ...] | None = setting(
        None, "shares per architecture (null: round-robin)"
    )


@dataclass(frozen=True)
class TrainConfig:
    """The engine's one minibatch loop, shared by every algorithm."""

    local_epochs: int = setting(1, "passes over a client's training split per round", le=10_000)
    batch_size: int = setting(64, "samples per training step", ge=1)
    lr: float = setting(0.01, "learning rate of the clients' optimizer", gt=0)
    momentum: float = setting(0.9, "SGD momentum", le=1)
    weight_decay: float = setting(0.0, "L2 weight decay")
    optimizer: Literal["sgd", "adam"] = setting("sgd", "the clients' optimizer")
    grad_clip: float | None = setting(None, "max L2 norm of the gradient per step", gt=0)
    eval_batch_size: int | None = setting(None, "null: 128 on a CPU, 1024 on a GPU", ge=1)


@dataclass(frozen=True)
class Resources:
    """What one Ray worker (or the server actor) reserves."""

    num_cpus: float = setting(1.0, "CPUs reserved")
    num_gpus: float = setting(0.0, "GPUs; fractions share one (Ray does not cap memory)")


@dataclass(frozen=True)
class EngineConfig:
    """Rounds, client sampling, and where and how the work runs."""

    rounds: int = setting(10, "rounds of the federation", ge=1, le=MAX_ROUNDS)
    fraction: float = setting(1.0, "share of clients sampled per round", gt=0, le=1)
    clients_per_round: int | None = setting(None, "overrides `fraction` when set", ge=1)
    sampling: Literal["uniform", "poisson"] = setting(
        "uniform", "exactly that many, or each client with probability q (DP-FedAvg's)"
    )
    executor: Literal["serial", "ray"] = setting("ray", "one process, or Ray worker actors")
    num_workers: int | None = setting(
        None,
        "Ray workers (null: one wave of a round's clients, at most what fits)",
        ge=1,
        le=10_000,
    )
    worker_resources: Resources = setting(help="what each worker reserves", factory=Resources)
    resources_by_arch: dict[str, Resources] = setting(
        help="a worker pool per architecture, e.g. {resnet18_w10: {num_gpus: 0.5}}", factory=dict
    )
    server_resources: Resources = setting(
        help="what a server actor reserves", factory=lambda: Resources(num_cpus=0.0)
    )
    server_in: Literal["auto", "driver", "actor"] = setting(
        "auto", "the server half: in this process, an actor, or auto (same numbers)"
    )
    device: Literal["auto", "cpu", "cuda"] = setting("auto", "torch device (auto: cuda if any)")
    address: str | None = setting(None, "null: a private local Ray; auto or ray://host:port: join")
    ray_num_cpus: int | None = setting(None, "CPUs of the private local Ray (null: all)", ge=1)
    object_store_mb: int | None = setting(None, "object store of the private Ray (MB)", ge=80)
    spill_dir: str | None = setting(None, "spill folder of the private Ray (null: in the run's)")
    wait_for_resources_s: float = setting(600.0, "joined cluster: wait for workers (0: do not)")
    eval_every: int = setting(1, "rounds between evaluations", ge=1)
    clients_per_call: int = setting(4, "clients one worker trains per Ray call", ge=1)
    pipeline_eval: bool = setting(True, "score the server's models while the next round trains")
    num_threads: int | None = setting(None, "torch threads per worker (null: its num_cpus)", ge=1)
    server_threads: int | None = setting(None, "torch threads of the server step (null: all)", ge=1)
    round_timeout_s: float | None = setting(None, "deadline for a round's clients", gt=0)
    min_replies: int = setting(1, "a round needs at least this many valid replies", ge=1)
    max_retries: int = setting(2, "re-runs of a client batch whose worker died")
    checkpoint_every: int = setting(1, "rounds between checkpoints (0: never)")
    startup_timeout_s: float = setting(300.0, "how long workers may take to start", gt=0)


@dataclass(frozen=True)
class TierConfig:
    """One kind of device (`rayfl.engine.devices`)."""

    name: str = setting("default", "the tier's name (devices.by_arch refers to it)")
    speed: float = setting(1.0, "relative speed: 1.0 runs reference_gflops GFLOP/s", gt=0)
    availability: float = setting(1.0, "probability that a sampled device is available", le=1)
    trace: tuple[int, ...] = setting((), "per-round availability (1/0), repeated")
    dropout: float = setting(0.0, "probability that a device drops out mid-training", le=1)
    bandwidth_mbps: float | None = setting(None, "link for the payloads (null: free)", gt=0)


@dataclass(frozen=True)
class DevicesConfig:
    """Simulated devices and a virtual clock (`rayfl.engine.devices`); off without tiers."""

    tiers: tuple[TierConfig, ...] = setting((), "kinds of device: [{name, speed, ...}]")
    by_arch: dict[str, str] = setting(help="architecture -> tier name", factory=dict)
    proportions: tuple[float, ...] = setting((), "else: clients drawn into tiers with these shares")
    policy: Literal["all", "deadline", "first_k"] = setting("all", "whom the server waits for")
    deadline_s: float | None = setting(None, "policy deadline: simulated seconds")
    first_k: int | None = setting(None, "policy first_k: replies the server waits for")
    reference_gflops: float = setting(10.0, "GFLOP/s of a device of speed 1.0", gt=0)
    work: Literal["flops", "measured"] = setting("flops", "estimated work, or measured seconds")

    @property
    def enabled(self) -> bool:
        return bool(self.tiers)


@dataclass(frozen=True)
class EvalConfig:
    """What personalized accuracy measures (docs/engine.md, "Metrics"), and what else is scored.

    `deployed` (the field's protocol: HtFLlib, PFLlib, FL-bench): every `engine.eval_every`
    rounds, after the server step, every client (participant or not, with its last state; a
    client never trained with its initial weights) scores the model it would deploy now, given
    the server's new broadcast. `after_fit`: the round's participants right after local training,
    with what they hold then (cheaper).
    """

    protocol: Literal["deployed", "after_fit"] = setting("deployed", "who scores what, and when")
    local_baseline: bool = setting(False, "also train local-only copies: baseline/local_acc")
    federation_control: bool = setting(False, "also run cut-off clients: baseline/control_acc")
    proxy_health_rounds: int = setting(3, "warn when proxy/acc is near chance after (0: never)")
    targets: tuple[float, ...] = setting((), "accuracies t: rounds_to/acc_<t>, bytes_to/acc_<t>")


@dataclass(frozen=True)
class TrackingConfig:
    """Where metrics, parameters and artifacts are logged."""

    backend: Literal["mlflow", "stdout", "none"] = setting("mlflow", "the tracking backend")
    experiment: str = setting("rayfl", "MLflow experiment name")
    run_name: str | None = setting(None, "MLflow run name (null: the run folder's name)")
    uri: str | None = setting(None, "null: $MLFLOW_TRACKING_URI or sqlite:///<cwd>/mlflow.db")


@dataclass(frozen=True)
class DPConfig:
    """Client-level DP (DP-FedAvg, McMahan et al. 2018; see `rayfl.privacy.dp`)."""

    enabled: bool = setting(False, "clip and noise the clients' updates")
    clip: float = setting(1.0, "L2 bound on each client's update (or statistics)", gt=0)
    noise_multiplier: float = setting(1.0, "noise std on the sum = noise_multiplier * clip")
    delta: float = setting(1e-5, "target delta of the reported (epsilon, delta)", gt=0, lt=1)
    accountant: Literal["rdp", "pld"] = setting("rdp", "dp-accounting's RDP or PLD accountant")
    noise_seed: int | None = setting(
        None, "null: OS entropy (128 bits); a number: tests only, no privacy", lt=2**128
    )


@dataclass(frozen=True)
class SecAggConfig:
    """Secure aggregation (Bonawitz et al. 2017), simulated (see `rayfl.privacy.secagg`)."""

    enabled: bool = setting(False, "mask the clients' payloads")
    frac_bits: int = setting(24, "fixed-point scale 2^frac_bits in the uint64 ring", ge=8, le=40)
    threshold: float = setting(0.5, "shares to rebuild a secret: floor(threshold*n)+1", lt=1)
    dropout: float = setting(0.0, "chance that a client drops after masking (seeded)", lt=1)


@dataclass(frozen=True)
class PrivacyConfig:
    """Protections of the shared payloads; algorithms do not know whether they are on."""

    dp: DPConfig = setting(help="client-level differential privacy", factory=DPConfig)
    secagg: SecAggConfig = setting(help="secure aggregation", factory=SecAggConfig)

    @property
    def enabled(self) -> bool:
        return self.dp.enabled or self.secagg.enabled


@dataclass(frozen=True)
class AlgorithmConfig:
    name: str
    params: Any  # the algorithm's own frozen Params dataclass instance


@dataclass(frozen=True)
class RunConfig:
    algorithm: AlgorithmConfig
    name: str = setting("run", "the run's name: letters, digits, '.', '_', '-'", pattern=NAME)
    seed: int = setting(0, "seed of every random stream of the run", le=2**32 - 1)
    data: DataConfig = setting(help="dataset and splits", factory=DataConfig)
    model: ModelConfig = setting(help="client architectures", factory=ModelConfig)
    train: TrainConfig = setting(help="the minibatch loop", factory=TrainConfig)
    engine: EngineConfig = setting(help="rounds, sampling, execution", factory=EngineConfig)
    eval: EvalConfig = setting(help="what is scored", factory=EvalConfig)
    tracking: TrackingConfig = setting(help="MLflow or stdout", factory=TrackingConfig)
    privacy: PrivacyConfig = setting(help="DP and secure aggregation", factory=PrivacyConfig)
    devices: DevicesConfig = setting(help="simulated devices", factory=DevicesConfig)


def clients_per_round(cfg: RunConfig) -> int:
    """Clients sampled per round: `engine.clients_per_round`, else `fraction` of them."""
    e = cfg.engine
    if e.clients_per_round is not None:
        return e.clients_per_round
    return max(1, round(e.fraction * cfg.data.num_clients))


def server_in_driver(e: EngineConfig) -> bool:
    """Whether the Ray executor runs the server half in the driver's process (`engine.server_in`)."""
    if e.server_in != "auto":
        return e.server_in == "driver"
    res = e.server_resources
    return e.address is None and res.num_cpus == 0 and res.num_gpus == 0


def to_dict(cfg: Any) -> Any:
    """Plain nested dict of a config (the algorithm section flattened to name + params)."""
    if isinstance(cfg, AlgorithmConfig):
        return {"name": cfg.name, **to_dict(cfg.params)}
    if dataclasses.is_dataclass(cfg) and not isinstance(cfg, type):
        return {f.name: to_dict(getattr(cfg, f.name)) for f in dataclasses.fields(cfg)}
    if isinstance(cfg, tuple):
        return [to_dict(v) for v in cfg]
    if isinstance(cfg, dict):
        return {k: to_dict(v) for k, v in cfg.items()}
    return cfg
