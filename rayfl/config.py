"""Run configuration: frozen dataclasses, YAML loading, dotted `key=value` overrides, strict checks.

A YAML file mirrors `RunConfig`. Unknown keys, wrong types and impossible values raise
`ConfigError` naming the dotted key and the fix. The `algorithm` section holds `name` plus the
fields of that algorithm's own frozen `Params` dataclass (declared beside the algorithm).
"""

from __future__ import annotations

import dataclasses
import re
import typing
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from rayfl.config_checks import (  # noqa: F401 (RANGES, Range, clients_per_round: re-exported)
    RANGES,
    Range,
    check,
    clients_per_round,
    convert,
    from_dict,
    non_negative,
    per_round,
)
from rayfl.errors import ConfigError, require, suggest


@dataclass(frozen=True)
class PartitionConfig:
    """How the training set is split across clients (see `rayfl.data.partition`)."""

    name: str = "dirichlet"
    alpha: float = 0.5  # Dirichlet concentration: smaller = more skewed labels
    min_samples: int = 10  # dirichlet: resample until every client has at least this many
    classes_per_client: int = 2  # pathological: k classes per client


@dataclass(frozen=True)
class DomainsConfig:
    """Feature shift (`rayfl.data.domains`): clients in domains, on top of any label partition."""

    # one domain per recipe, e.g. [identity, "rotate:90", "tint:red", "contrast:3"]; the list of
    # recipes: `rayfl ls partitioners`. Empty: no transformation (a dataset's own domains apply)
    transforms: tuple[str, ...] = ()
    proportions: tuple[float, ...] | None = None  # share of clients per domain (None: equal)
    # clients per domain, one count for all or one per domain (overrides proportions)
    clients_per_domain: int | tuple[int, ...] | None = None
    held_out: str | None = None  # a domain whose clients are only evaluated, never trained
    noise: float = 0.0  # NIID-Bench feature skew: client i gets Gaussian noise, std noise*i/N


@dataclass(frozen=True)
class DataConfig:
    dataset: str = "fmnist"
    root: str | None = None  # None: $RAYFL_DATA or ~/.cache/rayfl/data
    num_clients: int = 20
    partition: PartitionConfig = field(default_factory=PartitionConfig)
    test_fraction: float = (
        0.2  # per-client local test split, same label distribution as its train split
    )
    public_fraction: float = 0.0  # held-out public / distillation split taken before partitioning
    train_samples: int | None = None  # seeded subset of the training set (None: all of it)
    # per-client validation split, carved (stratified, seeded) from the client's training split;
    # `rayfl tune` and best-round selection choose on it (0: none, the splits stay as without it)
    val_fraction: float = 0.0
    options: dict[str, Any] = field(default_factory=dict)  # dataset-specific (e.g. synthetic sizes)
    domains: DomainsConfig = field(default_factory=DomainsConfig)  # feature shift, domains


@dataclass(frozen=True)
class ModelConfig:
    family: str = "seed3"
    architectures: tuple[str, ...] | None = None  # explicit list instead of a named family
    proportions: tuple[float, ...] | None = None  # None: round-robin assignment


@dataclass(frozen=True)
class TrainConfig:
    """The engine's one minibatch loop, shared by every algorithm."""

    local_epochs: int = 1
    batch_size: int = 64
    lr: float = 0.01
    momentum: float = 0.9
    weight_decay: float = 0.0
    optimizer: Literal["sgd", "adam"] = "sgd"
    grad_clip: float | None = None  # max L2 norm of the gradient per step
    # Samples per evaluation batch; None: 128 on a CPU, 1024 on a GPU (`eval_batch_size`).
    eval_batch_size: int | None = None


@dataclass(frozen=True)
class Resources:
    num_cpus: float = 1.0
    num_gpus: float = 0.0  # fractions share one GPU (bookkeeping only: Ray does not cap memory)


