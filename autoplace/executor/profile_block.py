"""Profile a block region on the machine under the levers: compiled, and recomputed.

The simulator prices a compiled plan's fused ops (everything but matmuls, convolutions,
attention and recurrent kernels) at a factor of their eager time
(:mod:`autoplace.sim.compiled`); without a measurement that factor is a default from one
model's kernel traces. :func:`profile_block` measures it for the graph at hand: the
first of the model's blocks (:func:`autoplace.lowering.block_groups`) is cut out of the
captured program as the executor cuts a piece (:func:`autoplace.executor.pieces.canonical_piece`,
the same code path a plan runs), fed the values it receives in a real forward of the
example batch, and its forward + backward is timed eager, compiled (``torch.compile``, the
backend a run uses), under a full checkpoint and under the selective one
(:class:`autoplace.executor.pieces.Piece`), interleaved, each the fastest of ``repeats``
timed loops after warm-up (the median on a CPU).

- Compiled: with ``ratio = compiled / eager`` and ``heavy`` the share of the block's profiled
  time in kept kernels (which compile leaves to the same libraries), the fused ops' factor
  is ``(ratio - heavy) / (1 - heavy)``, clipped to ``[0.05, 2]``.
- Recomputed: what a checkpoint adds to the block's step beyond eager
  (``full_host_s``, ``selective_host_s``), and inside a compiled piece beyond the compiled
  block (``compiled_full_host_s``). Where the model has several blocks, the first
  :data:`GRAPHED_BLOCKS` also run in turn, a piece each as a plan runs them, in every form
  (and the compiled ratio below is what the added blocks cost, so the fixed cost of one
  forward + backward call, which one block timed alone carries in every form, does not
  count as compiling's). The one block and the chain give checkpointing's cost per
  checkpoint call and per op (``*_call_host_s``, ``*_host_s``:
  :func:`autoplace.costs.block_costs.checkpoint_costs`; per op alone where the blocks are
  all of one size). On a launch-bound model that is host time (the forward issued again,
  and ``torch.utils.checkpoint``'s hooks; a selective policy also runs every op of the
  region through a Python dispatch mode, forward and recompute): the simulator adds it to
  the issuing thread's time of every recomputed region and op
  (:mod:`autoplace.sim.block_profile`). On a device-bound model it is about the forward's
  device time, which the issuing thread then spends in parallel with the device.

- CUDA graphs (on a GPU): the first block, and the first :data:`GRAPHED_BLOCKS` blocks as
  one piece, replayed as a CUDA graph (the executor's
  :class:`~autoplace.executor.graphs._Graphed`). A replay has a fixed cost (the autograd
  call, copies into the static inputs, two graph launches) that a plan's piece pays once,
  however many blocks it holds; so ``device_share`` (at most 1), what is left of the
  profiled op times when nothing is issued op by op, is the graph's time per added block
  (the two graphs' difference over the blocks added) over those blocks' profiled op
  times (each block at the mean of the graph's blocks of its structure). One block on its
  own (the graph has one) gives the single block's graph over its eager time.

The results are written into the graph's cached profile record (``"compiled"``,
``"recompute"``, ``"graphs"``) and so reach every later simulation of this graph on this device kind;
the op profile must be there first (:func:`autoplace.costs.profile.profile`).
"""

from __future__ import annotations

import contextlib
import copy
import os
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import fx, nn
from torch.utils import _pytree as pytree

from autoplace.capture import fetch_attr, program_inputs
from autoplace.costs.block_costs import checkpoint_costs
from autoplace.costs.profile import device_kind
from autoplace.costs.profile_cache import record_block
from autoplace.costs.timing import _grad_outputs, _sync, _time_call
from autoplace.errors import AutoplaceError
from autoplace.executor.graphs import _Graphed
from autoplace.executor.pieces import COMPILE_BACKEND_ENV, canonical_piece, piece
from autoplace.graph import OpGraph
from autoplace.lowering import SELECTIVE_SAVED_KINDS, block_group_ids, block_groups

__all__ = ["block_ops", "describe", "profile_block"]

