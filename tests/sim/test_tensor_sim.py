"""Tensor parallelism in the simulator: split ops' work and memory shared by the group,
the group's all-reduces priced on its links."""

from __future__ import annotations

from dataclasses import replace

import pytest

from autoplace import workloads
from autoplace.capture import capture_workload
from autoplace.cluster import preset
from autoplace.sim import simulate, simulate_batch
from autoplace.sim.model import ensure_costs
from autoplace.sim.tensor import tensor_collective_s, tensor_view
from tests.helpers.plans import single


@pytest.fixture(scope="module")
def wide():
    """A compute-bound GPT (d=4096, 32 heads, 2 blocks, seq 512), captured on meta, with
    estimated H200 costs (the tests read its ops' times before any simulation fills them,
    whichever of them runs first)."""
    wl = workloads.get("gpt-small", d_model=4096, n_heads=32, n_layers=2, seq_len=512,
                       vocab_size=1024, batch_size=8, device="meta")
    graph = capture_workload(wl)
    ensure_costs(graph, preset("h200x1"))
    return graph


def test_step_time_and_memory_fall_with_tensor_parallel_on_fast_links(wide):
    c = preset("h200x4")
    one = simulate(wide, single(wide), c)
    two = simulate(wide, single(wide, tensor=2), c)
    four = simulate(wide, single(wide, tensor=4), c)
    assert four.step_time_s < two.step_time_s < 0.8 * one.step_time_s
    assert max(four.peak_memory_bytes) < max(two.peak_memory_bytes) \
        < 0.8 * one.peak_memory_bytes[0]
    assert two.peak_memory_bytes[0] == two.peak_memory_bytes[1] > 0  # both ranks of the group
    assert two.peak_memory_bytes[2:] == [0, 0]
    batch = simulate_batch(wide, [single(wide), single(wide, tensor=2)], c)
    assert batch.step_time_s.tolist() == pytest.approx([one.step_time_s, two.step_time_s])


def test_slow_links_make_tensor_parallel_pay_its_all_reduces(wide):
    fast = preset("h200x2")
    n = fast.num_devices
    slow = replace(fast, bandwidth=tuple((1e8,) * n for _ in range(n)),
                   collective_bandwidth=1e8)
    view_fast, _, _ = tensor_view(wide, single(wide, tensor=2), fast)
    row = "blocks_0_mlp_proj"
    assert view_fast[row].param_bytes == wide[row].param_bytes // 2
    # the row's forward carries the group's all-reduce of its whole output on top of half
    # its compute
    kind = fast.devices[0].kind
    assert view_fast[row].fwd_time_s[kind] > wide[row].fwd_time_s[kind] / 2
    assert view_fast["head"].fwd_time_s[kind] == wide["head"].fwd_time_s[kind]  # not split
    assert simulate(wide, single(wide, tensor=2), slow).step_time_s > \
            simulate(wide, single(wide), slow).step_time_s


def test_sequence_parallel_shards_the_stream_and_swaps_its_collectives(wide):
    c = preset("h200x4")
    plain, sp = single(wide, tensor=2), single(wide, tensor=2, sequence_parallel=True)
    view, _, _ = tensor_view(wide, plain, c)
    view_sp, _, _ = tensor_view(wide, sp, c)
    kind = c.devices[0].kind
    norm, row, col = "blocks_0_ln1", "blocks_0_mlp_proj", "blocks_0_mlp_fc"
    # the norm runs on half the sequence, its parameters whole on every rank
    assert view_sp[norm].fwd_time_s[kind] == pytest.approx(wide[norm].fwd_time_s[kind] / 2)
    assert view_sp[norm].activation_bytes == wide[norm].activation_bytes // 2
    assert view_sp[norm].param_bytes == wide[norm].param_bytes == view[norm].param_bytes
    # a row reduce-scatters in forward and all-gathers its gradient in backward; the
    # unit's column all-gathers its input in forward (no forward collective without SP)
    out = wide[row].output_bytes
    rs = tensor_collective_s(c, sp, out, "reducescatter")
    ag = tensor_collective_s(c, sp, out, "allgather")
    assert 0 < rs < tensor_collective_s(c, sp, out, "allreduce")
    assert view_sp[row].fwd_time_s[kind] == pytest.approx(wide[row].fwd_time_s[kind] / 2 + rs)
    assert view_sp[row].bwd_time_s[kind] == pytest.approx(wide[row].bwd_time_s[kind] / 2 + ag)
    assert view_sp[row].output_bytes == out // 2 and view[row].output_bytes == out
    assert view_sp[col].fwd_time_s[kind] > view[col].fwd_time_s[kind]
    one, two = simulate(wide, plain, c), simulate(wide, sp, c)
    assert two.memory_breakdown[0]["activations"] < one.memory_breakdown[0]["activations"]
    assert two.peak_memory_bytes[0] < one.peak_memory_bytes[0]
    assert two.peak_memory_bytes[0] == two.peak_memory_bytes[1]
