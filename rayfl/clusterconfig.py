"""Offline checks of a Ray cluster launcher file (`cluster.yaml`), and what it can offer.

`ray up` reports many mistakes only after talking to the cloud, or never (a fractional node
resource is accepted, then never schedules). Checked here, without credentials: Ray's own JSON
schema (`ray/autoscaler/ray-schema.json`), then what it cannot express (the head type is
defined, worker bounds agree, node resources are true integers). Ray's private
`prepare_config` is not used: an upgrade could change it silently. Every problem is a
ConfigError naming the JSON path (`$.a.b`).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from operator import attrgetter
from pathlib import Path
from typing import Any

import yaml

from rayfl.errors import ConfigError, suggest
from rayfl.yamlfile import yaml_load

_IDENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")

# Provider types Ray's launcher understands (its table of them is private to Ray).
PROVIDER_TYPES = ("aliyun", "aws", "azure", "external", "gcp", "kuberay", "local", "readonly",
                  "spark", "vsphere")  # fmt: skip


def json_path(parts: Iterable[str | int]) -> str:
    """Keys and indices as a JSON path, e.g. `$.a["x.y"][0]` (a key that is not an identifier,
    such as the node type `ray.head.cpu`, is quoted)."""
    out = "$"
    for part in parts:
        if isinstance(part, int):
            out += f"[{part}]"
        elif _IDENT.match(part):
            out += f".{part}"
        else:
            out += f"[{json.dumps(part)}]"
    return out


def ray_schema_path() -> Path:
    """The cluster launcher JSON schema shipped with the installed Ray."""
    import ray.autoscaler

    return Path(ray.autoscaler.__file__).parent / "ray-schema.json"


def _schema_error_message(error: Any) -> str:
    """Turn a jsonschema ValidationError into 'path: problem (hint)'."""
    parts: list[str | int] = list(error.absolute_path)
    if error.validator == "additionalProperties" and isinstance(error.instance, dict):
        allowed = set(error.schema.get("properties", {}))
        patterns = [re.compile(p) for p in error.schema.get("patternProperties", {})]
        extra = sorted(
            k for k in error.instance if k not in allowed and not any(p.search(k) for p in patterns)
        )
        if extra:
            key = extra[0]
            return (
                f"{json_path([*parts, key])}: unknown key{suggest(key, allowed)}; remove or fix it"
            )
    if error.validator == "required":
        missing = [k for k in error.validator_value if k not in error.instance]
        if missing:
            return f"{json_path([*parts, missing[0]])}: required key is missing"
    if (
        error.validator == "type"
        and error.validator_value == "integer"
        and "resources" in parts[:-1]
    ):
        return _not_whole(parts, error.instance)
    return f"{json_path(parts)}: {error.message}"


def _not_whole(parts: list[str | int], value: Any) -> str:
    return (
        f"{json_path(parts)}: node resources must be non-negative integers, got {value!r} "
        "(give actors fractional shares instead, e.g. num_gpus=0.25)"
    )


def _check_schema(config: dict[str, Any]) -> None:
    import jsonschema

    path = ray_schema_path()
    if not path.is_file():
        raise ConfigError(f"Ray's schema {path} is missing; reinstall ray[default]")
    schema = json.loads(path.read_text())
    validator = jsonschema.validators.validator_for(schema)(schema)
    errors = sorted(validator.iter_errors(config), key=lambda e: [str(p) for p in e.path])
    if not errors:
        return
    more = f" (+{len(errors) - 1} more problems)" if len(errors) > 1 else ""
    raise ConfigError(f"{_schema_error_message(errors[0])}{more}")


def _check_resources(node_types: dict[str, Any]) -> None:
    for name, node_type in node_types.items():
        resources = node_type.get("resources", {}) or {}
        for key, value in resources.items():
            # bool is an int subclass and 1.0 passes the schema's "integer": Ray needs ints.
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ConfigError(
                    _not_whole(["available_node_types", name, "resources", key], value)
                )


def _check_node_types(config: dict[str, Any]) -> None:
    node_types = config.get("available_node_types")
    if node_types is None:
        return  # Ray fills in the provider's default head and worker types.
    if not node_types:
        raise ConfigError("$.available_node_types: is empty; define a head node type")
    head = config.get("head_node_type")
    if head is None:
        raise ConfigError(
            "$.head_node_type: required when available_node_types is set; "
            f"name one of {sorted(node_types)}"
        )
    if head not in node_types:
        raise ConfigError(
            f"$.head_node_type: {head!r} is not defined in "
            f"available_node_types{suggest(head, node_types)}; choose one of {sorted(node_types)}"
        )
    _check_resources(node_types)
    total_min = 0
    for name, node_type in node_types.items():
        lo, hi = node_type.get("min_workers", 0), node_type.get("max_workers")
        if hi is not None and lo > hi:
            path = json_path(["available_node_types", name, "min_workers"])
            raise ConfigError(f"{path}: min_workers={lo} exceeds max_workers={hi}")
        total_min += lo
    cluster_max = config.get("max_workers")
    if cluster_max is not None and total_min > cluster_max:
        raise ConfigError(
            f"$.max_workers: {cluster_max} is below the sum of the node "
            f"types' min_workers ({total_min}); raise max_workers or lower min_workers"
        )


def _check_docker(config: dict[str, Any]) -> None:
    """`ray up` refuses a docker section without both an image and a container name."""
    docker = config.get("docker")
    if not docker:
        return
    has_image = docker.get("image") or docker.get("head_image") or docker.get("worker_image")
    if has_image and not docker.get("container_name"):
        raise ConfigError(
            "$.docker.container_name: required beside docker.image (Ray needs a container & "
            "image name); add container_name or remove the docker section"
        )


def _check_provider(config: dict[str, Any]) -> None:
    kind = config["provider"]["type"]
    if kind not in PROVIDER_TYPES:
        raise ConfigError(
            f"$.provider.type: unsupported provider {kind!r}"
            f"{suggest(kind, PROVIDER_TYPES)}; choose one of {list(PROVIDER_TYPES)}"
        )


def is_cluster_file(raw: Any) -> bool:
    """True when a loaded YAML mapping is a Ray cluster launcher config, not a rayfl file: it
    has `provider` or `cluster_name` and none of a run's sections (`algorithm`, `data`)."""
    return (
        isinstance(raw, dict)
        and any(k in raw for k in ("provider", "cluster_name"))
        and not any(k in raw for k in ("algorithm", "data", "suite", "sweep", "bench"))
    )


