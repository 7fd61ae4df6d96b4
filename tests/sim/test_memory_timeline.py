"""The step's memory timeline (``sim.memory``): gradients made by the backward after
``zero_grad(set_to_none=True)``, several microbatches' activations and loss tensors held
at once, DDP's gradients in its buckets; the scalar and the batched path agree."""

from __future__ import annotations

import numpy as np
import pytest

from autoplace.cluster import Cluster, Device
from autoplace.graph import OpGraph, OpNode
from autoplace.plan import ParallelConfig, Plan
from autoplace.sim import simulate, simulate_batch
from autoplace.sim.memory import timeline_peak

MiB = 2**20


def _cluster(n: int = 2) -> Cluster:
    dev = Device(name="cpu", kind="cpu", memory_bytes=64 * 2**30, peak_flops=50e9,
                 memory_bandwidth=10e9, launch_overhead_s=0.0)
    return Cluster.uniform(f"cpu-x{n}", dev, n, alpha_s=1e-5, bandwidth=5e9)


def _chain(n: int, param: int, act: int, logits: int = 0) -> OpGraph:
    """``n`` Linear ops; with ``logits`` > 0 the last one's bf16 output (``logits`` bytes)
    goes to an output op whose loss keeps a float32 copy of it (twice the bytes)."""
    nodes = [OpNode(name=f"op{i}", kind="Linear", module_path=f"blocks.{i}",
                    target=f"blocks.{i}", param_names=(f"blocks.{i}.weight",),
                    output_bytes=logits if logits and i == n - 1 else MiB, param_bytes=param,
                    activation_bytes=act, output_shapes=((logits // 2,),) if logits else (),
                    output_dtypes=("bfloat16",) if logits else (),
                    fwd_time_s={"cpu": 1e-3}, bwd_time_s={"cpu": 2e-3}) for i in range(n)]
    edges = [(f"op{i}", f"op{i + 1}", MiB) for i in range(n - 1)]
    if logits:
        nodes.append(OpNode(name="output", kind="output", workspace_bytes=3 * logits,
                            fwd_time_s={"cpu": 0.0}, bwd_time_s={"cpu": 0.0}))
        edges.append((f"op{n - 1}", "output", logits))
    return OpGraph("chain", nodes, edges)


def test_timeline_peak_adds_running_sums_per_device():
    """Device 0: +4 then +2 MiB of activations, then a backward freeing 2 (held during it)
    that makes 3 MiB of gradients with a 1 MiB transient: peak 4 + 2 + 3 + 1. Device 1's
    events interleave without touching device 0's sums."""
    dev = np.array([[0, 1, 0, 0, 1]])
    delta = np.array([[4, 5, 2, -2, -5]]) * MiB
    grad = np.array([[0, 0, 0, 3, 0]]) * MiB
    hold = np.array([[0, 0, 0, 2, 5]]) * MiB
    trans = np.array([[0, 0, 0, 1, 0]]) * MiB
    peak = timeline_peak(dev, delta.astype(float), grad.astype(float), hold.astype(float),
                         trans.astype(float), 2)
    assert list(peak.total) == [10 * MiB, 5 * MiB]
    assert (peak.activations[0], peak.grads[0], peak.transient[0]) == (6 * MiB, 3 * MiB, MiB)


def test_gradients_come_as_the_backward_frees_activations():
    """set_to_none gradients: a chain of big weights and small activations peaks at the end
    of its backward with every gradient and no activation; one of small weights and big
    activations at its first backward with every activation and one gradient. Never both
    whole, as summing the parts would say."""
    heavy = simulate(_chain(8, param=8 * MiB, act=MiB), Plan.single(_chain(8, 8 * MiB, MiB)),
                     _cluster(1)).memory_breakdown[0]
    assert heavy["grads"] == 64 * MiB and heavy["activations"] == pytest.approx(MiB)
    g = _chain(8, param=MiB, act=8 * MiB)
    light = simulate(g, Plan.single(g), _cluster(1)).memory_breakdown[0]
    assert light["grads"] == MiB and light["activations"] == 64 * MiB
    assert light["total"] < (1 + 1 + 2) * 8 * MiB + 64 * MiB + 8 * MiB


def test_two_microbatches_hold_both_losses_and_both_activations():
    """A two-device split with 2 microbatches: device 1's first backward (microbatch 1's
    last op) comes while microbatch 0 still holds its activations and the float32 copy of
    its logits its loss kept; the scalar and the batched path agree."""
    logits = 16 * MiB
    g = _chain(4, param=MiB, act=2 * MiB, logits=logits)
    split = {op.name: int(i >= 2) for i, op in enumerate(g)}
    one = Plan.from_assignment(g, split)
    two = Plan.from_assignment(g, split, parallel=ParallelConfig(microbatches=2))
    b1 = simulate(g, one, _cluster()).memory_breakdown[1]
    b2 = simulate(g, two, _cluster()).memory_breakdown[1]
    # both: every activation of the device (2 ops x 2 MiB) and the loss's 32 MiB kept
    assert b1["activations"] == b2["activations"] == (4 + 2 * logits // MiB) * MiB
    # the transient is the loss's backward: the gradients of what it kept and of its
    # float32 input (2 x 32 MiB), per microbatch
    assert b1["transient"] == 2 * 2 * logits
    assert b2["transient"] == 2 * 2 * logits / 2
    batch = simulate_batch(g, [one, two], _cluster()).peak_memory_bytes
    assert list(batch[1]) == simulate(g, two, _cluster()).peak_memory_bytes


def test_ddp_gradients_live_in_its_buckets():
    """DDP with gradient_as_bucket_view: the gradients are views of its buckets (made once:
    the executor keeps DDP from rebuilding them), held from the start, not made by the
    backward."""
    g = _chain(4, param=4 * MiB, act=MiB)
    ddp = Plan.single(g).with_parallel(data=2)
    b = simulate(g, ddp, _cluster()).memory_breakdown[0]
    assert b["grads"] == 16 * MiB
    assert b["activations"] == pytest.approx(4 * MiB / 2)


def test_fsdp2_gradient_shards_come_unit_by_unit():
    """FSDP2 on 2 ranks, one unit per 8 MiB op: each unit's reduce-scatter makes its 4 MiB
    shard (set_to_none) and holds the unit's unsharded gradient and the copy it reduces
    (no autocast: 2 x 8 MiB) while it runs. Small activations: the peak is the last unit's
    reduce-scatter, every shard made; large ones: the first, one shard made."""
    light = _chain(8, param=8 * MiB, act=MiB)
    plan = Plan.single(light).with_parallel(data=2, shard="fsdp")
    b = simulate(light, plan, _cluster()).memory_breakdown[0]
    assert b["params"] == 32 * MiB + 2 * 8 * MiB  # the shard, two units gathered
    assert b["grads"] == 32 * MiB and b["transient"] == 16 * MiB
    heavy = _chain(8, param=8 * MiB, act=16 * MiB)
    b = simulate(heavy, plan, _cluster()).memory_breakdown[0]
    assert b["grads"] == 4 * MiB and b["activations"] == 64 * MiB


@pytest.mark.parametrize("autocast", [None, "bfloat16"])
def test_exported_weights_read_by_a_matmul_are_cast(autocast):
    """An exported graph's weight is an op of its own that the matmul reads: under bf16
    autocast it has a half-size copy like a module's weight; a weight read by an
    elementwise op (a norm's scale) is not cast."""
    def node(name, kind, **kw):
        return OpNode(name=name, kind=kind, fwd_time_s={"cpu": 1e-3}, bwd_time_s={"cpu": 1e-3},
                      output_bytes=MiB, **kw)

    nodes = [node("x", "input"), node("w", "param", param_bytes=8 * MiB),
             node("s", "param", param_bytes=2 * MiB), node("mm", "mm", activation_bytes=MiB),
             node("mul", "mul", activation_bytes=MiB)]
    g = OpGraph("exported", nodes, [("x", "mm", MiB), ("w", "mm", 8 * MiB),
                                    ("mm", "mul", MiB), ("s", "mul", 2 * MiB)])
    g.autocast_dtype = None
    plain = simulate(g, Plan.single(g), _cluster(1)).memory_breakdown[0]
    g.autocast_dtype = autocast
    g.__dict__.pop("_sim_arrays", None)
    b = simulate(g, Plan.single(g), _cluster(1)).memory_breakdown[0]
    # the copy lives in what the matmul saves, until its backward: alive at the peak
    assert b["params"] == 10 * MiB
    assert b["total"] - plain["total"] == (4 * MiB if autocast else 0)


def test_sharded_recurrent_weights_stay_packed_on_gpus():
    """Under FSDP2 on GPUs an LSTM's whole weights stay allocated (cuDNN's packed copy of
    what FSDP2 gathered, at the gather dtype); on CPUs, and for other ops, nothing does."""
    g = _chain(4, param=8 * MiB, act=MiB)
    g.ops[1].kind = "LSTM"
    plan = Plan.single(g).with_parallel(data=2, shard="fsdp")
    gpu = Device(name="gpu", kind="h100", memory_bytes=64 * 2**30, peak_flops=50e12,
                 memory_bandwidth=1e12, launch_overhead_s=0.0)
    on_gpu = simulate(g, plan, Cluster.uniform("gpu-x2", gpu, 2, alpha_s=1e-5, bandwidth=5e9))
    on_cpu = simulate(g, plan, _cluster())
    packed = on_gpu.memory_breakdown[0]["params"] - on_cpu.memory_breakdown[0]["params"]
    assert packed == 8 * MiB
    ddp = Plan.single(g).with_parallel(data=2)
    assert (simulate(g, ddp, Cluster.uniform("gpu-x2", gpu, 2, alpha_s=1e-5, bandwidth=5e9))
            .memory_breakdown[0]["params"] == simulate(g, ddp, _cluster())
            .memory_breakdown[0]["params"])


@pytest.mark.parametrize("compile_, recompute, rooted", [
    (False, set(), set()), (False, {1}, {1}), (False, {2}, set()), (True, set(), {1})])
def test_pieces_holding_a_recurrent_module_stay_in_the_roots_unit(compile_, recompute, rooted):
    """As the executor wraps them (``executor.data.unit_members``): a checkpointed or
    compiled group holding an LSTM leaves its modules to FSDP2's root unit, gathered for
    the whole step; other pieces of one unit stay units of their own."""
    from autoplace.sim.model import fsdp_units, graph_arrays

    g = _chain(4, param=8 * MiB, act=MiB)
    g.ops[1].kind = "LSTM"
    plan = Plan.from_groups(g, {f"op{i}": i for i in range(4)}, [0] * 4,
                            recompute=recompute,
                            parallel=ParallelConfig(data=2, shard="fsdp", compile=compile_))
    fu = fsdp_units(graph_arrays(g), [0] * 4, 1, "blocks", plan)
    in_root = {i for i in range(4) if fu.root[fu.unit_of[i]]}
    assert in_root == rooted


def test_a_compiled_group_spanning_two_units_stays_in_the_roots_unit():
    """A compiled piece whose parameters belong to two units (two blocks' ops in one
    group) is left to the root's unit; checkpointed only, its blocks stay units."""
    from autoplace.sim.model import fsdp_units, graph_arrays

    g = _chain(4, param=8 * MiB, act=MiB)
    groups = {"op0": 0, "op1": 1, "op2": 2, "op3": 2}
    for compile_, rooted in ((True, {2, 3}), (False, set())):
        plan = Plan.from_groups(g, groups, [0] * 3, recompute={2},
                                parallel=ParallelConfig(data=2, shard="fsdp", compile=compile_))
        fu = fsdp_units(graph_arrays(g), [0] * 4, 1, "blocks", plan)
        assert {i for i in range(4) if fu.root[fu.unit_of[i]]} == rooted
