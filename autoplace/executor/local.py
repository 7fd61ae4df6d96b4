"""Local placement: any DAG placement of a captured graph inside one process.

:func:`build_local` turns the captured ``torch.fx.GraphModule`` and a plan into a
:class:`LocalProgram`: one new fx program that holds ``M`` copies of the graph (one
per microbatch), each op on its group's device, a ``.to(device)`` on every edge
that crosses devices (once per destination device), ops issued in an order that
interleaves devices and microbatches, and the batch-size-weighted sum of the
microbatch losses as its output. Because CUDA kernels launch asynchronously and
autograd runs backward on one thread per device, the devices work at once: a
GPipe inside one process, as torchgpipe does. Groups in ``plan.recompute`` (and
``plan.selective``) run under ``torch.utils.checkpoint`` (a selective policy) in convex
pieces (runs of consecutive ops of the group in the issue order); with
``parallel.compile`` every group runs in such pieces, each compiled
(:mod:`autoplace.executor.pieces`).

Parameters live on the device of the first op that uses them; an op on another
device gets them moved there (``.to`` keeps the autograd link, so gradients sum).
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.fx as fx
from torch import nn

from autoplace.capture import (
    body_on_device,
    fetch_attr,
    model_output,
    node_on_device,
    program_inputs,
)
from autoplace.executor.graphs import CUDA_GRAPHS_ENV as CUDA_GRAPHS_ENV
from autoplace.executor.graphs import GRAPH_WARMUP as GRAPH_WARMUP
from autoplace.executor.graphs import _Bound as _Bound
from autoplace.executor.graphs import _graph_units, _Graphed, graphs_from_env
from autoplace.executor.moves import COPY_STREAMS_ENV as COPY_STREAMS_ENV
from autoplace.executor.moves import (
    _call_module_on,
    _is_meta_op,
    _param_homes,
    copy_streams_from_env,
    move_to,
    move_to_streamed,
    place_parameters,
)
from autoplace.executor.moves import _CopyTo as _CopyTo
from autoplace.executor.moves import reflatten_rnns as reflatten_rnns
from autoplace.executor.pieces import canonical_piece, direct_children, piece
from autoplace.plan import Plan

__all__ = ["CUDA_GRAPHS_ENV", "LocalProgram", "build_local", "graphs_from_env",
           "move_to", "move_to_streamed", "split_value"]

_FREE_KINDS = {"input", "output", "param", "getitem", "getattr", "size", "view", "reshape",
               "permute", "transpose", "flatten", "unflatten", "contiguous", "squeeze",
               "unsqueeze", "expand"}


class _Loss(nn.Module):
    """The workload's loss on what the model returns (``restore``: from the value of the
    captured graph's output node, :func:`autoplace.capture.model_output`)."""

    def __init__(self, fn: Callable[[Any, torch.Tensor], torch.Tensor],
                 restore: Callable[[Any], Any] | None = None) -> None:
        super().__init__()
        self.fn = fn
        self.restore = restore

    def forward(self, output: Any, target: torch.Tensor) -> torch.Tensor:
        return self.fn(self.restore(output) if self.restore else output, target)


def split_value(value: Any, n: int) -> list[Any]:
    """``n`` equal pieces of a tensor along dim 0; any other value, ``n`` times."""
    if isinstance(value, torch.Tensor):
        return list(value.chunk(n)) if n > 1 else [value]
    return [value] * n


class LocalProgram(nn.Module):
    """A placed, microbatched training forward: ``program(inputs, targets) -> loss``.

    Attributes:
        program: the generated ``fx.GraphModule`` (its code shows the schedule).
        microbatches: number of microbatches the batch is cut into (dim 0).
        input_devices: device of every model input.
        target_device: device the loss is computed on.
        devices: the devices the program uses, by local index.
    """

    def __init__(self, program: fx.GraphModule, microbatches: int,
                 input_devices: list[torch.device], target_device: torch.device,
                 devices: list[torch.device],
                 flatten: Callable[[Sequence[Any]], list[Any]] = list) -> None:
        super().__init__()
        self.program = program
        self.flatten = flatten
        self.microbatches = microbatches
        self.input_devices = input_devices
        self.target_device = target_device
        self.devices = devices

    def forward(self, inputs: Sequence[torch.Tensor], targets: torch.Tensor) -> torch.Tensor:
        m = self.microbatches
        n = targets.shape[0]
        if n % m:
            raise ValueError(f"batch of {n} does not split into {m} equal microbatches")
        flat: list[Any] = []
        values = self.flatten(inputs)  # the captured graph's placeholders
        if len(values) != len(self.input_devices):
            raise ValueError(f"{len(values)} model inputs, the captured graph takes "
                             f"{len(self.input_devices)}")
        for x, dev in zip(values, self.input_devices):
            flat.extend(split_value(move_to(x, dev), m))
        flat.extend(targets.to(self.target_device).chunk(m) if m > 1
                    else [targets.to(self.target_device)])
        return self.program(*flat)