@dataclass(frozen=True)
class EngineConfig:
    rounds: int = 10
    fraction: float = 1.0  # share of clients sampled per round, in (0, 1]
    clients_per_round: int | None = None  # overrides `fraction` when set
    # `uniform`: exactly that many clients, drawn without replacement; `poisson`: each client
    # independently with probability q = clients per round / num_clients (DP-FedAvg's scheme,
    # accounted as such; see `rayfl.privacy.dp`).
    sampling: Literal["uniform", "poisson"] = "uniform"
    executor: Literal["serial", "ray"] = "ray"
    # Worker actors of the Ray executor, each reserving `worker_resources` (the serial executor
    # has none and ignores it). None: enough for one wave of a round's clients,
    # ceil(clients per round / clients_per_call), at most what the cluster holds. A `rayfl tune`
    # trial reserves its workers up front in its placement group, so there None means one.
    num_workers: int | None = None
    worker_resources: Resources = field(default_factory=Resources)
    # A worker pool per architecture: e.g. {resnet18_w10: {num_cpus: 2, num_gpus: 0.5}}; the
    # clients of an architecture named here train on workers with that reservation, the others
    # on `worker_resources` workers. Same numbers as one pool (torch threads: `num_threads`).
    resources_by_arch: dict[str, Resources] = field(default_factory=dict)
    # The server runs between the workers' phases, so by default it reserves no CPU of its own.
    server_resources: Resources = field(default_factory=lambda: Resources(num_cpus=0.0))
    # Where the Ray executor runs the server half: `driver` (in this process, like the serial
    # executor: no third process importing torch at start-up), `actor` (a `ServerActor` with
    # `server_resources`, restarted from its last state if it dies), or `auto`: the driver when
    # the run starts its own local Ray (no `address`) and the server reserves nothing, else an
    # actor. Same numbers either way.
    server_in: Literal["auto", "driver", "actor"] = "auto"
    device: Literal["auto", "cpu", "cuda"] = "auto"
    address: str | None = (
        None  # None: a private local Ray; "auto" or "ray://host:port": join a cluster
    )
    ray_num_cpus: int | None = None  # CPUs of the private local Ray (None: all)
    object_store_mb: int | None = (
        None  # object store of the private local Ray (None: Ray's default)
    )
    # where a private local Ray spills objects (None: `ray-spill` in the run's own folder)
    spill_dir: str | None = None
    # joined cluster (address set): how long to wait for the autoscaler to provide the workers
    # the run needs (engine.num_workers, else one) before giving up; 0: do not wait
    wait_for_resources_s: float = 600.0
    eval_every: int = 1
    clients_per_call: int = 4  # clients one worker trains per Ray call
    # Score the server's models on the server test set while the next round's clients train
    # (a separate Ray actor; same numbers, the row is completed when the score arrives).
    pipeline_eval: bool = True
    num_threads: int | None = None  # torch threads per worker (None: its num_cpus, at least 1)
    # torch threads for the server step, which runs while the workers wait (None: all CPUs)
    server_threads: int | None = None
    round_timeout_s: float | None = None  # deadline for a round's clients (None: wait for all)
    min_replies: int = 1  # a round needs at least this many valid replies
    max_retries: int = 2  # re-runs of a client batch whose worker died (and of a server step)
    checkpoint_every: int = 1  # rounds between checkpoints in the run directory (0: never)
    startup_timeout_s: float = 300.0  # how long workers and the server may take to start


@dataclass(frozen=True)
class TierConfig:
    """One kind of device (`rayfl.engine.devices`)."""

    name: str = "default"
    speed: float = 1.0  # relative compute speed: 1.0 runs devices.reference_gflops GFLOP/s
    availability: float = 1.0  # probability that a sampled device is available in a round
    trace: tuple[int, ...] = ()  # per-round availability (1/0), repeated; replaces availability
    dropout: float = 0.0  # probability that an available device drops out mid-training
    bandwidth_mbps: float | None = None  # link for the payload down and up (None: free)

    def __post_init__(self) -> None:
        where = f"devices.tiers[{self.name}]"
        require(self.speed > 0, f"{where}.speed", f"must be > 0 (got {self.speed})")
        for key in ("availability", "dropout"):
            value = getattr(self, key)
            require(0 <= value <= 1, f"{where}.{key}", f"must be in [0, 1] (got {value})")
        require(
            all(v in (0, 1) for v in self.trace),
            f"{where}.trace",
            f"must list 1 (available) or 0 per round (got {list(self.trace)})",
        )
        bw = self.bandwidth_mbps
        require(bw is None or bw > 0, f"{where}.bandwidth_mbps", f"must be > 0 or null (got {bw})")