def describe_cluster(config: dict[str, Any]) -> str:
    """One line about a validated cluster config: name, provider, head and worker node types."""
    node_types = config.get("available_node_types") or {}
    head = config.get("head_node_type", "?")
    workers = [
        f"{name} ({spec.get('min_workers', 0)}-{spec.get('max_workers', 0)})"
        for name, spec in node_types.items()
        if name != head and isinstance(spec, dict)
    ]
    provider = (config.get("provider") or {}).get("type", "?")
    return (
        f"Ray cluster {config.get('cluster_name', '?')!r} on {provider}: head {head}, "
        f"workers {', '.join(workers) or 'none'}"
    )


# Ray's default for a launcher file without a top-level `max_workers`.
RAY_DEFAULT_MAX_WORKERS = 2


@dataclass(frozen=True)
class NodeType:
    """A node type: how many nodes of it the cluster may have (the head: one), their CPUs, GPUs."""

    name: str
    count: int
    cpus: float
    gpus: float


@dataclass(frozen=True)
class ClusterSize:
    """What a cluster launcher file offers at its maximum size (each worker type at its
    `max_workers`, all at most the file's), head first. A CPU or GPU count a node type does not
    declare is counted as 0 and listed in `undeclared`: rayfl does not guess a cloud size."""

    path: str
    head: str
    nodes: tuple[NodeType, ...]
    max_workers: int
    undeclared: tuple[str, ...] = ()

    def total(self) -> dict[str, float]:
        """CPUs and GPUs at the maximum size; under a file-wide `max_workers` cap each resource
        counts the nodes richest in it first: an upper bound, so no feasible run is refused."""
        head = [n for n in self.nodes if n.name == self.head]
        workers = [n for n in self.nodes if n.name != self.head]
        total: dict[str, float] = {}
        for key, amount in (("CPU", attrgetter("cpus")), ("GPU", attrgetter("gpus"))):
            value, room = sum(amount(n) for n in head), self.max_workers
            for n in sorted(workers, key=amount, reverse=True):  # stable: file order on ties
                take = min(n.count, room)
                value, room = value + take * amount(n), room - take
            total[key] = value
        return total

    def describe(self) -> str:
        """`1 x ray.head.cpu (8 CPU, 0 GPU) + 8 x ray.worker.gpu (4 CPU, 1 GPU)`; the undeclared."""
        parts = [f"{n.count} x {n.name} ({n.cpus:g} CPU, {n.gpus:g} GPU)" for n in self.nodes]
        text = " + ".join(parts)
        if self.undeclared:
            text += (
                "; counted as 0 since its resources do not declare them: "
                f"{', '.join(self.undeclared)}"
            )
        return text


