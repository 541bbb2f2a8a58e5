"""Simulated devices: tiers, availability, dropout, the virtual clock and per-architecture pools."""

import pytest

from rayfl.config import build_config
from rayfl.engine.callbacks import Callback
from rayfl.engine.devices import Devices, assign_tiers, forward_flops
from rayfl.engine.loop import Simulation, prepare_federation
from rayfl.errors import ConfigError
from rayfl.models.families import family_from_config

# Forward FLOPs of one 1x8x8 sample with 10 classes, by hand (a linear layer n -> m: 2 n m):
FLOPS_A = 2 * 64 * 16 + 2 * 16 * 10  # tiny_a: 64 -> 16, head 16 -> 10
FLOPS_B = 2 * 64 * 32 + 2 * 32 * 16 + 2 * 16 * 10  # tiny_b: 64 -> 32 -> 16, head 16 -> 10

# 1 kFLOP/s for a speed-1 device: tiny_a clients on "fast" (speed 1), tiny_b on "slow" (0.25)
TIERS = [
    "devices.tiers=[{name: fast, speed: 1.0}, {name: slow, speed: 0.25}]",
    "devices.by_arch={tiny_a: fast, tiny_b: slow}",
    "devices.reference_gflops=1e-6",
]


def hand_seconds(cfg, federation, archs):
    """Each client's simulated seconds: 3 forward passes per sample and epoch / its speed."""
    per_sample = {"tiny_a": FLOPS_A, "tiny_b": FLOPS_B}
    speed = {"tiny_a": 1.0, "tiny_b": 0.25}
    epochs = cfg.train.local_epochs
    return [
        3 * per_sample[a] * len(c.train) * epochs / (speed[a] * 1000.0)
        for a, c in zip(archs, federation.clients)
    ]


def setting(raw, overrides):
    cfg = build_config(raw, [*TIERS, *overrides])
    archs = family_from_config(cfg.model.family).assign(cfg.data.num_clients)
    return cfg, archs, prepare_federation(cfg)


def test_flops_are_counted_not_timed():
    assert forward_flops("tiny_a", (1, 8, 8), 10) == FLOPS_A
    assert forward_flops("tiny_b", (1, 8, 8), 10) == FLOPS_B


