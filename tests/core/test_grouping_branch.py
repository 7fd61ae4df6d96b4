"""Branch-aware grouping (``coarsen(method="branch")``): parallel branches stay apart."""

from __future__ import annotations

import networkx as nx
import pytest

from autoplace.graph import OpGraph, OpNode, random_dag
from autoplace.grouping import (
    auto_group_count,
    branch_blocks,
    branch_chains,
    branch_groups,
    coarsen,
    colocation_groups,
    group_graph,
)
from tests.helpers.graphs import branches


def _check_valid(graph: OpGraph, groups: dict[str, int], k: int) -> None:
    assert set(groups) == set(graph.order)  # every op in exactly one group
    n = len(set(groups.values()))
    assert 1 <= n <= k
    assert sorted(set(groups.values())) == list(range(n))
    gg = group_graph(graph, groups)
    assert nx.is_directed_acyclic_graph(gg)
    assert all(u < v for u, v in gg.edges)  # ids follow a topological order
    coloc = colocation_groups(graph)
    by_coloc: dict[int, set[int]] = {}
    for name in graph.order:
        by_coloc.setdefault(coloc[name], set()).add(groups[name])
    assert all(len(s) == 1 for s in by_coloc.values())  # no co-location group split


@pytest.mark.parametrize("interleave", [True, False])
@pytest.mark.parametrize("k", [4, 6, 12])
def test_parallel_branches_land_in_different_groups(interleave, k):
    g = branches(4, 6, interleave)
    groups = coarsen(g, k, method="branch")
    _check_valid(g, groups, k)
    per_branch = [{groups[f"b{b}_{i}"] for i in range(6)} for b in range(4)]
    for a in range(4):
        for b in range(a + 1, 4):
            assert not per_branch[a] & per_branch[b], (a, b, groups)


def test_contiguous_cannot_separate_interleaved_branches():
    g = branches(4, 6, interleave=True)
    groups = coarsen(g, 4, method="contiguous")
    shared = {groups["b0_3"], groups["b1_3"]}
    assert len(shared) == 1  # an interval of program order mixes the branches


def test_long_chain_is_split_into_balanced_groups():
    g = branches(1, 40, interleave=False)
    groups = coarsen(g, 8, method="branch")
    _check_valid(g, groups, 8)
    sizes = [sum(groups[f"b0_{i}"] == gid for i in range(40)) for gid in set(groups.values())]
    assert len(set(groups.values())) >= 6
    assert max(sizes) <= 10


@pytest.mark.parametrize("k", [1, 2, 5, 16, 64])
@pytest.mark.parametrize("seed", [0, 3])
def test_branch_groups_valid_on_random_dags(k, seed):
    g = random_dag(300, seed=seed)
    _check_valid(g, branch_groups(g, k), k)


def test_branch_groups_on_views_and_inplace():
    """Co-location through views and in-place ops can make the quotient cyclic."""
    ops = [OpNode(name="x", kind="input"),
           OpNode(name="a", kind="linear", fwd_time_s={"cpu": 1.0}),
           OpNode(name="v", kind="view"),
           OpNode(name="y", kind="relu", fwd_time_s={"cpu": 1.0}),
           OpNode(name="z", kind="add_", fwd_time_s={"cpu": 1.0}),
           OpNode(name="out", kind="output")]
    edges = [("x", "a", 8), ("a", "v", 8), ("a", "y", 8), ("y", "z", 8), ("v", "z", 8),
             ("z", "out", 8)]
    g = OpGraph("cyc", ops, edges)
    for k in (1, 2, 4):
        _check_valid(g, coarsen(g, k, method="branch"), k)


def _chain(n: int = 10) -> OpGraph:
    t = {"cpu": 1.0}
    ops = [OpNode(name="x", kind="input")]
    ops += [OpNode(name=f"l{i}", kind="linear", fwd_time_s=t, bwd_time_s=t) for i in range(n)]
    ops.append(OpNode(name="out", kind="output"))
    names = ["x"] + [f"l{i}" for i in range(n)] + ["out"]
    return OpGraph("chain", ops, [(a, b, 8) for a, b in zip(names, names[1:])])


def _stacked_blocks(n_blocks: int, n_branches: int = 4) -> OpGraph:
    """``n_blocks`` fork/towers/concat blocks one after another."""
    t = {"cpu": 1.0}
    ops = [OpNode(name="x", kind="input")]
    edges = []
    prev = "x"
    for k in range(n_blocks):
        fork, cat = f"fork{k}", f"cat{k}"
        ops.append(OpNode(name=fork, kind="linear", fwd_time_s=t, bwd_time_s=t))
        edges.append((prev, fork, 8))
        for b in range(n_branches):
            ops.append(OpNode(name=f"t{k}_{b}", kind="conv", fwd_time_s=t, bwd_time_s=t))
            edges += [(fork, f"t{k}_{b}", 8), (f"t{k}_{b}", cat, 8)]
        ops.append(OpNode(name=cat, kind="cat", fwd_time_s=t, bwd_time_s=t))
        prev = cat
    ops.append(OpNode(name="out", kind="output"))
    edges.append((prev, "out", 8))
    return OpGraph("blocks", ops, edges)


def test_auto_group_count_follows_branch_blocks():
    # residual-style forks of two are no blocks: a long stack keeps the base count
    g = _stacked_blocks(10, n_branches=2)
    assert branch_blocks(g) == 0 and branch_chains(g) == 31
    assert auto_group_count(g) == 16
    # each fork into three or more towers after the first adds groups, up to the cap
    assert branch_blocks(_stacked_blocks(5)) == 5
    assert branch_chains(_stacked_blocks(5)) == 26
    assert auto_group_count(_stacked_blocks(5)) == 16 + 2 * 4
    assert auto_group_count(_stacked_blocks(3)) == 16 + 2 * 2
    assert auto_group_count(_stacked_blocks(20)) == 32  # capped at 2 * base
    assert auto_group_count(_stacked_blocks(3), base=8, per_block=4, cap=64) == 8 + 4 * 2


def test_auto_group_count_small_fork_join_gets_few_groups():
    # one fork into four towers: input chain, four towers, head = 6 chains -> 8 groups
    g = branches(4, 6)
    assert branch_blocks(g) == 1 and branch_chains(g) == 6
    assert auto_group_count(g) == 8
    assert auto_group_count(g, min_groups=4) == 16  # 6 chains are more than 4
    # chains without a multi-branch block keep the base count, however short
    assert branch_chains(_chain()) == 1
    assert auto_group_count(_chain()) == 16
    assert auto_group_count(_stacked_blocks(3, n_branches=2)) == 16
    # the count is usable by branch_groups, and keeps the towers apart
    k = auto_group_count(g)
    groups = branch_groups(g, k)
    _check_valid(g, groups, k)
    per_branch = [{groups[f"b{b}_{i}"] for i in range(6)} for b in range(4)]
    assert all(not per_branch[a] & per_branch[b] for a in range(4) for b in range(a + 1, 4))