@dataclass(frozen=True)
class DevicesConfig:
    """Simulated devices and a virtual clock (`rayfl.engine.devices`); off without tiers."""

    tiers: tuple[
        TierConfig, ...
    ] = ()  # kinds of device: {name, speed, availability or trace, dropout, bandwidth_mbps}
    by_arch: dict[str, str] = field(default_factory=dict)  # architecture -> tier name
    proportions: tuple[float, ...] = ()  # else: clients drawn into the tiers with these shares
    # whom the server waits for: all, the clients done by deadline_s, or the first_k done
    policy: Literal["all", "deadline", "first_k"] = "all"
    deadline_s: float | None = None  # policy deadline: simulated seconds
    first_k: int | None = None  # policy first_k: how many replies the server waits for
    reference_gflops: float = 10.0  # GFLOP/s of a device of speed 1.0
    # flops: estimated work (independent of this machine); measured: this machine's seconds
    work: Literal["flops", "measured"] = "flops"

    @property
    def enabled(self) -> bool:
        return bool(self.tiers)

    def __post_init__(self) -> None:
        names = [t.name for t in self.tiers]
        require(len(set(names)) == len(names), "devices.tiers", f"tier names repeat: {names}")
        for arch, tier in self.by_arch.items():
            require(
                tier in names,
                f"devices.by_arch.{arch}",
                f"{tier!r} is not a tier; choose one of {', '.join(names) or '(no tiers)'}",
            )
        require(
            not self.by_arch or not self.proportions,
            "devices.proportions",
            "give by_arch or proportions, not both",
        )
        require(
            not self.proportions
            or (
                len(self.proportions) == len(names)
                and all(p >= 0 for p in self.proportions)
                and sum(self.proportions) > 0
            ),
            "devices.proportions",
            f"needs one non-negative share per tier ({len(names)}), got {list(self.proportions)}",
        )
        require(
            self.policy != "deadline" or (self.deadline_s is not None and self.deadline_s > 0),
            "devices.deadline_s",
            "policy deadline needs deadline_s > 0 (simulated seconds)",
        )
        require(
            self.policy != "first_k" or (self.first_k is not None and self.first_k >= 1),
            "devices.first_k",
            "policy first_k needs first_k >= 1",
        )
        require(
            self.work == "flops" or self.policy == "all",
            "devices.work",
            "measured times are known only after training; use policy all, or work flops",
        )
        require(self.reference_gflops > 0, "devices.reference_gflops", "must be > 0")


@dataclass(frozen=True)
class EvalConfig:
    """What personalized accuracy measures (docs/engine.md, "Metrics"), and what else the engine scores.

    `deployed` (the field's protocol: HtFLlib, PFLlib, FL-bench): every `engine.eval_every`
    rounds, after the server step, every client (participant or not, with its last state; a
    client never trained with its initial weights) scores the model it would deploy now, given
    the server's new broadcast. `after_fit`: the round's participants right after local training,
    with what they hold then (cheaper; rayfl's protocol before 2026-12).
    """

    protocol: Literal["deployed", "after_fit"] = "deployed"
    # Also train a plain cross-entropy copy of every client's model (same initial weights, seeds
    # and batches as `algorithm.name=local`) and report `baseline/local_acc` and
    # `baseline/gain_points` (personal/acc minus it, in points) in the same run.
    local_baseline: bool = False
    # Also run the algorithm's own client cut off from the federation (the no-federation
    # control): same initial weights, seeds and batches, but every round it receives the server's
    # first, untrained broadcast and its upload goes nowhere; report `baseline/control_acc` and
    # `baseline/federated_gain_points` (personal/acc minus it, in points): what the federation
    # itself brought, with the algorithm's local regularizers credited to themselves.
    federation_control: bool = False
    # Warn (progress line, log, final table) when a server-scored proxy (`proxy/acc`) is still
    # within 5 points of chance (`proxy/chance`) after this many rounds; 0: never.
    proxy_health_rounds: int = 3
    # accuracy targets: `rounds_to/acc_<t>`, `bytes_to/acc_<t>` and `seconds_to/acc_<t>` are the
    # round, cumulative bytes (up + down) and wall seconds at which personal/acc first reaches t
    targets: tuple[float, ...] = ()


@dataclass(frozen=True)
class TrackingConfig:
    backend: Literal["mlflow", "stdout", "none"] = "mlflow"
    experiment: str = "rayfl"
    run_name: str | None = None
    uri: str | None = None  # None: $MLFLOW_TRACKING_URI or sqlite:///<cwd>/mlflow.db