def cluster_size(config: Mapping[str, Any], path: str | Path) -> ClusterSize:
    """The `ClusterSize` of a validated cluster file; a ConfigError when it relies on the
    provider's default node types, whose sizes are unknown offline."""
    node_types = config.get("available_node_types")
    if not node_types:
        raise ConfigError(
            f"cluster config {path}: has no available_node_types, so its node sizes are unknown "
            "offline; define the head and worker node types with their resources"
        )
    cap = config.get("max_workers", RAY_DEFAULT_MAX_WORKERS)
    head = config["head_node_type"]
    nodes: list[NodeType] = []
    undeclared: list[str] = []
    for name in [head, *(n for n in node_types if n != head)]:
        spec = node_types[name] or {}
        resources = spec.get("resources") or {}
        missing = [key for key in ("CPU", "GPU") if key not in resources]
        if missing:  # the launcher would look them up in the cloud: rayfl does not guess
            undeclared.append(f"{'/'.join(missing)} of {name}")
        count = 1 if name == head else min(int(spec.get("max_workers", cap)), cap)
        nodes.append(
            NodeType(name, count, float(resources.get("CPU", 0)), float(resources.get("GPU", 0)))
        )
    return ClusterSize(str(path), head, tuple(nodes), int(cap), tuple(undeclared))


def join_error(address: str, exc: BaseException, env: Mapping[str, str]) -> str:
    """The one line for a driver that could not join `engine.address` (pure, so tested without
    a cluster). A head with token authentication gives a driver without `RAY_AUTH_MODE=token`
    only a ConnectionError after `InvalidAuthToken` warnings, and one with the mode but no
    token an AuthenticationError; `auto` reads the local token, so only an explicit address
    gets the token hint."""
    detail = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    where = f"engine.address={address!r}"
    token = (
        "RAY_AUTH_TOKEN=<the output of `ray get-auth-token` on the head> (or copy the head's "
        "~/.ray/auth_token to this machine)"
    )
    if type(exc).__name__ == "AuthenticationError":
        return f"could not join the Ray cluster at {where}: its token is missing here; set {token}"
    explicit = address.strip().lower() not in ("", "auto", "local")
    if explicit and env.get("RAY_AUTH_MODE", "").lower() != "token":
        return (
            f"could not join the Ray cluster at {where} ({detail}); if the warnings above say "
            f"InvalidAuthToken, the head uses token authentication: export RAY_AUTH_MODE=token "
            f"and {token}; otherwise check that the head runs (`ray start --head`) and the address"
        )
    return (
        f"could not reach the Ray cluster at {where} ({detail}); start one with "
        "`ray start --head`, check the address, or drop engine.address to run a local Ray"
    )


def validate_cluster_config(path: str | Path) -> dict[str, Any]:
    """The cluster launcher file at `path`, checked offline (a ConfigError names the file and
    the JSON path of the first problem); `ray up` merges the provider's defaults later."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"cluster config: {path} does not exist; pass the path of cluster.yaml")
    try:
        config = yaml_load(path.read_text())
    except (yaml.YAMLError, OSError, UnicodeDecodeError) as exc:
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise ConfigError(f"cluster config: {path} is not valid YAML: {first}") from None
    if not isinstance(config, dict):
        raise ConfigError(f"cluster config {path}: $: expected a mapping at the top level")
    try:
        _check_schema(config)
        _check_provider(config)
        _check_node_types(config)
        _check_docker(config)
        return config
    except ConfigError as exc:  # the file named: several configs can share one log
        raise ConfigError(f"cluster config {path}: {exc}") from exc.__cause__
