"""Chaos: a run whose driver (`rayfl run`, then `rayfl run --resume`), workers and server actor are
SIGKILLed at random points, including inside checkpoint writes, ends with the numbers of an
undisturbed run.

The quick test (in the default run, not in the fast loop) kills a serial driver twice; the long
one (`-m experiment`) runs the Ray executor and kills drivers, workers and the server actor at
random until the run finishes.
"""

from __future__ import annotations

import contextlib
import os
import random
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import psutil
import pyarrow.parquet as pq
import pytest
import yaml

from rayfl.config import build_config
from rayfl.engine.loop import Simulation
from tests.conftest import SYNTHETIC

ROOT = Path(__file__).resolve().parents[2]


def comparable(rows):
    return [{k: v for k, v in r.items() if not k.startswith("time/")} for r in rows]


def undisturbed(overrides, run_dir):
    cfg = build_config(SYNTHETIC, [*overrides, "engine.executor=serial"])
    return comparable(Simulation(cfg, run_dir).run().history)


@dataclass
class Chaos:
    """Drives one run directory to the end through random SIGKILLs; counts what it killed."""

    config: Path
    out: Path
    rng: random.Random
    kills: dict[str, int] = field(
        default_factory=lambda: {"driver": 0, "driver_in_write": 0, "worker": 0, "server": 0}
    )
    launches: int = 0
    family: dict[int, psutil.Process] = field(default_factory=dict)
    log: Path = Path("/dev/null")

    def start(self, kill_at_write: int = 0) -> subprocess.Popen:
        resume = os.path.islink(self.out / "checkpoint")
        args = ["run", "--resume", str(self.out)] if resume else ["run", str(self.config)]
        if not resume:
            args += ["--out", str(self.out)]
        env = dict(os.environ, PYTHONPATH=str(ROOT), RAYFL_CHAOS_KILL_AT_WRITE=str(kill_at_write))
        self.launches += 1
        # a file, not a pipe: nobody reads a pipe while the driver runs, and a full one blocks it
        self.log = self.out.parent / f"driver-{self.launches}.log"
        with open(self.log, "w") as log:
            return subprocess.Popen(
                [sys.executable, "-m", "tests.engine.chaos_driver", *args, "--no-progress"],
                cwd=ROOT,
                env=env,
                stdout=subprocess.DEVNULL,
                stderr=log,
                start_new_session=True,
            )

    def actors(self, driver: subprocess.Popen, name: str) -> list[psutil.Process]:
        found = []
        try:
            for p in psutil.Process(driver.pid).children(recursive=True):
                try:
                    if name in " ".join(p.cmdline()):
                        found.append(p)
                except psutil.Error:
                    pass
        except psutil.Error:
            pass
        return found

    def watch(self, driver: subprocess.Popen) -> None:
        """Remember every process the driver started (Ray's raylet, GCS, agents, workers)."""
        try:
            for p in psutil.Process(driver.pid).children(recursive=True):
                self.family.setdefault(p.pid, p)
        except psutil.Error:
            pass

    def reap(self) -> None:
        """End what a driver started that outlived it (by pid: a killed machine loses them too)."""
        for p in self.family.values():
            with contextlib.suppress(psutil.Error):
                p.kill()
        self.family.clear()

    def finish(self, driver: subprocess.Popen) -> tuple[int, str]:
        """Wait for the driver, then end whatever it started."""
        self.watch(driver)
        driver.wait(timeout=900)
        self.reap()
        return driver.returncode, self.log.read_text()

    def kill_driver(self, driver: subprocess.Popen) -> None:
        self.watch(driver)
        driver.send_signal(signal.SIGKILL)
        driver.wait()

    def progress(self) -> int:
        """The round of the current checkpoint (0 before the first)."""
        try:
            name = os.readlink(self.out / "checkpoint")
        except OSError:
            return 0
        return int(name.split(".r", 1)[1].split("-", 1)[0])

    def run(self, max_launches: int, driver_kills: int, actor_kills: bool) -> None:
        """Launch, kill at random, relaunch with --resume, until a launch finishes cleanly.

        Kills are paced by the run's progress, not by the clock, so that a loaded machine
        (where Ray and every restarted actor take long to start) sees the same chaos as an idle
        one: a planned driver kill waits until this launch checkpointed a round of its own, and
        an actor is killed only once a round was checkpointed since the previous actor kill
        (the restarted actor has started and worked)."""
        for _ in range(max_launches):
            in_write = 0
            planned = self.launches < driver_kills
            if planned and self.rng.random() < 0.5:
                in_write = self.rng.randint(1, 9)  # some file of some checkpoint
            start_round = self.progress()
            actor_gate = start_round
            driver = self.start(in_write)
            while driver.poll() is None:
                time.sleep(0.2)
                self.watch(driver)
                now = self.progress()
                if actor_kills and now > actor_gate and self.rng.random() < 0.3:
                    kind = self.rng.choice(["worker", "server"])
                    name = "ClientWorker" if kind == "worker" else "ServerActor"
                    victims = self.actors(driver, name)
                    if victims:
                        self.rng.choice(victims).kill()
                        self.kills[kind] += 1
                        actor_gate = now
                if planned and not in_write and now > start_round and self.rng.random() < 0.3:
                    self.kill_driver(driver)
                    self.kills["driver"] += 1
                    break
            code, err = self.finish(driver)
            if code == -signal.SIGKILL and in_write:
                self.kills["driver_in_write"] += 1
                continue
            if code == -signal.SIGKILL:
                continue
            assert code == 0, err[-3000:]
            return
        raise AssertionError(f"no clean finish in {max_launches} launches: {self.kills}")


