"""Checkpointing's price per call and per op from a profiled block
(``autoplace.costs.block_costs``), and the simulator charging it per region."""

from dataclasses import replace

import pytest

from autoplace import workloads
from autoplace.capture import capture_workload
from autoplace.cluster import resolve
from autoplace.costs.block_costs import checkpoint_costs
from autoplace.lowering import block_group_ids, block_groups
from autoplace.plan import Plan
from autoplace.sim import simulate
from autoplace.sim.block_profile import checkpoint_prices


def _record(call: float, per_op: float, n1: int, blocks: int, chain_ops: int,
            eager_op: float = 1e-4) -> dict:
    """The times a block profile would measure if checkpointing cost ``call`` seconds a
    checkpoint call and ``per_op`` an op."""
    return {"block_ops": n1, "blocks": blocks,
            "eager_s": n1 * eager_op, "full_s": n1 * eager_op + call + n1 * per_op,
            "eager_blocks_s": chain_ops * eager_op,
            "full_blocks_s": chain_ops * eager_op + blocks * call + chain_ops * per_op}


def test_blocks_of_several_sizes_separate_the_call_from_the_ops():
    rec = _record(call=0.5e-3, per_op=0.2e-3, n1=6, blocks=8, chain_ops=23)
    got = checkpoint_costs(rec, None, 23)
    assert got["full_call_host_s"] == pytest.approx(0.5e-3)
    assert got["full_host_s"] == pytest.approx(0.2e-3)
    assert "selective_host_s" not in got  # not measured


def test_blocks_of_one_size_are_priced_per_op():
    """Eight copies of the first block: one equation, so the added blocks' cost per op,
    as before, and nothing per call."""
    rec = _record(call=0.5e-3, per_op=0.2e-3, n1=5, blocks=8, chain_ops=40)
    got = checkpoint_costs(rec, None, 40)
    assert got["full_call_host_s"] == 0.0
    assert got["full_host_s"] == pytest.approx((7 * 0.5e-3 + 35 * 0.2e-3) / 35)


def test_one_block_or_an_unknown_chain_is_priced_per_op():
    rec = _record(call=0.6e-3, per_op=0.1e-3, n1=6, blocks=1, chain_ops=6)
    assert checkpoint_costs(rec, None, None) == {
        "full_host_s": pytest.approx((0.6e-3 + 0.6e-3) / 6), "full_call_host_s": 0.0}


@pytest.mark.parametrize("call, per_op", [(-0.3e-3, 0.3e-3), (1e-3, -0.02e-3)])
def test_prices_are_never_negative(call, per_op):
    """Noise that puts one unknown below zero leaves all of the cost to the other."""
    got = checkpoint_costs(_record(call, per_op, n1=6, blocks=8, chain_ops=23), None, 23)
    assert got["full_call_host_s"] >= 0 and got["full_host_s"] >= 0
    assert got["full_call_host_s"] + got["full_host_s"] > 0


def test_compiled_checkpoint_is_measured_against_the_compiled_block():
    rec = {"block_ops": 6, "compiled_full_s": 3e-3}
    got = checkpoint_costs(rec, {"compiled_s": 1.8e-3}, None)
    assert got["compiled_full_host_s"] == pytest.approx(1.2e-3 / 6)


def test_the_simulator_charges_each_checkpoint_call():
    """Recomputing k blocks adds k times the profiled price per checkpoint call (a
    launch-bound step: the issuing thread's time is the step's), and nothing to a plan
    that recomputes none. A profiled block's price holds its recompute's issue: with a
    price of nothing, a recomputed plan is simulated below the unprofiled one, which issues
    the rerun ops again at their own host time."""
    g = capture_workload(workloads.get("gpt-tiny", device="meta"))
    cluster = resolve("h200x1")
    groups = block_groups(g)
    blocks = sorted(block_group_ids(g, groups))
    base = Plan.from_groups(g, groups, [0] * (max(groups.values()) + 1))
    one = replace(base, recompute=frozenset(blocks[:1]))
    two = replace(base, recompute=frozenset(blocks[:2]))
    unprofiled = [simulate(g, p, cluster).step_time_s for p in (base, one, two)]
    g.profile_info = {"h200": {"recompute": {"full_host_s": 0.0, "full_call_host_s": 0.0}}}
    before = [simulate(g, p, cluster).step_time_s for p in (base, one, two)]
    assert before[0] == unprofiled[0] and before[1] < unprofiled[1] and before[2] < unprofiled[2]
    per_call, per_op = 5e-3, 0.0
    g.profile_info = {"h200": {"recompute": {"full_host_s": per_op,
                                             "full_call_host_s": per_call}}}
    assert checkpoint_prices(g, ["h200"], "full")[1][0] == per_call
    after = [simulate(g, p, cluster).step_time_s for p in (base, one, two)]
    assert after[0] == before[0]
    assert after[1] - before[1] == pytest.approx(per_call, rel=0.05)
    assert after[2] - before[2] == pytest.approx(2 * per_call, rel=0.05)
