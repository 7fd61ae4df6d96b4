from __future__ import annotations

import networkx as nx
import pytest

from autoplace.errors import AutoplaceError
from autoplace.graph import OpGraph, OpNode, random_dag
from autoplace.grouping import coarsen, colocation_groups, group_costs, group_graph


def _tiny() -> OpGraph:
    ops = [
        OpNode(name="x", kind="input"),
        OpNode(name="w", kind="param", param_bytes=64),
        OpNode(name="mm", kind="matmul", fwd_time_s={"cpu": 1.0}, bwd_time_s={"cpu": 2.0}),
        OpNode(name="v", kind="view"),
        OpNode(name="r", kind="relu", fwd_time_s={"cpu": 1.0}, bwd_time_s={"cpu": 1.0}),
        OpNode(name="a", kind="add_", fwd_time_s={"cpu": 1.0}, bwd_time_s={"cpu": 1.0}),
        OpNode(name="out", kind="output"),
    ]
    edges = [("x", "mm", 8), ("w", "mm", 8), ("mm", "v", 8), ("v", "r", 8), ("r", "a", 8),
             ("mm", "a", 8), ("a", "out", 8)]
    return OpGraph("tiny", ops, edges)


def test_colocation_rules():
    g = _tiny()
    c = colocation_groups(g)
    assert c["x"] == c["w"] == c["mm"] == c["v"]  # sources with consumer, view with producer
    assert c["a"] == c["r"] == c["out"]  # in-place with its data input, output with producer
    assert c["r"] != c["mm"]
    assert sorted(set(c.values())) == list(range(len(set(c.values()))))


@pytest.mark.parametrize("method", ["contiguous", "module"])
@pytest.mark.parametrize("k", [1, 2, 5, 16])
def test_coarsen_bounds_and_acyclic(method, k):
    g = random_dag(300, seed=3)
    groups = coarsen(g, k, method=method)
    n = len(set(groups.values()))
    assert 1 <= n <= k
    assert sorted(set(groups.values())) == list(range(n))
    gg = group_graph(g, groups)
    assert nx.is_directed_acyclic_graph(gg)
    # edges only go forward in group id
    assert all(u < v for u, v in gg.edges)
    coloc = colocation_groups(g)
    for a in g.order:
        for b in g.order:
            if coloc[a] == coloc[b]:
                assert groups[a] == groups[b]
                break


def test_contiguous_balances_cost():
    g = random_dag(400, seed=1)
    groups = coarsen(g, 4)
    costs = group_costs(g, groups, "cpu")
    tot = costs["fwd_time_s"] + costs["bwd_time_s"]
    assert len(tot) == 4
    assert tot.max() < 1.6 * tot.mean()
    assert costs["num_ops"].sum() == len(g)


def test_bad_arguments():
    g = random_dag(10)
    with pytest.raises(AutoplaceError, match="max_groups"):
        coarsen(g, 0)
    with pytest.raises(AutoplaceError, match="valid: contiguous, module"):
        coarsen(g, 2, method="nope")