class _Builder:
    """Writes the placed program: values per (op, microbatch), transfers per device."""

    def __init__(self, gm: fx.GraphModule, dev_of: dict[str, int],
                 devices: list[torch.device]) -> None:
        self.gm = gm
        self.dev_of = dev_of
        self.devices = devices
        self.graph = fx.Graph()
        self.env: dict[tuple[str, int | None], fx.Node] = {}
        self.moved: dict[tuple[str, int | None, int], fx.Node] = {}
        self.attrs: dict[str, Any] = {}
        self.shared: set[str] = set()
        self.mover: Callable[[Any, torch.device], Any] = move_to

    def key(self, node: fx.Node, mb: int) -> tuple[str, int | None]:
        return (node.name, None if node.name in self.shared else mb)

    def value(self, node: fx.Node, mb: int, dev: int) -> fx.Node:
        k = self.key(node, mb)
        v = self.env[k]
        if self.dev_of[node.name] == dev:
            return v
        mk = (*k, dev)
        if mk not in self.moved:
            self.moved[mk] = self.graph.call_function(self.mover, (v, self.devices[dev]))
        return self.moved[mk]

    def copy(self, graph: fx.Graph, node: fx.Node, arg: Callable[[fx.Node], fx.Node],
             dev: int) -> fx.Node:
        """Copy ``node`` into ``graph`` on local device ``dev``."""
        if node.op == "call_module":
            mod = fetch_attr(self.gm, node.target)
            if self.module_home(node.target) not in (None, dev):
                self.attrs[node.target] = mod
                ref = graph.get_attr(node.target)
                args = fx.map_arg(node.args, arg)
                kwargs = fx.map_arg(node.kwargs, arg)
                return graph.call_function(
                    _call_module_on, (ref, self.devices[dev], *args), dict(kwargs))
            self.attrs[node.target] = mod
        elif node.op == "get_attr":  # a no_grad / autocast region's body: on its op's device
            user = next(iter(node.users), None)
            at = self.dev_of.get(user.name, dev) if user is not None else dev
            self.attrs[node.target] = body_on_device(fetch_attr(self.gm, node.target),
                                                     self.devices[at])
        new = graph.node_copy(node, arg)
        if node.op in ("call_function", "call_method"):
            node_on_device(new, self.devices[dev])
        return new

    homes: dict[int, int]

    def module_home(self, target: str) -> int | None:
        mod = fetch_attr(self.gm, target)
        homes = {self.homes.get(id(t)) for t in (*mod.parameters(), *mod.buffers())}
        homes.discard(None)
        if len(homes) > 1:
            return -1  # parameters spread over devices: always call with moved copies
        return next(iter(homes), None)