@dataclass(frozen=True)
class DPConfig:
    """Client-level DP (DP-FedAvg, McMahan et al. 2018; see `rayfl.privacy.dp`)."""

    enabled: bool = False
    clip: float = 1.0  # L2 bound on each client's update (or its statistics payload)
    noise_multiplier: float = 1.0  # Gaussian noise std on the sum = noise_multiplier * clip
    delta: float = 1e-5  # target delta of the reported (epsilon, delta)
    accountant: Literal["rdp", "pld"] = "rdp"  # dp-accounting's RDP or PLD accountant
    # None: the noise comes from fresh OS entropy, kept only in the run's checkpoint (resume
    # stays exact). An integer makes the noise reproducible from the config, which anyone holding
    # the config can then subtract: for tests and debugging only, never for a privacy claim.
    noise_seed: int | None = None


@dataclass(frozen=True)
class SecAggConfig:
    """Secure aggregation (Bonawitz et al. 2017), simulated (see `rayfl.privacy.secagg`)."""

    enabled: bool = False
    frac_bits: int = 24  # fixed-point scale 2^frac_bits in the uint64 ring
    threshold: float = 0.5  # shares needed to rebuild a secret: floor(threshold * n) + 1
    dropout: float = 0.0  # simulated chance that a client drops after masking (seeded)


@dataclass(frozen=True)
class PrivacyConfig:
    """Protections of the shared payloads; algorithms do not know whether they are on."""

    dp: DPConfig = field(default_factory=DPConfig)
    secagg: SecAggConfig = field(default_factory=SecAggConfig)

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
    name: str = "run"
    seed: int = 0
    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    tracking: TrackingConfig = field(default_factory=TrackingConfig)
    privacy: PrivacyConfig = field(default_factory=PrivacyConfig)
    devices: DevicesConfig = field(default_factory=DevicesConfig)


class _Loader(yaml.SafeLoader):
    """PyYAML's safe loader with YAML 1.2 floats: `1e-3` and `1E5` are numbers, not strings,
    that refuses nesting deeper than `YAML_DEPTH` while composing (PyYAML composes nodes
    recursively: 20,000 nested brackets would exhaust the stack)."""

    _depth = 0

    def compose_node(self, parent: Any, index: Any) -> Any:
        self._depth += 1
        if self._depth > YAML_DEPTH:
            raise yaml.composer.ComposerError(
                None, None, f"nests deeper than {YAML_DEPTH} levels", self.peek_event().start_mark
            )
        try:
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(
        r"""^(?:[-+]?(?:[0-9][0-9_]*)\.[0-9_]*(?:[eE][-+]?[0-9]+)?
        |[-+]?(?:[0-9][0-9_]*)(?:[eE][-+]?[0-9]+)
        |\.[0-9_]+(?:[eE][-+]?[0-9]+)?
        |[-+]?\.(?:inf|Inf|INF)
        |\.(?:nan|NaN|NAN))$""",
        re.X,
    ),
    list("-+0123456789."),
)


YAML_DEPTH = 64  # nesting of a config's values; a recursive alias nests without end
YAML_VALUES = 100_000  # values after aliases are expanded (a "billion laughs" file has 10^9)


def yaml_load(text: str) -> Any:
    """Parse YAML text safely (no Python objects), with YAML 1.2 number syntax.

    Raises:
        yaml.YAMLError: also for a recursive alias or aliases that expand beyond
            ``YAML_VALUES`` values, before anything walks the result.
    """
    try:
        data = yaml.load(text, Loader=_Loader)  # noqa: S506 (a SafeLoader subclass)
    except ValueError as exc:  # an int of more digits than Python converts (`int` refuses)
        raise yaml.YAMLError(str(exc).splitlines()[0]) from None
    _check_expansion(data)
    return data


def _check_expansion(data: Any) -> None:
    budget = YAML_VALUES
    stack: list[tuple[Any, int]] = [(data, 0)]
    while stack:
        node, depth = stack.pop()
        budget -= 1
        if depth > YAML_DEPTH or budget < 0:
            raise yaml.YAMLError(
                f"nests deeper than {YAML_DEPTH} levels or expands to over {YAML_VALUES} values "
                "(a recursive or repeated alias); write the values out"
            )
        if isinstance(node, dict):
            stack.extend((v, depth + 1) for v in node.values())
            stack.extend((k, depth + 1) for k in node if isinstance(k, tuple))
        elif isinstance(node, list | tuple):
            stack.extend((v, depth + 1) for v in node)


