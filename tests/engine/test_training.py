"""The minibatch loop: gradient clipping per trained module, learning rates per module."""

import subprocess
import sys

import numpy as np
import pytest
import torch
from torch import nn

from rayfl.algorithms.base import TrainConfig
from rayfl.config import build_config
from rayfl.data.datasets import load_dataset
from rayfl.engine.loop import Simulation
from rayfl.engine.training import LocalTrainer, per_module


def test_per_module_groups_parameters_by_owner():
    a, b = nn.Linear(2, 2), nn.Linear(2, 1)
    loose = nn.Parameter(torch.zeros(1))
    groups = per_module([*a.parameters(), loose, *b.parameters()], [a, b])
    assert [len(g) for g in groups] == [2, 2, 1]
    assert groups[2][0] is loose


def trainer(clip):
    ds = load_dataset("synthetic", num_samples=40, num_test=10, shape=(1, 2, 2), num_classes=2)
    settings = TrainConfig(batch_size=40, lr=1.0, momentum=0.0, grad_clip=clip)
    return LocalTrainer(
        ds,
        np.arange(40),
        np.arange(40, 50),
        settings,
        torch.device("cpu"),
        torch.Generator().manual_seed(0),
    )


def test_each_module_is_clipped_on_its_own():
    # Golden: two scalar "models" with gradients 3 and 4. One clip over both (norm 5) would
    # scale both by 1/5; per module each is clipped to norm 1 on its own.
    a, b = nn.Linear(1, 1, bias=False), nn.Linear(1, 1, bias=False)
    for m in (a, b):
        nn.init.zeros_(m.weight)

    def step(x, y):
        return 3.0 * a.weight.sum() + 4.0 * b.weight.sum()

    trainer(clip=1.0).run(step, [a, b], epochs=1)
    # clip_grad_norm_ scales by max_norm / (norm + 1e-6)
    assert a.weight.item() == pytest.approx(-1.0) and b.weight.item() == pytest.approx(-1.0)


def test_module_lrs_give_a_module_its_own_step():
    a, b = nn.Linear(1, 1, bias=False), nn.Linear(1, 1, bias=False)
    for m in (a, b):
        nn.init.zeros_(m.weight)

    def step(x, y):
        return a.weight.sum() + b.weight.sum()

    trainer(clip=None).run(step, [a, b], epochs=1, module_lrs=[None, 0.25])
    assert a.weight.item() == -1.0 and b.weight.item() == -0.25


def local_weights(raw, overrides, run_dir):
    sim = Simulation(build_config(raw, overrides), run_dir)
    sim.run()
    states = dict(sim.executor.client_states(range(6)))
    return {c: {k: v for k, v in s.items() if k.startswith("model.")} for c, s in states.items()}


def test_pfedes_beta0_equals_local_bit_for_bit_with_grad_clip(synthetic_raw, tmp_path):
    # The local model learns by CE only (the proxy's KD target is detached), so with the
    # gradient clipped per module, pFedES's local models are exactly Local's.
    common = ["train.grad_clip=0.05", "engine.rounds=2"]
    pfedes = local_weights(synthetic_raw, [*common, "algorithm.beta=0"], tmp_path)
    local = local_weights(synthetic_raw, [*common, "algorithm.name=local"], tmp_path)
    assert pfedes.keys() == local.keys() and len(local) == 6
    for c in local:
        for k in local[c]:
            np.testing.assert_array_equal(pfedes[c][k], local[c][k])


_FAULTS = """
import resource, sys, torch
from rayfl.engine.spec import keep_tensor_memory
if sys.argv[1] == "keep":
    assert keep_tensor_memory()
for _ in range(3):  # settled
    torch.ones(10 * 2**20)  # 40 MB: above glibc's largest dynamic mmap threshold (32 MB)
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(10):
    torch.ones(10 * 2**20)
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


@pytest.mark.slow
@pytest.mark.skipif(sys.platform != "linux", reason="glibc's malloc")
def test_keep_tensor_memory_reuses_freed_tensor_memory_instead_of_faulting_it_in_again():
    """Large evaluation batches in a Ray actor: without it every batch maps and faults in
    fresh pages (10 x 40 MB: ~100k page faults of 4 kB); with it the freed memory is reused."""

    def faults(mode):
        out = subprocess.run([sys.executable, "-c", _FAULTS, mode], capture_output=True, text=True)
        assert out.returncode == 0, out.stderr
        return int(out.stdout)

    assert faults("stock") > 50_000
    assert faults("keep") < 1_000
