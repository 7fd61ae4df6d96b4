"""cuBLAS's workspaces in the simulated peak (sim/workspace.py): two per GPU that runs a
matmul (the forward's thread and autograd's), 32 MiB each on H100 / H200, 8.125 MiB on
other GPUs, none on CPUs or on a GPU of convolutions only."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from autoplace.capture import capture
from autoplace.cluster import preset
from autoplace.plan import ParallelConfig, Plan
from autoplace.sim import simulate, simulate_batch

MIB = 2**20


class ConvThenLinear(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.fc = nn.Linear(8 * 8 * 8, 10)

    def forward(self, x):
        return self.fc(torch.relu(self.conv(x)).flatten(1))


@pytest.fixture(scope="module")
def graph():
    return capture(ConvThenLinear(), (torch.randn(4, 3, 8, 8),), name="conv-linear")


def split(graph, fc_device: int, **parallel) -> Plan:
    """The convolution on device 0, the Linear (and what follows) on ``fc_device``."""
    names = [op.name for op in graph]
    at = names.index("fc")
    return Plan.from_groups(graph, {n: int(i >= at) for i, n in enumerate(names)},
                            [0, fc_device], parallel=ParallelConfig(**parallel))


def parts(b: dict) -> int:
    return sum(int(b[k]) for k in ("params", "grads", "optimizer", "activations", "transient"))


@pytest.mark.parametrize("kind, each", [("h200", 32 * MIB), ("a100", 8.125 * MIB)])
def test_a_gpu_running_a_matmul_holds_two_workspaces(graph, kind, each):
    cluster = preset(f"{kind}x2")
    res = simulate(graph, split(graph, 1), cluster)
    conv, fc = res.memory_breakdown
    assert "workspace" not in conv  # convolutions only: cuDNN's, no cuBLAS handle
    assert res.peak_memory_bytes[0] == pytest.approx(parts(conv), abs=1)
    assert fc["workspace"] == 2 * each
    assert res.peak_memory_bytes[1] == pytest.approx(parts(fc) + 2 * each, abs=1)
    # one device for both: one pair of workspaces
    one = simulate(graph, split(graph, 0), cluster)
    assert one.memory_breakdown[0]["workspace"] == 2 * each and one.peak_memory_bytes[1] == 0


def test_every_replica_holds_them_and_cpus_none(graph):
    res = simulate(graph, split(graph, 0, data=2), preset("h200x2"))
    assert [b["workspace"] for b in res.memory_breakdown] == [64 * MIB, 64 * MIB]
    cpu = simulate(graph, split(graph, 1), preset("cpu-x2"))
    assert all("workspace" not in b for b in cpu.memory_breakdown)


def test_batch_equals_one_by_one(graph):
    cluster = preset("h200x2")
    plans = [split(graph, 1), split(graph, 0), split(graph, 0, data=2)]
    batch = simulate_batch(graph, plans, cluster)
    for i, p in enumerate(plans):
        assert list(batch.peak_memory_bytes[i]) == simulate(graph, p, cluster).peak_memory_bytes