def parse_override(text: str) -> tuple[list[str], Any]:
    """`a.b.c=value` -> (['a', 'b', 'c'], value), the value parsed as YAML."""
    if "=" not in text:
        raise ConfigError(f"override {text!r} is not key=value (e.g. engine.rounds=5)")
    key, raw = text.split("=", 1)
    path = key.strip().split(".")
    if not all(path):
        raise ConfigError(f"override {text!r} has an empty key part")
    try:
        value = yaml_load(raw) if raw.strip() else ""
    except yaml.YAMLError:
        value = raw
    return path, value


def set_dotted(raw: dict[str, Any], path: Sequence[str], value: Any, where: str) -> None:
    """Set `raw[a][b][c] = value` for `path` ['a', 'b', 'c'], creating sections; `where` names the
    source (an override, a suite entry) in the error when a part is a value, not a section."""
    node = raw
    for i, part in enumerate(path[:-1]):
        child = node.get(part)
        if child is None:
            child = node[part] = {}
        elif not isinstance(child, dict):
            raise ConfigError(f"{where}: {'.'.join(path[: i + 1])} is a value, not a section")
        node = child
    node[path[-1]] = value


def apply_overrides(raw: dict[str, Any], overrides: Sequence[str]) -> dict[str, Any]:
    """Return a copy of the nested dict `raw` with dotted overrides applied."""
    out = _deepcopy(raw)
    for text in overrides:
        path, value = parse_override(text)
        set_dotted(out, path, value, f"override {text!r}")
    return out


def read_yaml(path: str | Path, what: str = "config file") -> dict[str, Any]:
    """A YAML file whose top level is a mapping, or a ConfigError naming the problem."""
    path = Path(path)
    if path.is_dir():
        raise ConfigError(
            f"{what} {path} is a directory; pass a YAML file (e.g. experiments/*.yaml)"
        )
    if not path.is_file():
        raise ConfigError(
            f"{what} {path} not found: check the path (examples live in experiments/)"
        )
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{what} {path} cannot be read ({exc}); check the file") from None
    return parse_yaml(text, path)


def parse_yaml(text: str, path: Path) -> dict[str, Any]:
    """The YAML text of file ``path`` as a mapping, or a ConfigError naming the problem."""
    try:
        raw = yaml_load(text) or {}
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path} is not valid YAML: {str(exc).splitlines()[0]}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of sections")
    from rayfl import plugins

    return plugins.absolute(raw, path.parent)  # `plugins:` paths are relative to the file


REPO_ROOT = Path(__file__).resolve().parents[1]


def resolve_base_file(name: Any, referrer: Path, key: str = "base") -> Path:
    """The experiment file a suite (`base_file:`) or a sweep (`base:`) builds on.

    A relative path is looked up, in this order, next to the referring file, in the current
    directory, then in the repository root (where `experiments/` lives), so a suite or sweep
    works from wherever it is run; an absolute path is taken as it is.

    Raises:
        ConfigError: `name` is not a non-empty string, or no candidate is a file.
    """
    if not isinstance(name, str) or not name:
        raise ConfigError(
            f"{referrer}: {key}: name the experiment file to build on (e.g. experiments/pfedes_fmnist.yaml)"
        )
    path = Path(name).expanduser()
    candidates = (
        [path]
        if path.is_absolute()
        else [referrer.parent / path, Path.cwd() / path, REPO_ROOT / path]
    )
    for candidate in candidates:
        if candidate.is_file():
            return candidate.resolve()
    raise ConfigError(
        f"{referrer}: {key}: {name} not found (looked in {', '.join(str(c.parent) for c in candidates)}); "
        "give a path relative to that file or to the repository root"
    )


def _deepcopy(d: Any) -> Any:
    if isinstance(d, Mapping):
        return {k: _deepcopy(v) for k, v in d.items()}
    if isinstance(d, list):
        return [_deepcopy(v) for v in d]
    return d


