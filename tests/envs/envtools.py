"""The tiny graphs and clusters the env tests share (imported by name: tests/envs is on sys.path)."""

from __future__ import annotations

from dataclasses import replace

from autoplace.cluster import Cluster, preset
from autoplace.graph import OpGraph, random_dag

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
