"""A plan over several nodes: how its processes split over them, and the commands to
start each node's share.

A plan's processes are numbered as :func:`~autoplace.executor.tensor_parallel.rank_layout`
lays them out; torchrun numbers them ``node * nproc_per_node + local_rank``, so process
``r`` runs on node ``r // nproc_per_node``, and every device it uses must be a device of
that node in the cluster (:meth:`~autoplace.cluster.Cluster.node_of`). Every node runs
one torchrun agent; the agents meet at a c10d rendezvous (``--rdzv-endpoint HOST:PORT``,
served by the first agent to reach it, ``--rdzv-id`` naming the run). c10d numbers the
nodes itself, in the order of its participants: ``--node-rank`` names a machine's share
for the user, and whichever node holds global rank 0 writes the report and the
checkpoints' metadata (``latest``). Checkpoints go to one folder every node can reach
(a shared filesystem): each rank writes its shards there.
"""

from __future__ import annotations

import hashlib
import json
import re
import shlex
import socket
from dataclasses import dataclass

from autoplace.cluster import Cluster
from autoplace.errors import AutoplaceError, PlanError
from autoplace.executor.tensor_parallel import process_count, rank_layout
from autoplace.plan import Plan

__all__ = ["DEFAULT_PORT", "NodeLaunch", "node_commands", "node_layout", "process_devices",
           "rdzv_id_of", "torchrun_node_args"]

#: Port of the rendezvous when the user names none (torchrun's own default).
DEFAULT_PORT = 29500


@dataclass(frozen=True, kw_only=True)
class NodeLaunch:
    """This machine's share of a run over several nodes.

    Attributes:
        nnodes: nodes in the run.
        node_rank: this node's label, ``0 .. nnodes - 1``.
        nproc_per_node: processes on each node.
        rdzv_endpoint: ``HOST:PORT`` of the c10d rendezvous.
        rdzv_id: the run's name at the rendezvous (the same on every node).
    """

    nnodes: int
    node_rank: int
    nproc_per_node: int
    rdzv_endpoint: str
    rdzv_id: str

    def __post_init__(self) -> None:
        if not 0 <= self.node_rank < self.nnodes:
            raise AutoplaceError(f"--node-rank {self.node_rank} is not a node of a run over "
                                 f"{self.nnodes} nodes (valid: 0..{self.nnodes - 1})")
        check_endpoint(self.rdzv_endpoint)
        if not re.fullmatch(r"[\w.-]{1,128}", self.rdzv_id):
            raise AutoplaceError(f"--rdzv-id {self.rdzv_id!r} must be letters, digits, '.', "
                                 "'_' or '-' (1 to 128 of them)")


def check_endpoint(endpoint: str) -> tuple[str, int]:
    """``HOST:PORT`` split and checked; the error says what a valid one looks like."""
    host, sep, port = endpoint.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise AutoplaceError(f"--rdzv-endpoint {endpoint!r} must be HOST:PORT, like "
                             f"node0.example:{DEFAULT_PORT} or 10.0.0.1:{DEFAULT_PORT}")
    return host, int(port)


def process_devices(plan: Plan, rank: int) -> list[int]:
    """Cluster devices process ``rank`` uses: its stage's, or every local device of a
    one-process replica (times its tensor index)."""
    replica, stage, j = rank_layout(plan, rank)
    k, t = plan.devices_per_replica, plan.parallel.tensor
    stages = range(k) if plan.parallel.pipeline == 1 else [stage]
    return [(replica * k + s) * t + j for s in stages]