FUSED_TIME_RANGE = (0.05, 2.0)
#: blocks replayed as one CUDA graph beside the first block alone (fewer where the graph
#: has fewer)
GRAPHED_BLOCKS = 8
#: the parts of a record the profile cache keeps
PARTS = ("compiled", "recompute", "graphs")
#: the forms a block is timed in: its checkpoint mode and whether it is compiled
FORMS = {"eager": (None, False), "full": ("full", False), "selective": ("selective", False),
         "compiled": (None, True), "compiled_full": ("full", True)}


def block_ops(graph: OpGraph, blocks: int = 1) -> list[str]:
    """The ops of the graph's first ``blocks`` blocks that do work (no inputs or parameter
    fetches), in graph order; empty when the graph has no blocks."""
    groups = block_groups(graph)
    ids = set(sorted(block_group_ids(graph, groups))[:blocks])
    return [op.name for op in graph.ops
            if groups[op.name] in ids and op.kind not in ("input", "param", "output")]


def profile_block(graph: OpGraph, inputs: tuple, device: str | torch.device, *,
                  autocast_dtype: str | None = None, repeats: int = 5,
                  cache_dir: str | Path | None = None) -> dict[str, Any] | None:
    """Measure the graph's first block eager, compiled, recomputed and (on a GPU) as a
    CUDA graph on ``device``; ``{"compiled": {...}, "recompute": {...}, "graphs": {...}}``
    (``compiled`` None where its compile failed, ``graphs`` None off GPUs or where the
    capture failed), also set in ``graph.profile_info[kind]`` and, with ``cache_dir``, in the
    graph's cached profile record. None when the graph has no blocks or its op profile
    for this device kind is missing."""
    dev = torch.device(device)
    kind = device_kind(dev)
    names = block_ops(graph)
    if not names or any(kind not in graph[n].fwd_time_s for n in names):
        return None
    if graph.module is None:
        raise AutoplaceError(f"graph {graph.name!r} has no module to run; profile a "
                             "freshly captured workload")
    gm = copy.deepcopy(graph.module).to(dev)
    flat = tuple(program_inputs(graph.module, pytree.tree_map(
        lambda t: t.to(dev) if isinstance(t, torch.Tensor) else t, inputs)))
    # no autocast cache: each call casts its weights, as a training step does (and CUDA
    # graph capture requires it)
    cast = (torch.autocast(dev.type, dtype=getattr(torch, autocast_dtype), cache_enabled=False)
            if autocast_dtype and dev.type == "cuda" else contextlib.nullcontext())
    sub_gm, code, values = _block_piece(gm, flat, names, cast)
    forms = {f: _form(sub_gm, code, f) for f in ("eager", "full", "selective")}
    compiled = _form(sub_gm, code, "compiled")
    with cast:
        t0 = time.perf_counter()
        _fwd_bwd(compiled, values)()  # compiles forward and backward
        compile_s = time.perf_counter() - t0
        if not compiled.failed:
            forms["compiled"] = compiled
            both = _form(sub_gm, code, "compiled_full")
            _fwd_bwd(both, values)()
            if not both.failed:
                forms["compiled_full"] = both
        many = block_ops(graph, GRAPHED_BLOCKS)
        groups = block_groups(graph)
        if dev.type == "cuda":
            forms["graphed"] = _Graphed(sub_gm, dev)
        chained: dict[str, nn.Module] = {}
        if len(many) > len(names):
            many_gm, _, many_values = _block_piece(gm, flat, many, cast)
            if dev.type == "cuda":
                chained["graphed"] = _Graphed(many_gm, dev)
            chained.update(_chains(gm, groups, many, [m for m in forms if m != "graphed"]))
        fns = [_fwd_bwd(m, values) for m in forms.values()] + \
            [_fwd_bwd(m, many_values) for m in chained.values()]
        measured = _timed_pair(fns, dev, repeats)
        times = dict(zip(forms, measured))
        many_times = dict(zip(chained, measured[len(forms):]))
    eager_s = times["eager"]
    graphed = forms.get("graphed")
    rec: dict[str, Any] = {"compiled": None, "graphs": None, "recompute": {
        "eager_s": eager_s, "full_s": times["full"], "selective_s": times["selective"],
        "full_host_s": max(0.0, times["full"] - eager_s) / len(names),
        "selective_host_s": max(0.0, times["selective"] - eager_s) / len(names),
        "block_ops": len(names)}}
    if "compiled_full" in times:  # checkpointed inside a compiled piece
        rec["recompute"]["compiled_full_s"] = times["compiled_full"]
        rec["recompute"]["compiled_full_host_s"] = max(
            0.0, times["compiled_full"] - times["compiled"]) / len(names)
    blocks = len({groups[n] for n in many})
    added = len(many) - len(names)
    # the first blocks chained as a plan runs them (a piece each): what each added block
    # costs, without the fixed cost of one forward + backward call that one block alone
    # also carries
    delta = {m: many_times[m] - times[m] for m in many_times if m != "graphed"}
    if "eager" in delta and added > 0:
        rec["recompute"].update({"blocks": blocks, "chain_ops": len(many),
                                 **{f"{m}_blocks_s": many_times[m] for m in delta}})
    if _replayed(graphed):
        rec["graphs"] = {"graphed_s": times["graphed"], "eager_s": eager_s,
                         "device_share": min(1.0, times["graphed"] / eager_s), "blocks": 1}
        if _replayed(chained.get("graphed")):
            op_s = _typical_ops_s(graph, groups, kind,
                                  [n for n in many if n not in set(names)])
            per = max(0.0, many_times["graphed"] - times["graphed"])
            rec["graphs"].update({
                "blocks": blocks, "graphed_blocks_s": many_times["graphed"],
                "added_ops_s": op_s,
                "device_share": min(1.0, per / op_s) if op_s > 0 else 1.0})
    elif graphed is not None:
        rec["graphs_failed"] = graphed.failed or "the block was never captured"
    if "compiled" in times:
        tot = heavy = 0.0
        for n in names:
            op = graph[n]
            t = op.fwd_time_s[kind] + op.bwd_time_s.get(kind, 0.0)
            tot += t
            heavy += t if op.kind in SELECTIVE_SAVED_KINDS else 0.0
        share = heavy / tot if tot > 0 else 0.0
        ratio = times["compiled"] / eager_s
        if "compiled" in delta and delta.get("eager", 0.0) > 0:  # per added block
            ratio = max(0.0, delta["compiled"]) / delta["eager"]
        fused = (ratio - share) / (1.0 - share) if share < 0.95 else ratio
        lo, hi = FUSED_TIME_RANGE
        rec["compiled"] = {
            "fused_time": min(max(fused, lo), hi), "ratio": ratio, "heavy_share": share,
            "eager_s": eager_s, "compiled_s": times["compiled"], "compile_s": compile_s,
            "block_ops": len(names),
            **({"blocks": blocks, "compiled_blocks_s": many_times["compiled"],
                "eager_blocks_s": many_times["eager"]} if "compiled" in delta else {}),
            "backend": os.environ.get(COMPILE_BACKEND_ENV) or "inductor"}
    # checkpointing's price per call and per op, from the one block and the chain
    rec["recompute"].update(checkpoint_costs(rec["recompute"], rec["compiled"],
                                             rec["recompute"].get("chain_ops")))
    info = dict(getattr(graph, "profile_info", None) or {})
    info[kind] = {**info.get(kind, {}), **{k: v for k, v in rec.items()
                                           if v is not None and k in PARTS}}
    graph.profile_info = info
    if cache_dir is not None:
        record_block(cache_dir, graph, kind, {k: rec[k] for k in PARTS})
    return rec


