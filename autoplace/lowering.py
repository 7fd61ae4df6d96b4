"""How a plan runs: the one description the simulator and the executor both read.

As torch's pipelining keeps one action list that its runtime executes and its simulator
dry-runs, :func:`lower` is the only place that decides, for a ``(graph, plan)``:

* the pipeline stage of every op, and the parameters several stages use (tied weights,
  copied to each stage, their gradients summed over those stages);
* the forward issue order of ``(microbatch, op)`` in a one-process replica, honouring the
  plan's per-group issue priority (backward runs it reversed where ready, as autograd
  does);
* the action list of every pipeline stage (GPipe, 1F1B: ``"F0"``, ``"B0"``...), the same
  lists torch's ``ScheduleGPipe`` / ``Schedule1F1B`` run;
* the FSDP2 units of a sharded plan and the dtype their parameters are gathered in.

The simulator turns this into time and memory; the executor into processes, modules and
``fully_shard`` calls. A disagreement between them is then a cost-model error, never two
programs.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch.fx as fx
from torch import nn

from autoplace.capture import fetch_attr
from autoplace.capture.op_rules import ATTENTION_KINDS, CONV_KINDS, MATMUL_KINDS, RNN_GATES
from autoplace.errors import PlanError
from autoplace.graph import OpGraph
from autoplace.plan import Plan
from autoplace.tensor_shards import TensorShards, plan_tensor_shards

if TYPE_CHECKING:
    from autoplace.cluster import Cluster

__all__ = [
    "Lowering", "ROOT_UNIT", "SELECTIVE_SAVED_KINDS", "block_group_ids", "block_groups",
    "block_regions",
    "fsdp_unit_keys", "gather_dtype", "issue_order", "issue_order_items", "stage_recompute",
    "lower", "op_levels", "op_priority", "pipeline_actions", "stage_of_ops", "tied_parameters",
    "validate",
]

#: op kinds whose outputs a selective recompute keeps; the rest of a selectively
#: recomputed group runs again in backward (the executor's policy names the same kernels:
#: ``autoplace.executor.pieces.SELECTIVE_SAVED_OPS``)
SELECTIVE_SAVED_KINDS = MATMUL_KINDS | CONV_KINDS | ATTENTION_KINDS | frozenset(RNN_GATES)

#: the unit key of parameters FSDP2 shards with the root module (gathered when the step
#: starts and, as torch does for the root, kept until backward ends)
ROOT_UNIT = ""


@dataclass(frozen=True)
class Lowering:
    """How one plan runs on one graph.

    Attributes:
        plan: the plan lowered.
        order: forward issue order ``[(microbatch, op), ...]`` of one replica run in one
            process (``pipeline == 1``); empty for pipelines, whose order is ``actions``.
        actions: per pipeline stage, its action list (``["F0", "F1", "B0", ...]``).
        stage_of: op -> pipeline stage (pipelines; the local device otherwise).
        tied: parameter -> the pipeline stages that use it (more than one).
        unit_keys: op -> FSDP2 unit (:func:`fsdp_unit_keys`); empty unless sharded.
        gather_dtype: FSDP2's gather dtype (``"bfloat16"``), None for parameters as they are.
        stage_recompute: per pipeline stage, how it is recomputed: None, ``"full"`` or
            ``"selective"`` (a stage is recomputed whole or not at all).
        tensor: the Linear pairs ``parallel.tensor`` splits
            (:func:`autoplace.tensor_shards.plan_tensor_shards`); None without tensor parallel.
    """

    plan: Plan
    order: tuple[tuple[int, str], ...]
    actions: tuple[tuple[str, ...], ...]
    stage_of: dict[str, int]
    tied: dict[str, list[int]]
    unit_keys: dict[str, str]
    gather_dtype: str | None
    stage_recompute: tuple[str | None, ...] = ()
    tensor: TensorShards | None = None

    def module_units(self, graph: OpGraph) -> dict[str, str]:
        """Called module path -> its FSDP2 unit, for the modules not in the root's unit
        (what ``fully_shard`` wraps, unit by unit, before the root)."""
        return {op.target: self.unit_keys[op.name] for op in graph.ops
                if self.unit_keys.get(op.name, ROOT_UNIT) != ROOT_UNIT}

    def piece_cuts(self, graph: OpGraph) -> dict[str, str]:
        """Op name -> its FSDP2 unit, for the ops that hold parameters (the root's ones
        too): where a recomputed or compiled piece ends (``build_local``'s ``cuts``)."""
        return {op.name: self.unit_keys.get(op.name, ROOT_UNIT) for op in graph.ops
                if op.param_names}


def lower(graph: OpGraph, plan: Plan, cluster: Cluster | None = None, *,
          device_type: str = "cuda", validated: bool = False) -> Lowering:
    """Validate ``plan`` on ``graph`` (and ``cluster``) and describe how it runs.

    Args:
        graph: the captured graph; its fx module, where present, names the tensors that
            several pipeline stages share.
        plan: the plan.
        cluster: checked against the plan's device count when given.
        device_type: where it runs (FSDP2 gathers at the autocast dtype only on CUDA).
        validated: the caller has validated ``plan`` on the graph it was made for (the
            executor lowers a capture at the microbatch size, whose fingerprint differs).
    """
    if not validated:
        plan.validate(graph, cluster)
    par = plan.parallel
    modes: list[str | None] = []
    if par.pipeline > 1:
        stage, tied, modes = _check_pipeline(graph, plan)
        actions = tuple(tuple(pipeline_actions(par.schedule, par.pipeline, par.microbatches, s))
                        for s in range(par.pipeline))
        order: tuple[tuple[int, str], ...] = ()
    else:
        stage = {op: plan.device_of(op) for op in graph.order}
        tied, actions = {}, ()
        order = tuple(issue_order(graph, plan))
    sharded = par.shard != "none"
    keys = dict(zip(graph.order, fsdp_unit_keys(graph, par.shard_units))) if sharded else {}
    return Lowering(plan=plan, order=order, actions=actions, stage_of=stage, tied=tied,
                    unit_keys=keys,
                    gather_dtype=gather_dtype(graph, device_type) if sharded else None,
                    stage_recompute=tuple(modes), tensor=plan_tensor_shards(graph, plan))


def stage_recompute(plan: Plan) -> list[str | None]:
    """How each pipeline stage is recomputed (None, ``"full"``, ``"selective"``); raises
    :class:`PlanError` for a stage whose groups are recomputed in different ways."""
    out = []
    for s in range(plan.parallel.pipeline):
        modes = {"full" if g in plan.recompute else "selective" if g in plan.selective else None
                 for g, d in enumerate(plan.placement) if d == s}
        if len(modes) > 1:
            raise PlanError(
                f"pipeline stage {s} recomputes some of its groups and not others "
                f"({', '.join(sorted(str(m or 'none') for m in modes))}); a stage runs whole "
                "under one recompute mode: put all of its groups in recompute, in selective, "
                "or in neither")
        out.append(modes.pop() if modes else None)
    return out


def validate(graph: OpGraph, plan: Plan, cluster: Cluster | None = None) -> None:
    """:meth:`Plan.validate` and the checks that need the graph's fx module: a buffer used
    by several pipeline stages, tied weights under a sharded pipeline, the Linear pairs
    of a tensor-parallel plan."""
    plan.validate(graph, cluster)
    if plan.parallel.pipeline > 1:
        _check_pipeline(graph, plan)
    plan_tensor_shards(graph, plan)


def _check_pipeline(graph: OpGraph, plan: Plan
                    ) -> tuple[dict[str, int], dict[str, list[int]], list[str | None]]:
    """A pipeline plan's stage of each op, tied parameters and per-stage recompute, after
    the checks they allow: one recompute mode per stage, no buffer on several stages, no
    tied weights under a sharded pipeline."""
    modes = stage_recompute(plan)
    gm = graph.module
    if gm is None:
        return {op: plan.device_of(op) for op in graph.order}, {}, modes
    stage, tied = _stages_and_ties(gm, plan)
    if tied and plan.parallel.shard != "none":
        name, stages = next(iter(tied.items()))
        raise PlanError(
            f"parameter {name!r} is used by pipeline stages {stages} (tied weights), "
            f"which parallel.shard={plan.parallel.shard!r} cannot keep equal; use "
            "shard='none' with this pipeline, or put those ops on one stage"
        )
    return stage, tied, modes


# ------------------------------------------------------------------ issue order
def op_levels(preds: list[list[int]], dev: list[int]) -> list[int]:
    """Wavefront level of each op (ops in topological order, ``preds`` their producers'
    indices): rank of its device in order of first use, raised to the level of any
    producer so that sorting by level keeps producers first."""
    first: dict[int, int] = {}
    for i, j in enumerate(dev):
        first.setdefault(j, i)
    rank = {j: r for r, j in enumerate(sorted(first, key=first.__getitem__))}
    level = [0] * len(dev)
    for i in range(len(dev)):
        lv = rank[dev[i]]
        for u in preds[i]:
            if level[u] > lv:
                lv = level[u]
        level[i] = lv
    return level


def issue_order_items(preds: list[list[int]], dev: list[int], m: int,
                      priority: list[int] | None = None) -> list[int]:
    """Forward issue order as items ``mb * n + op``: sorted by ``(mb + level, mb, op)``.

    Within a wavefront step the earlier microbatch goes first: the next device's part of
    microbatch ``i`` is issued before this device's part of ``i + 1``, as a hand-written
    flow does; when issuing the ops takes the host about as long as the GPUs take to run
    them, this starts the second device earlier (docs/executor.md).

    With ``priority`` (one integer per op, lower first) the order is list scheduling: at
    every step the device whose turn it is under the rule above (the device of the ready
    item with the smallest key) issues, among its ready items, the one of the lowest
    priority (ties by the key). Equal priorities give the sorted order exactly.
    """
    n = len(dev)
    level = op_levels(preds, dev)
    if priority is None:
        return sorted(range(m * n), key=lambda it: (it // n + level[it % n], it // n, it % n))
    if len(priority) != n:
        raise PlanError(f"issue priority has {len(priority)} entries for {n} ops")
    return _prioritised_items(preds, dev, m, priority, level)


def _prioritised_items(preds: list[list[int]], dev: list[int], m: int, priority: list[int],
                       level: list[int]) -> list[int]:
    """:func:`issue_order_items` under a priority: list scheduling over ready items (an
    item is ready once its producers in the same microbatch are issued)."""
    n = len(dev)
    succs: list[list[int]] = [[] for _ in range(n)]
    for v in range(n):
        for u in preds[v]:
            succs[u].append(v)
    waiting = [len(preds[i % n]) for i in range(m * n)]
    issued = [False] * (m * n)
    ready_all: list[tuple[int, int, int, int]] = []  # (wavefront key..., item)
    ready_dev: dict[int, list[tuple[int, int, int, int, int]]] = {d: [] for d in set(dev)}

    def push(it: int) -> None:
        mb, op = divmod(it, n)
        key = (mb + level[op], mb, op)
        heapq.heappush(ready_all, (*key, it))
        heapq.heappush(ready_dev[dev[op]], (priority[op], *key, it))

    for it in range(m * n):
        if not waiting[it]:
            push(it)
    out: list[int] = []
    while ready_all:
        if issued[ready_all[0][-1]]:
            heapq.heappop(ready_all)
            continue
        queue = ready_dev[dev[ready_all[0][-1] % n]]
        it = heapq.heappop(queue)[-1]  # never issued: items leave a device queue only here
        issued[it] = True
        out.append(it)
        base = it - it % n
        for v in succs[it % n]:
            waiting[base + v] -= 1
            if not waiting[base + v]:
                push(base + v)
    return out


def issue_order(graph: OpGraph, plan: Plan) -> list[tuple[int, str]]:
    """Forward issue order ``[(microbatch, op name), ...]`` of a one-process replica.

    Sorted by ``(microbatch + level(op), microbatch, topological index)`` where ``level``
    is the rank of the op's device in order of first use, raised to the largest level of
    its producers (every producer is issued before its consumers, even when a placement
    returns to an earlier device); within a wavefront step the earlier microbatch first.
    With ``plan.priority``, each device issues, among its ready ops, those of the group
    with the lowest priority first (list scheduling, :func:`issue_order_items`); the
    interleaving of devices stays the wavefront's. The executor builds its program in this
    order. Backward is autograd's: one thread per device takes, among its ready nodes, the
    one created last in forward; the simulator assumes exactly that
    (:func:`autoplace.sim.local.backward_issue`), so a priority reorders the backward too,
    reversed.
    """
    names = graph.order
    idx = graph.index
    preds: list[list[int]] = [[] for _ in names]
    for u, v, _ in graph.edges:
        preds[idx[v]].append(idx[u])
    dev = [plan.device_of(op) for op in names]
    n = len(names)
    m = plan.parallel.microbatches
    return [(it // n, names[it % n])
            for it in issue_order_items(preds, dev, m, op_priority(graph, plan))]


def op_priority(graph: OpGraph, plan: Plan) -> list[int] | None:
    """Each op's issue priority (graph order): its group's in ``plan.priority``; None when
    the plan sets none."""
    if not plan.priority:
        return None
    return [plan.priority[plan.groups[op]] for op in graph.order]


# --------------------------------------------------------------------- pipeline
def pipeline_actions(schedule: str, stages: int, microbatches: int, stage: int) -> list[str]:
    """Action order of one pipeline stage, like ``["F0", "F1", "B0", "F2", "B1", "B2"]``:
    the forward (``F``) and full backward (``B``) actions torch's ``ScheduleGPipe`` /
    ``Schedule1F1B`` run on that stage, in their order."""
    m = microbatches
    if schedule == "gpipe":
        return [f"F{i}" for i in range(m)] + [f"B{i}" for i in range(m)]
    if schedule == "1f1b":
        warm = min(m, stages - stage - 1)
        acts = [f"F{i}" for i in range(warm)]
        for i in range(m - warm):
            acts += [f"F{warm + i}", f"B{i}"]
        acts += [f"B{i}" for i in range(m - warm, m)]
        return acts
    raise PlanError(f"unknown pipeline schedule {schedule!r}; valid: gpipe, 1f1b")


def stage_of_ops(gm: fx.GraphModule, plan: Plan) -> dict[str, int]:
    """op name -> stage; placeholders are inputs of stage 0, get_attr ops go with their users.

    A parameter several stages use (tied input and output embeddings) is copied to each:
    :func:`tied_parameters` names them and the executor sums their gradients over those
    stages after every step (as Megatron-LM does for a GPT's tied embeddings), so the copies
    stay equal. A buffer used by several stages is refused: each copy would change on its
    own (a BatchNorm's running statistics).
    """
    return _stages_and_ties(gm, plan)[0]


def tied_parameters(gm: fx.GraphModule, plan: Plan) -> dict[str, list[int]]:
    """Qualified name -> the stages (more than one) whose ops use that parameter."""
    _, owners = _stages_and_owners(gm, plan)
    return _ties(_tensor_names(gm)["param"], owners)


def _stages_and_ties(gm: fx.GraphModule, plan: Plan
                     ) -> tuple[dict[str, int], dict[str, list[int]]]:
    """:func:`stage_of_ops` and :func:`tied_parameters` from one walk of ``gm``."""
    stage, owners = _stages_and_owners(gm, plan)
    names = _tensor_names(gm)
    for t, s in owners.items():
        if len(s) > 1 and t not in names["param"]:
            raise PlanError(
                f"buffer {names['buffer'].get(t, '?')!r} is used by pipeline stages "
                f"{sorted(s)}; a buffer cannot be kept equal on several stages, so the ops "
                "that use it must be on one stage"
            )
    return stage, _ties(names["param"], owners)


def _ties(params: dict[int, str], owners: dict[int, set[int]]) -> dict[str, list[int]]:
    return {params[t]: sorted(s) for t, s in owners.items() if len(s) > 1 and t in params}


def _stages_and_owners(gm: fx.GraphModule, plan: Plan) -> tuple[dict[str, int], dict[int, set[int]]]:
    stage: dict[str, int] = {}
    for n in gm.graph.nodes:
        if n.op == "placeholder":
            stage[n.name] = 0
        elif n.op != "get_attr":
            stage[n.name] = plan.device_of(n.name)
    owners: dict[int, set[int]] = {}
    for n in gm.graph.nodes:
        if n.op == "get_attr":
            users = {stage[u.name] for u in n.users}
            stage[n.name] = min(users) if users else 0
            for t in _tensors_of(gm, n.target):
                owners.setdefault(t, set()).update(users)
        elif n.op == "call_module":
            for t in _tensors_of(gm, n.target):
                owners.setdefault(t, set()).add(stage[n.name])
    return stage, owners


def _tensor_names(gm: fx.GraphModule) -> dict[str, dict[int, str]]:
    """id -> qualified name of ``gm``'s parameters (``"param"``) and buffers (``"buffer"``)."""
    return {"param": {id(p): n for n, p in gm.named_parameters(remove_duplicate=True)},
            "buffer": {id(b): n for n, b in gm.named_buffers(remove_duplicate=True)}}


def _tensors_of(gm: fx.GraphModule, target: str) -> list[int]:
    """ids of the parameters (and a module's buffers) behind a get_attr / call_module target."""
    obj = fetch_attr(gm, target)
    if isinstance(obj, nn.Module):
        return [id(t) for t in (*obj.parameters(), *obj.buffers())]
    return [id(obj)] if isinstance(obj, nn.Parameter) else []


# ------------------------------------------------------------------------- FSDP2
def fsdp_unit_keys(graph: OpGraph, units: str = "blocks") -> list[str]:
    """The FSDP2 unit of every op (graph order): a module path, or :data:`ROOT_UNIT`.

    One rule, from the captured graph alone. A *block* is a module path ending in an
    integer index (a child of an ``nn.ModuleList`` / ``nn.Sequential``). A called module
    (a ``call_module`` op) is a unit member when it has parameters, none of them shared
    with another op or read directly (tied weights stay in the root), and it is not inside
    another called module. A member belongs to the deepest block strictly around it, all
    the block's members forming one unit (one all-gather when the first runs); a member
    that is itself a block and has none around it is a unit of its own; with
    ``units="modules"`` every other member is a unit of its own too. Everything else —
    parameters read directly, shared, or of modules outside any block — is the root's.
    A graph captured by torch.export calls no submodules: all of it is the root.
    """
    uses: dict[str, int] = {}
    direct: set[str] = set()
    for op in graph.ops:
        for p in op.param_names:
            uses[p] = uses.get(p, 0) + 1
            if op.kind == "param":
                direct.add(p)
    called = {op.target for op in graph.ops if _is_module_call(op)}

    def member(op: Any) -> bool:
        if not (_is_module_call(op) and op.param_names):
            return False
        parts = op.target.split(".")
        if any(".".join(parts[:i]) in called for i in range(1, len(parts))):
            return False  # inside another called module
        return not any(uses[p] > 1 or p in direct for p in op.param_names)

    keys = []
    for op in graph.ops:
        key = ROOT_UNIT
        if member(op):
            parts = op.target.split(".")
            around = [".".join(parts[:i + 1]) for i in range(len(parts) - 1) if parts[i].isdigit()]
            if around:
                key = around[-1]
            elif parts[-1].isdigit() or units == "modules":
                key = op.target
        keys.append(key)
    return keys


def _is_module_call(op: Any) -> bool:
    return op.kind not in ("input", "param", "output") and bool(op.target) \
        and op.target == op.module_path


def gather_dtype(graph: OpGraph, device_type: str = "cuda") -> str | None:
    """FSDP2's gather dtype: the workload's autocast dtype where it autocasts (CUDA).

    None (parameters gathered as they are) for a graph captured by torch.export: it keeps
    dtype-dependent constants of the capture (Hugging Face T5 fills masks with float32's
    minimum, which a bf16 tensor cannot hold)."""
    if graph.capture_method == "export" or device_type != "cuda":
        return None
    return graph.autocast_dtype or None


# ---------------------------------------------------------------------- regions
def block_regions(graph: OpGraph) -> list[str]:
    """The block each op belongs to (graph order): its module path up to the first integer
    index (``"blocks.3.attn.qkv"`` -> ``"blocks.3"``: a transformer block, an LSTM layer of
    a ``ModuleList``, an Inception module of an ``nn.Sequential``), or ``""`` outside any."""
    out = []
    for op in graph.ops:
        parts = op.module_path.split(".") if op.module_path else []
        cut = next((i for i, p in enumerate(parts) if p.isdigit()), None)
        out.append(".".join(parts[:cut + 1]) if cut is not None else "")
    return out


def block_groups(graph: OpGraph) -> dict[str, int]:
    """Op groups that are the graph's blocks: every maximal run of consecutive ops (graph
    order) in one block is a group, and so is every run between blocks. With these groups
    a plan checkpoints or compiles block by block, as a hand-written per-block recipe does.
    Parameter fetches and inputs join the group of their first user."""
    regions = block_regions(graph)
    idx = graph.index
    first_user: dict[str, int] = {}
    for u, v, _ in graph.edges:
        first_user[u] = min(first_user.get(u, len(graph)), idx[v])
    region_of = list(regions)
    for i, op in enumerate(graph.ops):
        if op.kind in ("input", "param") and op.name in first_user:
            region_of[i] = regions[first_user[op.name]]
    groups: dict[str, int] = {}
    last, gid = None, -1
    for i, op in enumerate(graph.ops):
        if op.kind in ("input", "param"):
            continue
        if region_of[i] != last:
            gid += 1
            last = region_of[i]
        groups[op.name] = gid
    for op in graph.ops:  # inputs and fetches: with their first user
        if op.name not in groups:
            groups[op.name] = groups[graph.order[first_user[op.name]]] \
                if op.name in first_user else 0
    return groups


def block_group_ids(graph: OpGraph, groups: dict[str, int]) -> set[int]:
    """The groups of :func:`block_groups` that hold a block's ops (the rest run between
    blocks: embeddings, a head, the loss)."""
    regions = dict(zip(graph.order, block_regions(graph)))
    return {g for op, g in groups.items() if regions[op]}