def node_layout(plan: Plan, cluster: Cluster, nnodes: int | None = None) -> tuple[int, int]:
    """``(nodes, processes per node)`` of ``plan`` on ``cluster``.

    Without ``nnodes``, as many nodes as the plan's devices fill (one when they fit on
    one node). Raises :class:`AutoplaceError` before any work when the node count, the
    processes per node and the plan's devices disagree: processes that do not split
    evenly, more nodes than the cluster has, or a process whose devices are not on the
    node torchrun would start it on.
    """
    nproc = process_count(plan)
    need = max(plan.num_devices, nproc)
    gpn = cluster.gpus_per_node
    fill = -(-need // gpn)
    if nnodes is None:
        nnodes = fill
    if not isinstance(nnodes, int) or isinstance(nnodes, bool) or nnodes < 1:
        raise AutoplaceError(f"--nnodes must be a positive integer, got {nnodes!r}")
    where = (f"the plan ({plan.split()}: {nproc} process{'es' if nproc > 1 else ''} on "
             f"{need} devices) on cluster {cluster.name!r} ({cluster.num_nodes} node"
             f"{'s' if cluster.num_nodes > 1 else ''} x {gpn} devices)")
    if need > cluster.num_devices:
        raise PlanError(f"{where}: the plan needs {need} devices, but cluster "
                        f"{cluster.name!r} has {cluster.num_devices}")
    if nnodes > cluster.num_nodes:
        raise AutoplaceError(f"{where}: --nnodes {nnodes} asks for more nodes than the "
                             f"cluster has; valid: 1..{cluster.num_nodes}")
    if nnodes != fill:
        raise AutoplaceError(f"{where} fills {fill} node{'s' if fill > 1 else ''}, not "
                             f"--nnodes {nnodes}: a run uses whole nodes from the first")
    if nproc % nnodes:
        raise PlanError(f"{where}: {nproc} processes do not split evenly over {nnodes} "
                        "nodes (torchrun starts the same number on each)")
    per = nproc // nnodes
    for r in range(nproc):
        devs = process_devices(plan, r)
        off = [d for d in devs if cluster.node_of(d) != r // per]
        if off:
            raise PlanError(
                f"{where}: process {r} runs on node {r // per} ({per} per node), but uses "
                f"device{'s' if len(off) > 1 else ''} {off} of node "
                f"{cluster.node_of(off[0])}; a process's devices must be on its node")
    return nnodes, per


def rdzv_id_of(plan: Plan) -> str:
    """A rendezvous id the same on every node for one plan (from its JSON)."""
    text = json.dumps(plan.to_json(), sort_keys=True, default=str)
    digest = hashlib.sha256(text.encode()).hexdigest()
    return f"autoplace-{digest[:12]}"


def torchrun_node_args(node: NodeLaunch) -> list[str]:
    """torchrun's options for this node's agent (instead of ``--standalone``)."""
    return [f"--nnodes={node.nnodes}", f"--node-rank={node.node_rank}",
            f"--nproc-per-node={node.nproc_per_node}", "--rdzv-backend=c10d",
            f"--rdzv-endpoint={node.rdzv_endpoint}", f"--rdzv-id={node.rdzv_id}",
            "--max-restarts=0"]


def node_commands(run_args: list[str], nnodes: int, nproc_per_node: int,
                  endpoint: str | None = None, rdzv_id: str = "autoplace") -> list[str]:
    """What to run on each node, for a reader: the ``autoplace run`` command of every
    node (``run_args``: the command as typed, without node options), and the torchrun
    command each starts."""
    endpoint = endpoint or f"{socket.gethostname()}:{DEFAULT_PORT}"
    check_endpoint(endpoint)
    base = " ".join(shlex.quote(a) for a in run_args)
    lines = [f"the plan fills {nnodes} nodes x {nproc_per_node} processes; start on every "
             f"node (the rendezvous {endpoint} is node 0's address, reachable from the "
             "others; --checkpoint-dir on a filesystem every node sees):"]
    for n in range(nnodes):
        lines.append(f"  node {n}: {base} --nnodes {nnodes} --node-rank {n} "
                     f"--rdzv-endpoint {endpoint} --rdzv-id {rdzv_id}")
    lines.append("each starts this node's torchrun agent: torchrun --nnodes "
                 f"{nnodes} --node-rank N --nproc-per-node {nproc_per_node} --rdzv-backend "
                 f"c10d --rdzv-endpoint {endpoint} --rdzv-id {rdzv_id} -m "
                 "autoplace.executor.worker --config RUN.json")
    return lines
