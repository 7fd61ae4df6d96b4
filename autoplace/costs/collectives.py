"""Collective costs over a cluster's nodes, the way NCCL runs them.

Every collective is priced with the alpha-beta(-gamma) model (Thakur, Rabenseifner and
Gropp 2005): per step a latency ``alpha``, per byte ``1 / bandwidth``, per byte reduced
``gamma`` (``Cluster.gamma_s_per_byte``). Sizes follow nccl-tests' conventions
(``doc/PERFORMANCE.md``): ``nbytes`` is the full tensor (all-reduce: the buffer;
all-gather: the gathered output; reduce-scatter: the input), the *algorithm bandwidth*
is ``nbytes / time`` and the *bus bandwidth* ``busbw = algbw * factor`` with
``factor = 2(p-1)/p`` for all-reduce and ``(p-1)/p`` for all-gather and reduce-scatter:
what each rank sends over its slowest link, comparable across rank counts. The cluster's
``collective_bandwidth`` is a bus bandwidth in that sense (measured by
:func:`autoplace.executor.collectives.measure_collectives`).

Parameters, for ``p`` ranks on ``N`` nodes with ``r`` ranks on the least-filled node:

* inside a node: ``alpha_in = max(collective_alpha_s, link latencies)``,
  ``B_in = collective_bandwidth`` (else the slowest link between two of the ranks);
* between nodes: ``alpha_out = collective_alpha_s + network_alpha_s`` (the step's sync
  plus the wire), ``B_out = network_bandwidth`` per GPU's NIC.

Algorithms (NCCL 2.x, ``src/graph/tuning.cc`` ``ncclTopoTuneModel``):

* **ring** (the only one inside a node, and the default for large messages): one ring
  over all ranks, ``2(p-1)`` steps for all-reduce, ``p-1`` for all-gather /
  reduce-scatter, of which ``2(N-1)`` (``N-1``) cross a node boundary at ``alpha_out``.
  NCCL runs several rings (channels) spread over the NICs, one NIC per GPU on
  rail-optimised nodes, so across nodes ``busbw = min(B_in, r * B_out)``::

      all-reduce  = (2(p-1) - 2(N-1)) alpha_in + 2(N-1) alpha_out
                    + 2(p-1)/p * n / busbw + (p-1)/p * n * gamma
      all-gather  = (p-1 - (N-1)) alpha_in + (N-1) alpha_out + (p-1)/p * n / busbw
      reduce-scatter = all-gather + (p-1)/p * n * gamma

  On one node this is exactly the one-level ring the simulator has always used.
* **tree** (all-reduce across nodes; NCCL's double binary tree between nodes, a chain
  inside each): latency ``2((r-1) alpha_in + ceil(log2 N) alpha_out)``; NCCL converts
  bus to algorithm bandwidth with a ratio of 1/2 for trees and derates the tree's bus
  bandwidth to 0.92 of the ring's, so the bytes cost ``2 n / (0.92 busbw)`` (+ the
  ``gamma`` term as the ring's). Fewer latency steps, more time per byte: NCCL's
  tuner picks tree for small messages and many nodes, ring for large ones.
* **hierarchical** (all-reduce across nodes: reduce-scatter inside each node, all-reduce
  of each rank's ``1/r`` shard between nodes over its own NIC, all-gather inside each
  node; Horovod's hierarchical all-reduce, HSDP's two levels)::

      2((r-1) alpha_in + (r-1)/r * n / B_in) + min(ring, tree)(n / r over N ranks at B_out)

  It saves the ring's intra-node latency steps; on rail-optimised nodes it does not
  beat the ring's bandwidth (both send about ``2 n / (r B_out)`` per NIC), so it wins
  at medium sizes, and at large sizes only where ``B_in`` is far above ``r * B_out``.

``algorithm="auto"`` (the default) is what NCCL's tuner does: the fastest of these.
All-gather and reduce-scatter are ring only (NCCL's algorithm for them without NVLS).
Point-to-point copies (:func:`send_recv_s`) use the cluster's pair matrices.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from autoplace.cluster import Cluster
from autoplace.errors import AutoplaceError

__all__ = ["ALGORITHMS", "TREE_BUS_FACTOR", "all_gather_s", "all_reduce_s",
           "reduce_scatter_s", "send_recv_s"]

#: All-reduce algorithms; ``auto`` takes the fastest.
ALGORITHMS = ("auto", "ring", "tree", "hierarchical")
#: NCCL's derating of the tree's bus bandwidth against the ring's (tuning.cc: ``busBw*.92``).
TREE_BUS_FACTOR = 0.92
#: Above this many pairs, a node's slowest link is looked for along the ring's hops only.
_PAIR_SCAN_LIMIT = 4096


class _Group:
    """The numbers a collective over ``ranks`` needs (see the module docstring)."""

    __slots__ = ("p", "nodes", "r", "alpha_in", "b_in", "alpha_out", "b_out", "gamma")

    def __init__(self, cluster: Cluster, ranks: Sequence[int]) -> None:
        ranks = list(dict.fromkeys(ranks))
        for x in ranks:
            if not isinstance(x, int) or not 0 <= x < cluster.num_devices:
                raise AutoplaceError(f"rank {x!r} is not a device of cluster {cluster.name!r} "
                                     f"(valid: 0..{cluster.num_devices - 1})")
        by_node: dict[int, list[int]] = {}
        for x in ranks:
            by_node.setdefault(cluster.node_of(x), []).append(x)
        self.p, self.nodes = len(ranks), len(by_node)
        self.r = min(len(v) for v in by_node.values()) if ranks else 0
        pairs = _intra_pairs(list(by_node.values()))
        self.alpha_in = max([cluster.collective_alpha_s]
                            + [cluster.alpha_s[i][j] for i, j in pairs])
        if cluster.collective_bandwidth is not None:
            self.b_in = cluster.collective_bandwidth
        else:
            self.b_in = min((cluster.bandwidth[i][j] for i, j in pairs), default=math.inf)
        self.alpha_out = cluster.collective_alpha_s + cluster.network_alpha_s
        self.b_out = cluster.network_bandwidth
        self.gamma = cluster.gamma_s_per_byte

    @property
    def ring_bus(self) -> float:
        """Bus bandwidth of NCCL's rings: every NIC of the node's ranks, capped by NVLink."""
        if self.nodes == 1:
            return self.b_in
        return min(self.b_in, self.r * self.b_out)


def _intra_pairs(nodes: list[list[int]]) -> list[tuple[int, int]]:
    """Ordered pairs of ranks on one node (a ring's hops where that is too many)."""
    if sum(len(v) * (len(v) - 1) for v in nodes) <= _PAIR_SCAN_LIMIT:
        return [(i, j) for v in nodes for i in v for j in v if i != j]
    return [(i, j) for v in nodes for i, j in zip(v, v[1:] + v[:1]) if i != j]


def _check(nbytes: float, what: str) -> None:
    if isinstance(nbytes, bool) or not isinstance(nbytes, (int, float)) or nbytes != nbytes:
        raise AutoplaceError(f"{what}: nbytes must be a number of bytes, got {nbytes!r}")


def _ring_all_reduce(g: _Group, n: float) -> float:
    p, inter = g.p, 2 * (g.nodes - 1)
    return ((2 * (p - 1) - inter) * g.alpha_in + inter * g.alpha_out
            + 2 * (p - 1) / p * n / g.ring_bus + (p - 1) / p * n * g.gamma)


def _tree_all_reduce(g: _Group, n: float) -> float:
    p = g.p
    latency = 2 * ((g.r - 1) * g.alpha_in + math.ceil(math.log2(g.nodes)) * g.alpha_out)
    return latency + 2 * n / (TREE_BUS_FACTOR * g.ring_bus) + (p - 1) / p * n * g.gamma


def _hierarchical_all_reduce(g: _Group, n: float) -> float:
    r, big_n = g.r, g.nodes
    intra = 0.0
    if r > 1:
        intra = 2 * ((r - 1) * g.alpha_in + (r - 1) / r * n / g.b_in) + (r - 1) / r * n * g.gamma
    shard = n / r
    ring = (2 * (big_n - 1) * g.alpha_out + 2 * (big_n - 1) / big_n * shard / g.b_out
            + (big_n - 1) / big_n * shard * g.gamma)
    tree = (2 * math.ceil(math.log2(big_n)) * g.alpha_out
            + 2 * shard / (TREE_BUS_FACTOR * g.b_out) + (big_n - 1) / big_n * shard * g.gamma)
    return intra + min(ring, tree)


def all_reduce_s(cluster: Cluster, nbytes: float, ranks: Sequence[int],
                 algorithm: str = "auto") -> float:
    """Seconds to all-reduce an ``nbytes`` buffer over ``ranks`` (device indices).

    ``algorithm``: ``auto`` (the fastest, as NCCL's tuner picks), ``ring``, ``tree`` or
    ``hierarchical``; on one node every choice is the ring. 0 for one rank or no bytes.
    """
    if algorithm not in ALGORITHMS:
        raise AutoplaceError(f"unknown all-reduce algorithm {algorithm!r}; valid: "
                             f"{', '.join(ALGORITHMS)}")
    _check(nbytes, "all-reduce")
    g = _Group(cluster, ranks)
    if g.p <= 1 or nbytes <= 0:
        return 0.0
    if g.nodes == 1:
        return _ring_all_reduce(g, nbytes)
    options = {"ring": _ring_all_reduce, "tree": _tree_all_reduce,
               "hierarchical": _hierarchical_all_reduce}
    if algorithm != "auto":
        return options[algorithm](g, nbytes)
    return min(f(g, nbytes) for f in options.values())


def all_gather_s(cluster: Cluster, nbytes: float, ranks: Sequence[int]) -> float:
    """Seconds to all-gather over ``ranks`` a tensor of ``nbytes`` in all (each rank
    contributes ``nbytes / p``): NCCL's ring."""
    _check(nbytes, "all-gather")
    g = _Group(cluster, ranks)
    if g.p <= 1 or nbytes <= 0:
        return 0.0
    p, inter = g.p, g.nodes - 1
    return (p - 1 - inter) * g.alpha_in + inter * g.alpha_out + (p - 1) / p * nbytes / g.ring_bus


def reduce_scatter_s(cluster: Cluster, nbytes: float, ranks: Sequence[int]) -> float:
    """Seconds to reduce-scatter an ``nbytes`` input over ``ranks`` (each keeps
    ``nbytes / p``): NCCL's ring, plus the reduction's ``gamma`` per byte."""
    _check(nbytes, "reduce-scatter")
    g = _Group(cluster, ranks)
    if g.p <= 1 or nbytes <= 0:
        return 0.0
    p, inter = g.p, g.nodes - 1
    return ((p - 1 - inter) * g.alpha_in + inter * g.alpha_out
            + (p - 1) / p * nbytes * (1 / g.ring_bus + g.gamma))


def send_recv_s(cluster: Cluster, nbytes: float, src: int, dst: int) -> float:
    """Seconds to send ``nbytes`` from device ``src`` to ``dst``: the pair's link (NVLink
    inside a node, the network between nodes), 0 on one device."""
    _check(nbytes, "send/recv")
    for x in (src, dst):
        if not isinstance(x, int) or not 0 <= x < cluster.num_devices:
            raise AutoplaceError(f"device {x!r} is not in cluster {cluster.name!r} (valid: "
                                 f"0..{cluster.num_devices - 1})")
    return cluster.transfer_time(src, dst, nbytes)