def _algorithm_from_dict(data: Any, dropped_ok: bool) -> AlgorithmConfig:
    from rayfl.registry import ALGORITHMS

    if not isinstance(data, Mapping) or "name" not in data:
        raise ConfigError("missing key algorithm.name: name an algorithm (see `rayfl ls`)")
    data = dict(data)
    name = data.pop("name")
    if not isinstance(name, str):
        raise ConfigError(f"algorithm.name: expected a string, got {name!r}")
    algo = ALGORITHMS.get(name, key="algorithm.name")
    if dropped_ok:
        # The name was switched on the command line: the file's settings for the other
        # algorithm do not apply to this one, so they are left out rather than refused.
        valid = {f.name for f in dataclasses.fields(algo.params)}
        data = {k: v for k, v in data.items() if k in valid}
    return AlgorithmConfig(name=name, params=from_dict(algo.params, data, prefix="algorithm."))


def build_config(raw: Mapping[str, Any], overrides: Sequence[str] = ()) -> RunConfig:
    """Validated `RunConfig` from a nested dict plus dotted overrides."""
    from rayfl import plugins

    file_algorithm = dict(raw.get("algorithm") or {}) if isinstance(raw, Mapping) else {}
    # `plugins:` (rayfl.plugins) register names the rest of the config may use
    merged = plugins.take(apply_overrides(dict(raw), overrides))
    renamed = any(o.split("=", 1)[0].strip() == "algorithm.name" for o in overrides)
    if renamed and file_algorithm:
        # The file's keys for the old algorithm are dropped; the command line's stay strict.
        explicit = {
            o.split("=", 1)[0].strip()[len("algorithm.") :]
            for o in overrides
            if o.startswith("algorithm.")
        }
        algo_cfg = _algorithm_from_dict(merged.get("algorithm"), dropped_ok=True)
        _check_explicit(algo_cfg, explicit)
    else:
        algo_cfg = _algorithm_from_dict(merged.get("algorithm"), dropped_ok=False)
    rest = {k: v for k, v in merged.items() if k != "algorithm"}
    rest["algorithm"] = {}
    hints = typing.get_type_hints(RunConfig)
    fields = {f.name for f in dataclasses.fields(RunConfig)}
    for key in rest:
        if key not in fields:
            raise ConfigError(
                f"unknown key {key}{suggest(str(key), fields)}; valid top-level keys: {', '.join(sorted(fields))}"
            )
    kwargs: dict[str, Any] = {"algorithm": algo_cfg}
    for key, value in rest.items():
        if key != "algorithm":
            kwargs[key] = convert(value, hints[key], key)
    non_negative(kwargs, "")
    cfg = RunConfig(**kwargs)
    check(cfg)
    return cfg


def _check_explicit(algo_cfg: AlgorithmConfig, explicit: set[str]) -> None:
    valid = {f.name for f in dataclasses.fields(algo_cfg.params)} | {"name"}
    for key in explicit:
        if key not in valid:
            raise ConfigError(
                f"unknown key algorithm.{key} for algorithm {algo_cfg.name!r}{suggest(key, valid)}; "
                f"valid keys: {', '.join(sorted(valid))}"
            )


def load_config(path: str | Path, overrides: Sequence[str] = ()) -> RunConfig:
    """Load a YAML experiment file and apply `key=value` overrides."""
    return build_config(read_yaml(path), overrides)


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


def server_in_driver(e: EngineConfig) -> bool:
    """Whether the Ray executor runs the server half in the driver's process (`engine.server_in`)."""
    if e.server_in != "auto":
        return e.server_in == "driver"
    res = e.server_resources
    return e.address is None and res.num_cpus == 0 and res.num_gpus == 0


def ray_preview(
    raw: Mapping[str, Any], overrides: Sequence[str] = ()
) -> tuple[EngineConfig, int] | None:
    """The engine settings and clients per round of a Ray run, read from the file and overrides
    without the registries (so without importing torch), so that `rayfl run` can start Ray
    while the whole config is checked. None when the run is not on Ray or these sections do not
    read (the whole check then names the problem)."""
    try:
        merged = apply_overrides(dict(raw), overrides)
        hints = typing.get_type_hints(RunConfig)
        engine = convert(merged.get("engine") or {}, hints["engine"], "engine")
        data = convert(merged.get("data") or {}, hints["data"], "data")
    except ConfigError:
        return None
    if engine.executor != "ray":
        return None
    return engine, per_round(engine, data.num_clients)