def build_local(
    gm: fx.GraphModule,
    plan: Plan,
    devices: list[torch.device],
    loss_fn: Callable[[Any, torch.Tensor], torch.Tensor],
    *,
    order: list[tuple[int, str]],
    microbatches: int | None = None,
    copy_streams: bool | None = None,
    graphs: bool | None = None,
    cuts: dict[str, str] | None = None,
) -> LocalProgram:
    """The placed program for ``gm`` under ``plan`` on ``devices`` (index = local device).

    Moves ``gm``'s parameters to their devices in place. ``order`` is the issue order
    of ``(microbatch, op)`` pairs (:func:`autoplace.lowering.issue_order`); get_attr ops are
    issued once, before everything else, and shared by all microbatches.
    ``copy_streams``: edges between GPUs use :func:`move_to_streamed` (default: whether
    the environment sets ``AUTOPLACE_COPY_STREAMS=1``; off otherwise).
    ``graphs``: each maximal run of ops on one device (consecutive in program order) of
    each microbatch is one :class:`_Graphed` piece, replayed as a CUDA graph after its
    first call on GPUs (eager on other devices), and the pieces are issued in a diagonal
    wavefront (:func:`_graph_units`) instead of ``order`` (default: whether the
    environment sets ``AUTOPLACE_CUDA_GRAPHS=1``). Not with recomputed groups. Under
    autocast, the caller must disable autocast's cache (``cache_enabled=False``).
    ``cuts``: for the ops that hold parameters, op name -> FSDP2 unit of a sharded plan
    (:attr:`autoplace.lowering.Lowering.unit_keys`): a piece (ops of one group run
    recomputed or compiled) ends before an op of another unit than its own (ops without
    parameters join the piece they follow), so each unit's block is a piece of its own
    that FSDP2 wraps whole (:func:`autoplace.executor.data.unit_members`), as torchtitan
    compiles and checkpoints each block inside its unit.
    """
    if copy_streams is None:
        copy_streams = copy_streams_from_env()
    if graphs is None:
        graphs = graphs_from_env()
    graphs = bool(graphs and not plan.recompute and not plan.selective
                  and not plan.parallel.compile)
    m = microbatches or plan.parallel.microbatches
    plan_dev = {n.name: plan.device_of(n.name) for n in gm.graph.nodes}
    homes = _param_homes(gm, plan_dev)
    place_parameters(gm, homes, devices)
    homes = _param_homes(gm, plan_dev)  # buffers may be new objects now

    b = _Builder(gm, {}, devices)
    b.homes = homes
    if copy_streams:
        b.mover = move_to_streamed
    dev_of = b.dev_of
    for node in gm.graph.nodes:  # actual device of each op's output
        if node.op == "get_attr":
            obj = fetch_attr(gm, node.target)
            t = obj if isinstance(obj, torch.Tensor) else next(
                iter([*obj.parameters(), *obj.buffers()]), None)
            dev_of[node.name] = homes.get(id(t), plan_dev[node.name]) if t is not None \
                else plan_dev[node.name]
            b.shared.add(node.name)
        elif _is_meta_op(node) and isinstance(node.args[0], fx.Node):
            dev_of[node.name] = dev_of[node.args[0].name]
        else:
            dev_of[node.name] = plan_dev[node.name]

    nodes = {n.name: n for n in gm.graph.nodes}
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    output = next(n for n in gm.graph.nodes if n.op == "output")
    g = b.graph
    # inputs first: every model input of every microbatch, then the targets
    for node in placeholders:
        for mb in range(m):
            ph = g.placeholder(f"{node.name}_mb{mb}")
            b.env[(node.name, mb)] = ph
    targets = [g.placeholder(f"target_mb{mb}") for mb in range(m)]
    for node in gm.graph.nodes:
        if node.op == "get_attr":
            b.env[(node.name, None)] = b.copy(g, node, lambda a: a, dev_of[node.name])

    rc = set(plan.recompute) | set(plan.selective)
    compiled = plan.parallel.compile
    pieced = set(plan.groups.values()) if compiled else rc  # groups run in pieces
    units: list[list[tuple[int, str]]] = []
    unit_of: list[str | None] = []  # per unit (a piece's ops), the FSDP2 unit of ``cuts``
    graphed: set[int] = set()  # indices of units that run as _Graphed pieces
    if graphs:
        for unit, whole in _graph_units(gm, b, m):
            if whole:
                graphed.add(len(units))
            units.append(unit)
    else:
        for mb, name in order:
            node = nodes[name]
            if node.op in ("placeholder", "get_attr", "output"):
                continue
            grp = plan.groups[name] if (plan.groups[name] in pieced and not _is_meta_op(node)) \
                else None
            last = units[-1] if units else None
            if (grp is not None and last and last[0][0] == mb
                    and plan.groups[last[0][1]] == grp and not _is_meta_op(nodes[last[0][1]])
                    and plan.groups[last[0][1]] in pieced
                    and (cuts is None or name not in cuts or unit_of[-1] in (None, cuts[name]))):
                last.append((mb, name))
                if cuts is not None and unit_of[-1] is None:
                    unit_of[-1] = cuts.get(name)
            else:
                units.append([(mb, name)])
                unit_of.append(cuts.get(name) if cuts is not None else None)

    out_dev = plan_dev[output.name]
    b.attrs["_loss"] = _Loss(loss_fn, lambda v, gm=gm: model_output(gm, v))
    out_nodes = [a.name for a in output.all_input_nodes]
    losses: dict[int, fx.Node] = {}

    def emit_losses() -> None:
        """The loss of every microbatch whose outputs exist, as soon as they do (a
        hand-written flow computes each microbatch's loss right after its forward)."""
        for mb in range(m):
            if mb not in losses and all(b.key(nodes[a], mb) in b.env for a in out_nodes):
                out = fx.map_arg(output.args[0], lambda a, mb=mb: b.value(a, mb, out_dev))
                losses[mb] = g.call_module("_loss", (out, targets[mb]))

    n_rc = 0
    made: dict[tuple[str, ...], str] = {}  # a piece's ops -> its module
    for i_unit, unit in enumerate(units):
        emit_losses()
        mb, first = unit[0]
        node = nodes[first]
        dev = dev_of[first]
        if i_unit not in graphed and len(unit) == 1 and (
                plan.groups[first] not in pieced or _is_meta_op(node)):
            if _is_meta_op(node):
                arg = lambda a, mb=mb: b.env[b.key(a, mb)]  # noqa: E731
            else:
                arg = lambda a, mb=mb, dev=dev: b.value(a, mb, dev)  # noqa: E731
            b.env[(first, mb)] = b.copy(g, node, arg, dev)
            continue
        # a piece: its own GraphModule, recomputed and/or compiled (or a CUDA graph)
        names = {n for _, n in unit}
        ext: list[fx.Node] = []
        for _, n in unit:
            for a in nodes[n].all_input_nodes:
                if a.name not in names and a not in ext:
                    ext.append(a)
        users = [nodes[n] for _, n in unit
                 if any(u.name not in names for u in nodes[n].users)]
        ops = tuple(n for _, n in unit)
        if i_unit not in graphed and ops in made:
            target = made[ops]  # the same ops for another microbatch: the same piece, whose
            # compiled code is then made once, not once per microbatch
        else:
            sub = fx.Graph()
            local: dict[str, fx.Node] = {a.name: sub.placeholder(a.name) for a in ext}
            for _, n in unit:
                local[n] = b.copy(sub, nodes[n], lambda a, local=local: local[a.name], dev)
            sub.output(tuple(local[u.name] for u in users))
            sub_gm, kind = canonical_piece(sub, b.attrs)
            if i_unit in graphed:
                target = f"_graphed{n_rc}"
                b.attrs[target] = _Graphed(sub_gm, devices[dev])
            else:
                grp = plan.groups[first]
                mode = "full" if grp in plan.recompute else \
                    "selective" if grp in plan.selective else None
                target = f"_recompute{n_rc}" if mode else f"_piece{n_rc}"
                b.attrs[target] = piece(sub_gm, mode, compiled, f"group {grp}", kind)
                made[ops] = target
        n_rc += 1
        call = g.call_module(target, tuple(b.value(a, mb, dev) for a in ext))
        for i, u in enumerate(users):
            b.env[(u.name, mb)] = g.call_function(operator.getitem, (call, i))

    emit_losses()
    total = losses[0] if m == 1 else g.call_function(operator.truediv, (losses[0], m))
    for loss in (losses[mb] for mb in range(1, m)):
        total = g.call_function(operator.add, (total, g.call_function(operator.truediv, (loss, m))))
    g.output(total)
    program = fx.GraphModule(dict(b.attrs), g)
    direct_children(program)
    input_devices = [devices[dev_of[p.name]] for p in placeholders]
    used = sorted(set(plan_dev.values()))
    return LocalProgram(program, m, input_devices, devices[out_dev], [devices[i] for i in used],
                        flatten=lambda xs, gm=gm: program_inputs(gm, xs))