def describe(rec: dict[str, Any] | None) -> str:
    """One line on a :func:`profile_block` result."""
    if rec is None:
        return "not measured (no blocks in the graph, or no op profile on this device)"
    r, c, g = rec["recompute"], rec.get("compiled"), rec.get("graphs")
    ms = 1e3
    chain = (f"; the first {r['blocks']} blocks in turn: {r['eager_blocks_s'] * ms:.3f} "
             f"eager, {r['full_blocks_s'] * ms:.3f} checkpointed, "
             f"{r['selective_blocks_s'] * ms:.3f} selective" + (
                 f", {r['compiled_blocks_s'] * ms:.3f} compiled" if "compiled_blocks_s" in r
                 else "")) if "full_blocks_s" in r and "selective_blocks_s" in r else ""
    return (f"{r['block_ops']} ops, fwd+bwd {r['eager_s'] * ms:.3f} ms eager, "
            f"{r['full_s'] * ms:.3f} checkpointed, {r['selective_s'] * ms:.3f} selective, " + (
                f"{c['compiled_s'] * ms:.3f} compiled (fused ops at {c['fused_time']:.2f}x "
                f"eager; compiled in {c['compile_s']:.1f} s)" if c else
                "compile failed (compiled plans priced at the default factor)") + (
                f", {g['graphed_s'] * ms:.3f} as a CUDA graph" + (
                    f" ({g['graphed_blocks_s'] * ms:.3f} for {g['blocks']} blocks: "
                    f"{g['device_share']:.2f} of their op times)" if "graphed_blocks_s" in g
                    else "") if g else
                f", no CUDA graph ({rec['graphs_failed']})" if rec.get("graphs_failed") else "")
            + chain)


