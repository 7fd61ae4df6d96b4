"""The stage-split model of ``hybrid-dp``: per-group costs, and the DP over boundaries.

A replica's ops are cut into contiguous groups; :func:`best_split` chooses which
groups form each of ``k`` stages so that the slowest stage's time per microbatch is
smallest, every stage fitting its device's memory (recomputing a stage's
activations when that is what makes it fit). :func:`split_objective` is the same
objective for given boundaries (the brute-force check of the DP uses it).

Memory per device of a stage: parameters + gradients + AdamW state (sharded per
the shard mode, as the simulator counts them) plus kept activations of the
microbatches in flight (all of them for GPipe and one-process replicas, ``k - s``
for stage ``s`` under 1F1B); a recomputed stage keeps only its input per microbatch
plus one microbatch's activations.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np

from autoplace.cluster import Cluster
from autoplace.costs.collectives import all_gather_s, all_reduce_s, reduce_scatter_s
from autoplace.graph import OpGraph
from autoplace.grouping import colocation_groups
from autoplace.sim.model import fixed_part

__all__ = ["SplitCosts", "SplitConfig", "split_costs", "best_split", "split_objective",
           "chain_groups", "estimate_step_s"]

OPTIMIZER_STATE_PER_PARAM_BYTE = 2.0  # AdamW moments
UPDATE_TRAFFIC_PER_PARAM_BYTE = 7.0  # fused AdamW reads p, g, m, v and writes p, m, v
BUCKET_BYTES = 25 * 2**20  # DDP's default bucket


def op_weights(graph: OpGraph, cluster: Cluster) -> np.ndarray:
    kind = cluster.devices[0].kind
    return graph.fwd_times(kind) + graph.bwd_times(kind)


def chain_groups(graph: OpGraph, max_groups: int, weights: np.ndarray) -> dict[str, int]:
    """At most ``max_groups`` balanced intervals of the program order (``graph.order``).

    Unlike :func:`grouping.coarsen` (intervals of placement order), any split of these
    intervals into runs is a valid pipeline (a chain in program order); no interval
    boundary splits a co-location group.
    """
    order = graph.order
    n = len(order)
    coloc = colocation_groups(graph)
    first: dict[int, int] = {}
    last: dict[int, int] = {}
    for i, name in enumerate(order):
        first.setdefault(coloc[name], i)
        last[coloc[name]] = i
    span = np.zeros(n + 1, dtype=np.int64)
    for c, a in first.items():
        span[a + 1] += 1
        span[last[c] + 1] -= 1
    blocked = np.cumsum(span)[:n] > 0
    allowed = np.array([i for i in range(1, n) if not blocked[i]], dtype=np.int64)
    cum = np.concatenate([[0.0], np.cumsum(np.maximum(weights, 0.0) + 1e-12)])
    cuts: list[int] = []
    for j in range(1, max_groups):
        if not len(allowed):
            break
        target = cum[-1] * j / max_groups
        pos = int(np.searchsorted(cum[allowed], target))
        cands = {int(allowed[min(pos, len(allowed) - 1)]), int(allowed[max(pos - 1, 0)])}
        c = min(cands, key=lambda x: (abs(cum[x] - target), x))
        if not cuts or c > cuts[-1]:
            cuts.append(c)
    gid = np.zeros(n, dtype=np.int64)
    for c in cuts:
        gid[c:] += 1
    return {name: int(gid[i]) for i, name in enumerate(order)}


@dataclass
class SplitCosts:
    """One replica's costs per contiguous group (``G`` groups, ids in placement order).

    Attributes:
        fixed_s, var_s: forward + backward seconds of each group that do not / do
            shrink with the batch share (per op, the simulator's fixed part
            :func:`autoplace.sim.model.fixed_part`, and the rest).
        fwd_fixed_s, fwd_var_s: the same for the forward alone (paid again by recompute).
        param_bytes, activation_bytes: per group.
        cut_bytes: ``[G + 1]``, bytes of every tensor crossing the boundary before group
            ``i`` (0 at both ends).
        alpha_s, bandwidth: the link between neighbouring stages.
        usable_bytes: memory a device may use.
    """

    fixed_s: np.ndarray
    var_s: np.ndarray
    fwd_fixed_s: np.ndarray
    fwd_var_s: np.ndarray
    param_bytes: np.ndarray
    activation_bytes: np.ndarray
    cut_bytes: np.ndarray
    alpha_s: float
    bandwidth: float
    usable_bytes: float

    @property
    def num_groups(self) -> int:
        return len(self.fixed_s)


@dataclass(frozen=True)
class SplitConfig:
    """One point of the hybrid space: ``mode`` is ``data`` (1 stage), ``pipeline``
    (torch pipelining) or ``local`` (several devices in one process)."""

    stages: int
    data: int = 1
    microbatches: int = 1
    mode: str = "data"
    schedule: str = "gpipe"
    shard: str = "none"
    memory_margin: float = 0.05

    def inflight(self, stage: int) -> int:
        """Microbatches whose activations stage ``stage`` holds at once."""
        if self.mode == "pipeline" and self.schedule == "1f1b":
            return min(self.stages - stage, self.microbatches)
        return self.microbatches


def split_costs(graph: OpGraph, cluster: Cluster, groups: dict[str, int]) -> SplitCosts:
    """Per-group arrays of ``groups`` (contiguous ids) on device 0's kind."""
    dev = cluster.devices[0]
    oh = dev.launch_overhead_s
    n = max(groups.values()) + 1
    gid = np.array([groups[o] for o in graph.order])
    f, b = graph.fwd_times(dev.kind), graph.bwd_times(dev.kind)
    ff = fixed_part(f, graph.fwd_fixed_times(dev.kind), oh)
    bf = fixed_part(b, graph.bwd_fixed_times(dev.kind), oh)

    def per_group(x) -> np.ndarray:
        return np.bincount(gid, weights=np.asarray(x, dtype=np.float64), minlength=n)

    cut = np.zeros(n + 1)
    for u, v, nbytes in graph.edges:
        gu, gv = groups[u], groups[v]
        if gu < gv:
            cut[gu + 1:gv + 1] += nbytes
    cut[0] = cut[n] = 0.0
    if cluster.num_devices > 1:
        alpha, bw = cluster.alpha_s[0][1], cluster.bandwidth[0][1]
    else:
        alpha, bw = 0.0, float("inf")
    return SplitCosts(
        fixed_s=per_group(ff + bf), var_s=per_group(f + b - ff - bf),
        fwd_fixed_s=per_group(ff), fwd_var_s=per_group(f - ff),
        param_bytes=per_group([op.param_bytes for op in graph]),
        activation_bytes=per_group([op.activation_bytes for op in graph]),
        cut_bytes=cut, alpha_s=alpha, bandwidth=bw,
        usable_bytes=float(min(d.usable_memory_bytes for d in cluster.devices)),
    )


