"""Tiny graphs and clusters the tests share: random DAGs with a slow device kind, parallel
branches."""

from __future__ import annotations

from dataclasses import replace

from autoplace.cluster import Cluster, preset
from autoplace.graph import OpGraph, OpNode, random_dag

SLOW = 8.0  # how much slower the second device of the skewed cluster is


def small_graph(num_ops: int = 40, seed: int = 0) -> OpGraph:
    """A random DAG with CPU costs, and costs 8x higher for the kind ``cpu-slow``."""
    graph = random_dag(num_ops, seed=seed)
    for op in graph:
        op.fwd_time_s["cpu-slow"] = SLOW * op.fwd_time_s["cpu"]
        op.bwd_time_s["cpu-slow"] = SLOW * op.bwd_time_s["cpu"]
    return graph


def skewed_cluster() -> Cluster:
    """Two CPU devices, the second 8x slower: random placement is clearly bad there."""
    base = preset("cpu-x2")
    slow = replace(base.devices[1], kind="cpu-slow", peak_flops=base.devices[1].peak_flops / SLOW)
    return replace(base, name="cpu-skewed", devices=(base.devices[0], slow))


def branches(n_branches: int = 4, depth: int = 6, interleave: bool = True) -> OpGraph:
    """input -> fork -> ``n_branches`` chains of ``depth`` matmuls -> concat -> out.

    With ``interleave`` the branches' ops alternate in program order (as a traced model's
    may), so no interval of program order holds one branch."""
    t = {"cpu": 1.0}
    ops = [OpNode(name="x", kind="input"),
           OpNode(name="fork", kind="linear", fwd_time_s={"cpu": 0.1}, bwd_time_s={"cpu": 0.1})]
    edges = [("x", "fork", 8)]
    names = [[f"b{b}_{i}" for i in range(depth)] for b in range(n_branches)]
    seq = ([names[b][i] for i in range(depth) for b in range(n_branches)] if interleave
           else [n for chain in names for n in chain])
    ops += [OpNode(name=n, kind="matmul", fwd_time_s=t, bwd_time_s=t) for n in seq]
    for chain in names:
        edges.append(("fork", chain[0], 8))
        edges += [(a, b, 8) for a, b in zip(chain, chain[1:])]
        edges.append((chain[-1], "cat", 8))
    ops += [OpNode(name="cat", kind="cat", fwd_time_s={"cpu": 0.1}, bwd_time_s={"cpu": 0.1}),
            OpNode(name="out", kind="output")]
    edges.append(("cat", "out", 8))
    return OpGraph("branches", ops, edges)