def _chains(gm: fx.GraphModule, groups: dict[str, int], many: list[str],
            modes: list[str]) -> dict[str, nn.Module]:
    """The blocks (``groups``: :func:`autoplace.lowering.block_groups`) holding ``many`` run
    one after another, each as the executor runs a block's piece, per form of ``modes``
    (:data:`FORMS`): a :class:`_Chain` each, fed the values the blocks read from outside."""
    parts = []
    for g in sorted({groups[n] for n in many}):
        names = {n for n in many if groups[n] == g}
        sub_gm, code, ext = _piece_of(gm, names)
        parts.append((sub_gm, code, [a.name for a in ext],
                      [n.name for n in _used_outside(gm, names)]))
    _, ext_all = _cut(gm, set(many))
    final = [n.name for n in _used_outside(gm, set(many))]
    return {m: _Chain([_form(sub_gm, code, m) for sub_gm, code, _, _ in parts],
                      [(ins, outs) for _, _, ins, outs in parts],
                      [a.name for a in ext_all], final)
            for m in modes if m in FORMS}


def _form(sub_gm: fx.GraphModule, code: str, form: str) -> nn.Module:
    """A block's piece in one of :data:`FORMS` (compiled pieces of one code share their
    compiled graph)."""
    mode, compiled = FORMS[form]
    return piece(sub_gm, mode, compiled, "profiled block",
                 kind=("profile", code) if compiled else None)


class _Chain(nn.Module):
    """Pieces run in turn, each reading its inputs by name from the values fed in and the
    outputs of the pieces before it; returns the values used past the last piece."""

    def __init__(self, pieces: list[nn.Module], io: list[tuple[list[str], list[str]]],
                 inputs: list[str], outputs: list[str]) -> None:
        super().__init__()
        self.pieces = nn.ModuleList(pieces)
        self.io, self.inputs, self.outputs = io, inputs, outputs

    def forward(self, *values: Any) -> tuple[Any, ...]:
        env = dict(zip(self.inputs, values))
        for p, (ins, outs) in zip(self.pieces, self.io):
            res = p(*[env[n] for n in ins])
            env.update(zip(outs, res if isinstance(res, (tuple, list)) else (res,)))
        return tuple(env[n] for n in self.outputs)


def _typical_ops_s(graph: OpGraph, groups: dict[str, int], kind: str,
                   names: list[str]) -> float:
    """Profiled seconds (forward + backward) of the blocks holding ``names``, each block
    taken at the mean of every block of the graph with its structure (op kinds and output
    shapes): launch-bound op profiles scatter by tens of percent between copies of one
    block, and the graphed share is applied to all of them."""
    ids = block_group_ids(graph, groups)
    ops: dict[int, list[Any]] = {}
    for op in graph.ops:
        if groups[op.name] in ids and op.kind not in ("input", "param", "output"):
            ops.setdefault(groups[op.name], []).append(op)
    by_sig: dict[tuple, list[float]] = {}
    sig_of = {}
    for g, members in ops.items():
        sig_of[g] = tuple((op.kind, op.output_shapes) for op in members)
        by_sig.setdefault(sig_of[g], []).append(sum(
            op.fwd_time_s.get(kind, 0.0) + op.bwd_time_s.get(kind, 0.0) for op in members))
    wanted = {groups[n] for n in names}
    return sum(statistics.fmean(by_sig[sig_of[g]]) for g in wanted)


def _replayed(graphed: _Graphed | None) -> bool:
    return graphed is not None and graphed.failed is None and graphed._replay is not None