def _state_bytes(params, d: int, shard: str, max_group_params: float):
    """Parameters + gradients + AdamW state per device under a shard mode."""
    if shard == "none" or d == 1:
        return (2.0 + OPTIMIZER_STATE_PER_PARAM_BYTE) * params
    grads = params / d + np.minimum(float(BUCKET_BYTES), params)
    opt = OPTIMIZER_STATE_PER_PARAM_BYTE * params / d
    whole = params if shard == "zero2" else np.minimum(params, params / d + 2 * max_group_params)
    return whole + grads + opt


def _interval_tables(sc: SplitCosts, cfg: SplitConfig):
    """Matrices ``[a, b]`` over intervals ``[a, b)``: per-microbatch time without and with
    recompute, and per stage index memory without and with recompute (inf = invalid)."""
    g = sc.num_groups
    share = 1.0 / (cfg.microbatches * cfg.data)

    def interval(x: np.ndarray) -> np.ndarray:
        c = np.concatenate([[0.0], np.cumsum(x)])
        return c[None, :] - c[:, None]  # [a, b] = sum x[a:b]

    valid = np.triu(np.ones((g + 1, g + 1), dtype=bool), 1)
    comm = np.zeros(g + 1)
    if cfg.stages > 1:
        inner = (sc.cut_bytes > 0) & (np.arange(g + 1) > 0) & (np.arange(g + 1) < g)
        comm = np.where(inner, 2 * (sc.alpha_s + sc.cut_bytes * share / sc.bandwidth), 0.0)
    t = interval(sc.var_s) * share + interval(sc.fixed_s) + comm[None, :]
    t_rc = t + interval(sc.fwd_var_s) * share + interval(sc.fwd_fixed_s)
    params = interval(sc.param_bytes)
    acts = interval(sc.activation_bytes) * share
    state = _state_bytes(params, cfg.data, cfg.shard, float(sc.param_bytes.max(initial=0.0)))
    cap = sc.usable_bytes * (1.0 - cfg.memory_margin)
    t[~valid] = np.inf
    t_rc[~valid] = np.inf
    mems = []
    for s in range(cfg.stages):
        q = cfg.inflight(s)
        mem = state + acts * q
        mem_rc = state + sc.cut_bytes[:, None] * share * q + acts
        mems.append((np.where(valid, mem, np.inf), np.where(valid, mem_rc, np.inf)))
    return t, t_rc, mems, cap