def test_a_deadline_drops_exactly_the_clients_slower_than_it(synthetic_raw, tmp_path):
    cfg, archs, fed = setting(synthetic_raw, [])
    seconds = hand_seconds(cfg, fed, archs)
    deadline = sorted(seconds)[len(seconds) // 2]  # about half are stragglers
    over = [*TIERS, "devices.policy=deadline", f"devices.deadline_s={deadline}"]

    class Record(Callback):
        rows: list = []

        def on_round_end(self, sim, round_idx, metrics):
            Record.rows.append((list(sim.last_clients), dict(metrics)))

    result = Simulation(build_config(synthetic_raw, over), tmp_path, [Record()]).run()
    on_time = sorted(c for c, s in enumerate(seconds) if s <= deadline)
    late = sorted(c for c, s in enumerate(seconds) if s > deadline)
    assert late and on_time  # the setting splits the federation
    for clients, row in Record.rows:  # fraction 1: every client is sampled every round
        assert sorted(clients) == on_time
        assert row["devices/stragglers"] == len(late)
        assert row["devices/participants"] == len(on_time)
        assert row["time/virtual_round_s"] == deadline  # the server waited until the deadline
    assert result.final["time/virtual_s"] == pytest.approx(deadline * cfg.engine.rounds)


def test_wait_for_all_and_first_k_follow_the_hand_computed_times(synthetic_raw):
    cfg, archs, fed = setting(synthetic_raw, [])
    seconds = hand_seconds(cfg, fed, archs)
    sizes = dict.fromkeys(["tiny_a", "tiny_b"], 0.0)
    clients = list(range(cfg.data.num_clients))
    shape = fed.dataset.in_shape
    devices = Devices(cfg, archs, [len(c.train) for c in fed.clients], shape, 10)
    plan = devices.plan(1, clients, sizes)
    assert plan.participants == clients and plan.round_s == pytest.approx(max(seconds))
    assert [plan.times[c] for c in clients] == pytest.approx(seconds)
    cfg_k = build_config(synthetic_raw, [*TIERS, "devices.policy=first_k", "devices.first_k=2"])
    devices = Devices(cfg_k, archs, [len(c.train) for c in fed.clients], shape, 10)
    plan = devices.plan(1, clients, sizes)
    fastest = sorted(clients, key=lambda c: (seconds[c], c))[:2]
    assert plan.participants == sorted(fastest)
    assert plan.round_s == pytest.approx(max(seconds[c] for c in fastest))


def test_bandwidth_adds_the_payload_down_and_up(synthetic_raw):
    cfg = build_config(
        synthetic_raw,
        [
            "devices.tiers=[{name: t, speed: 1.0, bandwidth_mbps: 8}]",
            "devices.reference_gflops=1e-6",
        ],
    )
    archs = family_from_config(cfg.model.family).assign(cfg.data.num_clients)
    fed = prepare_federation(cfg)
    devices = Devices(cfg, archs, [len(c.train) for c in fed.clients], fed.dataset.in_shape, 10)
    compute = devices.seconds(0, 0.0)
    # 1 MB down and 1 MB up at 8 Mbit/s: 2 s
    assert devices.seconds(0, 1e6) == pytest.approx(compute + 2.0)


def test_availability_and_dropout_are_seeded_and_traces_are_followed(synthetic_raw):
    over = [
        "devices.tiers=[{name: a, availability: 0.5, dropout: 0.5}, {name: b, trace: [1, 0]}]",
        "devices.by_arch={tiny_a: a, tiny_b: b}",
    ]
    cfg = build_config(synthetic_raw, over)
    archs = family_from_config(cfg.model.family).assign(cfg.data.num_clients)
    fed = prepare_federation(cfg)
    sizes = dict.fromkeys(["tiny_a", "tiny_b"], 0.0)
    make = lambda: Devices(cfg, archs, [len(c.train) for c in fed.clients], (1, 8, 8), 10)  # noqa: E731
    clients = list(range(cfg.data.num_clients))
    first = [make().plan(r, clients, sizes) for r in range(1, 21)]
    again = [make().plan(r, clients, sizes) for r in range(1, 21)]
    assert [p.participants for p in first] == [p.participants for p in again]
    b_clients = [c for c in clients if archs[c] == "tiny_b"]
    for r, plan in enumerate(first, start=1):
        away = set(plan.unavailable)
        assert all((c in away) == (r % 2 == 0) for c in b_clients)  # trace [1, 0]
    a_clients = [c for c in clients if archs[c] == "tiny_a"]
    missed = sum(c in p.unavailable for p in first for c in a_clients)
    dropped = sum(c in p.dropped_out for p in first for c in a_clients)
    assert 0 < missed < 20 * len(a_clients) and dropped > 0


def test_tiers_drawn_with_proportions_are_seeded_and_sized():
    from rayfl.config import DevicesConfig, TierConfig

    d = DevicesConfig(tiers=(TierConfig("x"), TierConfig("y")), proportions=(0.25, 0.75))
    tiers = assign_tiers(d, 3, ["m"] * 8)
    assert tiers.count("x") == 2 and tiers.count("y") == 6
    assert tiers == assign_tiers(d, 3, ["m"] * 8)
    assert tiers != assign_tiers(d, 4, ["m"] * 8) or tiers != assign_tiers(d, 5, ["m"] * 8)


@pytest.mark.parametrize(
    "override, message",
    [
        ("devices.by_arch={tiny_a: nope}", "not a tier"),
        ("devices.policy=deadline", "deadline_s"),
        ("devices.tiers=[{name: a, speed: 0}]", "speed"),
        ("devices.tiers=[{name: a, trace: [2]}]", "trace"),
    ],
)
def test_bad_device_settings_are_one_line(synthetic_raw, override, message):
    base = ["devices.tiers=[{name: a}]"] if not override.startswith("devices.tiers") else []
    with pytest.raises(ConfigError, match=message):
        build_config(synthetic_raw, [*base, override])


def test_measured_times_need_the_wait_for_all_policy(synthetic_raw):
    with pytest.raises(ConfigError, match="devices.work"):
        build_config(
            synthetic_raw,
            [*TIERS, "devices.work=measured", "devices.policy=first_k", "devices.first_k=1"],
        )


def test_architecture_names_must_be_the_runs(synthetic_raw, tmp_path):
    cfg = build_config(synthetic_raw, ["engine.resources_by_arch={cnn_small: {num_cpus: 1}}"])
    with pytest.raises(ConfigError, match="resources_by_arch.cnn_small"):
        Simulation(cfg, tmp_path)
    cfg = build_config(synthetic_raw, ["devices.tiers=[{name: a}]", "devices.by_arch={tiny_a: a}"])
    with pytest.raises(ConfigError, match="gives no tier to tiny_b"):
        Simulation(cfg, tmp_path)


class Placement(Callback):
    """Each client's worker and the workers' reservations, read before the run closes them."""

    def __init__(self, rounds):
        self.rounds, self.info, self.placements = rounds, [], {}

    def on_round_end(self, sim, round_idx, metrics):
        if round_idx == self.rounds:
            self.info = sim.executor.worker_info()
            self.placements = dict(sim.executor.placements)


@pytest.mark.ray
def test_pools_per_architecture_place_clients_and_match_serial(synthetic_raw, ray_local, tmp_path):
    cfg, archs, fed = setting(synthetic_raw, [])
    deadline = sorted(hand_seconds(cfg, fed, archs))[-2]  # one straggler or more
    devices = [*TIERS, "devices.policy=deadline", f"devices.deadline_s={deadline}"]
    pools = [
        "engine.executor=ray",
        "engine.resources_by_arch={tiny_a: {num_cpus: 0.5, num_gpus: 0.5}, "
        "tiny_b: {num_cpus: 0.5}}",
        "engine.clients_per_call=1",
    ]
    serial = Simulation(build_config(synthetic_raw, devices), tmp_path / "s").run()
    cfg = build_config(synthetic_raw, [*devices, *pools])
    spy = Placement(cfg.engine.rounds)
    pooled = Simulation(cfg, tmp_path / "r", [spy]).run()
    assert spy.placements  # every trained client ran on a worker of its architecture's shape
    for client, worker in spy.placements.items():
        gpu = spy.info[worker]["resources"].get("GPU", 0.0)
        assert gpu == (0.5 if archs[client] == "tiny_a" else 0.0)
    assert {w["resources"]["CPU"] for w in spy.info} == {0.5}
    keep = [k for k in serial.final if not k.startswith("time/") or k == "time/virtual_s"]
    assert {k: pooled.final[k] for k in keep} == {k: serial.final[k] for k in keep}