def write_config(tmp_path: Path, overrides: dict) -> Path:
    raw = yaml.safe_load(yaml.safe_dump(SYNTHETIC))
    for section, values in overrides.items():
        raw[section].update(values)
    path = tmp_path / "chaos.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


@pytest.mark.slow
def test_quick_chaos_driver_killed_inside_a_checkpoint_write(tmp_path):
    engine = {"rounds": 2, "executor": "serial", "checkpoint_every": 1}
    config = write_config(tmp_path, {"engine": engine})
    chaos = Chaos(config, tmp_path / "run", random.Random(8))
    # round 1's checkpoint has 9 files (6 clients, server, history, manifest): the driver dies
    # halfway through the 2nd file of round 2's
    first = chaos.start(kill_at_write=9 + 2)
    assert chaos.finish(first)[0] == -signal.SIGKILL
    assert os.path.islink(tmp_path / "run" / "checkpoint")
    second = chaos.start()  # --resume
    code, err = chaos.finish(second)
    assert code == 0, err[-3000:]
    got = comparable(pq.read_table(tmp_path / "run" / "metrics.parquet").to_pylist())
    assert got == undisturbed(["engine.rounds=2"], tmp_path / "undisturbed")


@pytest.mark.experiment
def test_chaos_random_kills_of_drivers_workers_and_the_server(tmp_path):
    rounds = 6
    engine = {
        "rounds": rounds,
        "executor": "ray",
        "num_workers": 2,
        "ray_num_cpus": 2,
        "clients_per_call": 1,
        "checkpoint_every": 1,
        "max_retries": 1000,
        "server_in": "actor",  # a server actor to kill (by default the server runs in the driver)
    }
    config = write_config(tmp_path, {"engine": engine})
    seed = int(os.environ.get("RAYFL_CHAOS_SEED", "0"))
    chaos = Chaos(config, tmp_path / "run", random.Random(seed))
    chaos.run(max_launches=30, driver_kills=6, actor_kills=True)
    got = comparable(pq.read_table(tmp_path / "run" / "metrics.parquet").to_pylist())
    report = f"chaos seed {seed}: {chaos.launches} launches, kills {chaos.kills}"
    print(report)
    (tmp_path.parent / "chaos_report.txt").write_text(report + "\n")
    assert sum(chaos.kills.values()) >= 1, report
    assert got == undisturbed([f"engine.rounds={rounds}"], tmp_path / "undisturbed")