def _stage_choice(t, t_rc, mem, mem_rc, cap):
    """Per interval: the time of the cheaper option that fits, and whether it recomputes."""
    fit, fit_rc = mem <= cap, mem_rc <= cap
    cost = np.where(fit, t, np.where(fit_rc, t_rc, np.inf))
    return cost, ~fit & fit_rc


def best_split(sc: SplitCosts, cfg: SplitConfig) -> tuple[float, list[int], list[bool]]:
    """Stage boundaries minimising the slowest stage's time per microbatch.

    Returns:
        ``(objective_s, bounds, recompute)``: ``bounds = [0, b1, ..., G]`` (stage ``s`` is
        groups ``bounds[s]:bounds[s+1]``) and whether each stage recomputes; the
        objective is ``inf`` (and the lists empty) when no split fits in memory.
    """
    g, k = sc.num_groups, cfg.stages
    if k > g:
        return float("inf"), [], []
    t, t_rc, mems, cap = _interval_tables(sc, cfg)
    best = np.full(g + 1, np.inf)
    best[0] = 0.0
    back = []
    for s in range(k):
        cost, rc = _stage_choice(t, t_rc, *mems[s], cap)
        total = np.maximum(best[:, None], cost)  # [a, b]
        arg = np.argmin(total, axis=0)
        new = total[arg, np.arange(g + 1)]
        back.append((arg, rc))
        best = new
    if not np.isfinite(best[g]):
        return float("inf"), [], []
    bounds = [g]
    flags = []
    b = g
    for s in reversed(range(k)):
        arg, rc = back[s]
        a = int(arg[b])
        flags.append(bool(rc[a, b]))
        bounds.append(a)
        b = a
    return float(best[g]), bounds[::-1], flags[::-1]


def split_objective(sc: SplitCosts, cfg: SplitConfig, bounds: list[int]) -> float:
    """The objective :func:`best_split` minimises, for given ``bounds``."""
    t, t_rc, mems, cap = _interval_tables(sc, cfg)
    worst = 0.0
    for s in range(len(bounds) - 1):
        cost, _ = _stage_choice(t, t_rc, *mems[s], cap)
        worst = max(worst, float(cost[bounds[s], bounds[s + 1]]))
    return worst


def estimate_step_s(sc: SplitCosts, cfg: SplitConfig, cluster: Cluster, stage_s: float,
                     bounds: list[int]) -> float:
    """A rough step time for ranking configurations before simulating them."""
    m, k, d = cfg.microbatches, cfg.stages, cfg.data
    pipe = (m + k - 1) * stage_s
    params = max(float(sc.param_bytes[a:b].sum()) for a, b in itertools.pairwise(bounds))
    group = list(range(0, d * k, k))
    sync = 0.0
    if d > 1:
        if cfg.shard == "none":
            comm = all_reduce_s(cluster, params, group)
        else:
            comm = reduce_scatter_s(cluster, params, group) + all_gather_s(cluster, params, group)
            if cfg.shard == "fsdp":
                comm += 2 * all_gather_s(cluster, params, group)
        sync = max(comm - 0.5 * pipe, 0.0) + all_reduce_s(cluster, min(params, BUCKET_BYTES), group)
    dev = cluster.devices[0]
    update = UPDATE_TRAFFIC_PER_PARAM_BYTE * params / dev.memory_bandwidth
    if cfg.shard != "none" and d > 1:
        update /= d
    return pipe + sync + update