def _block_piece(gm: fx.GraphModule, flat: Sequence[Any], names: list[str],
                 cast: Any) -> tuple[fx.GraphModule, str, list[Any]]:
    """The ops ``names`` of ``gm`` cut out as the executor's piece (its module and code key)
    and the values it receives in a forward of ``gm`` on ``flat``."""
    sub_gm, code, ext = _piece_of(gm, set(names))
    with cast:
        values = _values_of(gm, flat, ext)
    return sub_gm, code, values


def _piece_of(gm: fx.GraphModule, names: set[str]
              ) -> tuple[fx.GraphModule, str, list[fx.Node]]:
    """The ops ``names`` of ``gm`` as the executor's piece (its module and code key) and
    the outside nodes it reads (:func:`_cut`)."""
    sub, ext = _cut(gm, names)
    attrs = {n.target: fetch_attr(gm, n.target) for n in sub.nodes
             if n.op in ("call_module", "get_attr")}
    sub_gm, code = canonical_piece(sub, attrs)
    return sub_gm, code, ext


def _cut(gm: fx.GraphModule, names: set[str]) -> tuple[fx.Graph, list[fx.Node]]:
    """The nodes ``names`` of ``gm`` as a graph of their own: a placeholder per value they
    read from outside, an output of every value used outside; and those outside nodes."""
    sub = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    ext: list[fx.Node] = []
    inside = [n for n in gm.graph.nodes if n.name in names]
    for n in inside:
        for a in n.all_input_nodes:
            if a.name not in names and a not in env:
                if a.op == "get_attr":  # a parameter fetch travels with the block
                    env[a] = sub.node_copy(a, lambda x: env[x])
                else:
                    ext.append(a)
                    env[a] = sub.placeholder(f"in_{a.name}")
        env[n] = sub.node_copy(n, lambda x: env[x])
    sub.output(tuple(env[n] for n in _used_outside(gm, names)))
    return sub, ext


def _used_outside(gm: fx.GraphModule, names: set[str]) -> list[fx.Node]:
    """The nodes ``names`` of ``gm`` whose values are used outside them, in graph order."""
    return [n for n in gm.graph.nodes
            if n.name in names and any(u.name not in names for u in n.users)]


def _values_of(gm: fx.GraphModule, flat: Sequence[Any], wanted: list[fx.Node]) -> list[Any]:
    """The values of ``wanted`` nodes in a forward of ``gm`` on ``flat``, detached."""
    keep = {n.name for n in wanted}
    got: dict[str, Any] = {}

    class Recorder(fx.Interpreter):
        def run_node(self, n: fx.Node) -> Any:
            out = super().run_node(n)
            if n.name in keep:
                got[n.name] = pytree.tree_map(
                    lambda t: t.detach() if isinstance(t, torch.Tensor) else t, out)
            return out

    with torch.no_grad():
        Recorder(gm).run(*flat)
    return [got[n.name] for n in wanted]


def _fwd_bwd(module: torch.nn.Module, values: list[Any]) -> Callable[[], None]:
    """One forward and backward of ``module`` on ``values`` (floating tensors as leaves
    that need their gradient), with ones as the outputs' gradients."""
    ins = [v.clone().requires_grad_(v.is_floating_point()) if isinstance(v, torch.Tensor)
           else v for v in values]

    def step() -> None:
        out = _grad_outputs(module(*ins))
        if out:
            torch.autograd.backward(out, [torch.ones_like(o) for o in out])

    return step


def _timed_pair(fns: Sequence[Callable[[], None]], dev: torch.device,
                repeats: int) -> list[float]:
    """Seconds per call of each of ``fns``, timed in turn (interleaved, so drift in the
    machine's speed falls on all of them): each warmed up (at least 5 calls and 0.2 s),
    then ``repeats`` rounds of one sample each (:func:`autoplace.costs.timing._time_call`);
    the fastest sample on a GPU, the median on a CPU."""
    for fn in fns:
        t0, n = time.perf_counter(), 0
        while n < 5 or time.perf_counter() - t0 < 0.2:
            fn()
            _sync(dev)
            n += 1
    samples: list[list[float]] = [[] for _ in fns]
    for _ in range(max(1, repeats)):
        for fn, out in zip(fns, samples):
            out.append(_time_call(fn, dev, 1))
    return [min(x) if dev.type == "cuda" else statistics.median(x) for x in samples]
