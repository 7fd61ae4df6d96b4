"""Local placement: any DAG placement of a captured graph inside one process.

:func:`build_local` turns the captured ``torch.fx.GraphModule`` and a plan into a
:class:`LocalProgram`: one new fx program that holds ``M`` copies of the graph (one
per microbatch), each op on its group's device, a ``.to(device)`` on every edge
that crosses devices (once per destination device), ops issued in an order that
interleaves devices and microbatches, and the batch-size-weighted sum of the
microbatch losses as its output. Because CUDA kernels launch asynchronously and
autograd runs backward on one thread per device, the devices work at once: a
GPipe inside one process, as torchgpipe does. Groups in ``plan.recompute`` run
under ``torch.utils.checkpoint`` in convex pieces (runs of consecutive ops of the
group in the issue order).

Parameters live on the device of the first op that uses them; an op on another
device gets them moved there (``.to`` keeps the autograd link, so gradients sum).
"""

from __future__ import annotations

import operator
import os
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
import torch.fx as fx
from torch import nn
from torch.utils import _pytree as pytree
from torch.utils.checkpoint import checkpoint

from autoplace.capture import (
    body_on_device,
    fetch_attr,
    model_output,
    node_on_device,
    program_inputs,
)
from autoplace.plan import Plan

__all__ = ["CUDA_GRAPHS_ENV", "LocalProgram", "build_local", "graphs_from_env",
           "move_to", "move_to_streamed", "split_value"]

_META_METHODS = {"size", "dim", "numel", "ndimension", "get_device", "element_size"}
_META_ATTRS = {"shape", "dtype", "device", "ndim", "is_cuda", "requires_grad", "layout"}
_FREE_KINDS = {"input", "output", "param", "getitem", "getattr", "size", "view", "reshape",
               "permute", "transpose", "flatten", "unflatten", "contiguous", "squeeze",
               "unsqueeze", "expand"}


def move_to(value: Any, device: torch.device) -> Any:
    """``value`` with every tensor in it moved to ``device`` (non-tensors unchanged)."""
    return pytree.tree_map_only(torch.Tensor, lambda t: t.to(device, non_blocking=True), value)


#: ``AUTOPLACE_COPY_STREAMS=1``: cross-GPU edges use :func:`move_to_streamed` (experimental,
#: not yet measured on GPUs; read by :func:`build_local` when ``copy_streams`` is None)
COPY_STREAMS_ENV = "AUTOPLACE_COPY_STREAMS"
_side_streams: dict[tuple[int, int], torch.cuda.Stream] = {}


def _copy_streamed(x: torch.Tensor, dst: torch.device) -> torch.Tensor:
    """``x.to(dst)`` without PyTorch's two-way barrier between the devices' streams.

    A cross-device ``copy_`` runs on the source device's current stream after making it
    wait for everything queued on the destination's current stream (ATen's
    ``copy_device_to_device``), so in a one-process placement every edge makes the
    sending GPU wait for the receiving GPU's whole queue. Here the destination's current
    stream is, during the copy, a side stream of its own per (source, destination)
    pair, which holds only copies: the source waits for nothing but earlier copies on
    that pair; the destination's compute stream then waits for the side stream, and the
    new tensor is marked as used by it so the allocator does not reuse its memory early.
    """
    src = x.device
    if src.type != "cuda" or dst.type != "cuda" or src == dst:
        return x.to(dst, non_blocking=True)
    key = (src.index, dst.index)
    side = _side_streams.get(key)
    if side is None:
        side = _side_streams[key] = torch.cuda.Stream(device=dst)
    main = torch.cuda.current_stream(dst)
    with torch.cuda.stream(side):
        y = x.to(dst, non_blocking=True)
    main.wait_stream(side)
    y.record_stream(main)
    return y


class _CopyTo(torch.autograd.Function):
    """A differentiable :func:`_copy_streamed`: the gradient goes back the same way."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, dst: torch.device) -> torch.Tensor:
        ctx.src = x.device
        y = _copy_streamed(x, dst)
        return x.view_as(x) if y is x else y  # a Function returns a new tensor

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _copy_streamed(grad, ctx.src), None


def move_to_streamed(value: Any, device: torch.device) -> Any:
    """:func:`move_to` whose GPU-to-GPU copies skip the two-way stream barrier
    (:func:`_copy_streamed`), forward and backward."""
    return pytree.tree_map_only(
        torch.Tensor, lambda t: t if t.device == device else _CopyTo.apply(t, device), value)


def _call_module_on(module: nn.Module, device: torch.device, *args: Any, **kwargs: Any) -> Any:
    """Call ``module`` with its parameters and buffers moved to ``device`` (grads flow back)."""
    moved = {n: t.to(device) for n, t in module.named_parameters()}
    moved.update({n: t.to(device) for n, t in module.named_buffers()})
    return torch.func.functional_call(module, moved, args, kwargs)


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


class _Checkpointed(nn.Module):
    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, *args: Any) -> Any:
        return checkpoint(self.inner, *args, use_reentrant=False)


#: ``AUTOPLACE_CUDA_GRAPHS=1``: one-process placements replay each run of ops on one
#: device as a CUDA graph (read by :func:`build_local` when ``graphs`` is None)
CUDA_GRAPHS_ENV = "AUTOPLACE_CUDA_GRAPHS"
#: eager calls of a graphed piece before it is captured (lazy initialisation and cuDNN's
#: algorithm search happen there; the capture runs two more warm-up passes of its own):
#: with the runner's 2 warm-up steps, the second captures and timed steps replay
GRAPH_WARMUP = 1
_TENSOR = object()  # marks a tensor leaf among a piece's recorded non-tensor values


def graphs_from_env() -> bool:
    """Whether the environment asks for CUDA graphs (``AUTOPLACE_CUDA_GRAPHS=1``)."""
    return os.environ.get(CUDA_GRAPHS_ENV, "0") == "1"


class _Bound:
    """``inner`` as a function of tensors alone, the shape of callable
    :func:`torch.cuda.make_graphed_callables` takes: it is called with the tensors among
    ``args``' pytree leaves, then ``inner``'s parameters (``torch.func.functional_call``),
    its non-tensor leaves fixed, and returns the tensor leaves of ``inner``'s output.

    The parameters are arguments, not module state, so that a capture can run on
    detached aliases of them: autograd then makes fresh gradient accumulators on the
    capture stream, instead of syncing with the ones the eager steps made on the default
    stream, which a capture forbids ("operation not permitted when stream is capturing").
    """

    def __init__(self, inner: nn.Module, args: tuple[Any, ...]) -> None:
        self.inner = inner
        leaves, self.spec = pytree.tree_flatten(args)
        self.consts = [_TENSOR if isinstance(x, torch.Tensor) else x for x in leaves]
        self.n_args = sum(c is _TENSOR for c in self.consts)
        named = list(inner.named_parameters())
        self.names = [n for n, _ in named]
        self.params = [p for _, p in named]

    def matches(self, args: tuple[Any, ...]) -> list[torch.Tensor] | None:
        """The tensors of ``args``, or None if its structure or constants differ."""
        leaves, spec = pytree.tree_flatten(args)
        if spec != self.spec:
            return None
        tensors = []
        for x, c in zip(leaves, self.consts):
            if c is _TENSOR:
                if not isinstance(x, torch.Tensor):
                    return None
                tensors.append(x)
            elif isinstance(x, torch.Tensor) or x != c:
                return None
        return tensors

    def __call__(self, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        it = iter(tensors[:self.n_args])
        leaves = [next(it) if c is _TENSOR else c for c in self.consts]
        params = dict(zip(self.names, tensors[self.n_args:]))
        out = torch.func.functional_call(self.inner, params,
                                         tuple(pytree.tree_unflatten(leaves, self.spec)))
        return tuple(x for x in pytree.tree_leaves(out) if isinstance(x, torch.Tensor))


_capture_streams: dict[torch.device, torch.cuda.Stream] = {}


def _capture(fn: Callable[..., Any], sample: tuple[torch.Tensor, ...],
             device: torch.device) -> Callable[..., Any]:
    """``make_graphed_callables(fn, sample)`` captured on a stream of ``device``.

    ``torch.cuda.graph`` captures on one stream per process, made on whichever device
    was current at the first capture; a placement captures on every device."""
    with torch.cuda.device(device):
        stream = _capture_streams.get(device)
        if stream is None:
            stream = _capture_streams[device] = torch.cuda.Stream(device)
        keep = torch.cuda.graph.default_capture_stream
        torch.cuda.graph.default_capture_stream = stream
        try:
            return torch.cuda.make_graphed_callables(fn, sample, num_warmup_iters=2,
                                                     allow_unused_input=True)
        finally:
            torch.cuda.graph.default_capture_stream = keep


class _Graphed(nn.Module):
    """A run of ops on one device for one microbatch, replayed as a CUDA graph.

    The first ``GRAPH_WARMUP`` calls with autograd on run eagerly; the next one captures
    the forward and the backward (:func:`torch.cuda.make_graphed_callables` on detached
    aliases of this call's tensors and of the parameters, which become the graph's static
    inputs) and every later call copies its inputs into them (parameters and the outputs
    of a graphed piece before it on the device are already there) and replays: one
    launch where eager issues every op's kernels. Calls without autograd (evaluation,
    the loss check) and calls whose non-tensor values differ from the captured ones run
    eagerly; so does every call once a capture failed (``failed`` says why), e.g. for an
    op that synchronises with the host.
    """

    def __init__(self, inner: nn.Module, device: torch.device) -> None:
        super().__init__()
        self.inner = inner
        self.device = device
        self.calls = 0
        self.failed: str | None = None
        self._bound: _Bound | None = None
        self._replay: Callable[..., Any] | None = None
        self._out: tuple[list[Any], Any] | None = None  # output leaves (_TENSOR) and spec

    def forward(self, *args: Any) -> Any:
        if self._replay is not None and self._bound is not None and torch.is_grad_enabled():
            tensors = self._bound.matches(args)
            if tensors is not None and self._out is not None:
                leaves, spec = self._out
                it = iter(self._replay(*tensors, *self._bound.params))
                return pytree.tree_unflatten(
                    [next(it) if c is _TENSOR else c for c in leaves], spec)
        if self._replay is not None or self.failed is not None or not torch.is_grad_enabled() \
                or self.device.type != "cuda":
            return self.inner(*args)
        self.calls += 1
        if self.calls <= GRAPH_WARMUP:
            out = self.inner(*args)
            leaves, spec = pytree.tree_flatten(out)
            self._out = ([_TENSOR if isinstance(x, torch.Tensor) else x for x in leaves], spec)
            return out
        bound = _Bound(self.inner, args)
        tensors = [x for x in pytree.tree_leaves(args) if isinstance(x, torch.Tensor)]
        sample = tuple(t.detach().requires_grad_(t.requires_grad)
                       for t in (*tensors, *bound.params))
        try:
            self._replay = _capture(bound, sample, self.device)
        except Exception as e:  # noqa: BLE001 - an op that cannot be captured: stay eager
            self.failed = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
            return self.inner(*args)
        self._bound = bound
        return self.forward(*args)


def _is_meta_op(node: fx.Node) -> bool:
    """Ops that read only tensor metadata: they run where their input is, nothing moves."""
    if node.op == "call_method" and node.target in _META_METHODS:
        return True
    return (node.op == "call_function" and node.target is getattr and len(node.args) > 1
            and node.args[1] in _META_ATTRS)



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


def _param_homes(gm: fx.GraphModule, dev_of: dict[str, int]) -> dict[int, int]:
    """id(parameter or buffer) -> local device of the first op that uses it."""
    homes: dict[int, int] = {}
    for node in gm.graph.nodes:
        if node.op not in ("call_module", "get_attr"):
            continue
        obj = fetch_attr(gm, node.target)
        tensors = ([*obj.parameters(), *obj.buffers()] if isinstance(obj, nn.Module)
                   else [obj] if isinstance(obj, torch.Tensor) else [])
        for t in tensors:
            homes.setdefault(id(t), dev_of[node.name])
    return homes


def place_parameters(gm: fx.GraphModule, homes: dict[int, int],
                     devices: list[torch.device]) -> None:
    """Move every parameter and buffer of ``gm`` to its home device (unused: device 0).

    Parameters move one at a time (``p.data``, so optimizers and hooks keep the same
    objects); a recurrent module (``nn.LSTM``, ``nn.GRU``, ``nn.RNN``) that moved is
    re-flattened afterwards (:func:`reflatten_rnns`), as ``Module.to`` does."""
    moved: set[int] = set()
    for mod in gm.modules():
        for p in list(mod._parameters.values()):
            if p is not None:
                dev = devices[homes.get(id(p), 0)]
                if p.device != dev:
                    p.data = p.data.to(dev)
                    moved.add(id(mod))
        for name, b in list(mod._buffers.items()):
            if b is not None:
                dev = devices[homes.get(id(b), 0)]
                if b.device != dev:
                    new = b.to(dev)
                    homes[id(new)] = homes.get(id(b), 0)
                    mod._buffers[name] = new
    for node in gm.graph.nodes:  # plain tensor attributes (fx constants)
        if node.op == "get_attr":
            obj = fetch_attr(gm, node.target)
            if isinstance(obj, torch.Tensor) and not isinstance(obj, nn.Parameter):
                dev = devices[homes.get(id(obj), 0)]
                if obj.device != dev:
                    *path, last = node.target.split(".")
                    owner = fetch_attr(gm, ".".join(path)) if path else gm
                    new = obj.to(dev)
                    homes[id(new)] = homes.get(id(obj), 0)
                    setattr(owner, last, new)
    reflatten_rnns(m for m in gm.modules() if id(m) in moved)


def reflatten_rnns(modules: Iterable[nn.Module]) -> int:
    """Re-pack the weights of each recurrent module among ``modules`` whose weights all
    sit on one CUDA device into cuDNN's single flat buffer (``flatten_parameters()``);
    returns how many were packed.

    Moved one parameter at a time, an LSTM's weights no longer share that buffer: cuDNN
    then warns that they "need to be compacted at every call" and copies them at every
    forward, in time and in memory kept for backward. ``Module.to`` re-flattens
    (``RNNBase._apply``); moving ``p.data`` does not. Off CUDA a no-op."""
    n = 0
    for mod in modules:
        if not isinstance(mod, nn.RNNBase):
            continue
        # the list the module packs may be stale: tracing leaves the fake tensors it ran
        # on there until the next forward; Module.to refreshes it the same way
        mod._init_flat_weights()
        ws = [w for w in mod._flat_weights if isinstance(w, torch.Tensor)]
        if not ws or ws[0].device.type != "cuda" or any(w.device != ws[0].device for w in ws):
            continue
        mod.flatten_parameters()
        n += 1
    return n


def _graph_units(gm: fx.GraphModule, b: _Builder, m: int
                 ) -> list[tuple[list[tuple[int, str]], bool]]:
    """The units of a graphed program, in issue order: ``(unit, graphed)`` pairs.

    Pieces are maximal runs of ops on one device, consecutive in program order (a run of
    consecutive ops of a topological order is convex, so a piece is a valid subgraph). A
    meta op (``x.size()``) joins the piece that computes its input, or runs on its own
    just before the piece it is met in. A module call whose parameters live on another
    device runs on its own, eagerly; so does a piece with fewer than two compute ops.
    Pieces are issued in a diagonal wavefront: piece ``c`` of microbatch ``mb`` at step
    ``c + mb``, lower microbatches first within a step (a piece depends only on earlier
    pieces of its own microbatch).
    """
    dev_of = b.dev_of
    nodes = {n.name: n for n in gm.graph.nodes}
    pieces: list[dict[str, Any]] = []  # {"pre": [meta ops], "ops": [...], "dev", "eager"}

    def start(dev: int | None, eager: bool = False) -> dict[str, Any]:
        pieces.append({"pre": [], "ops": [], "dev": dev, "eager": eager, "names": set()})
        return pieces[-1]

    for n in gm.graph.nodes:
        if n.op in ("placeholder", "get_attr", "output"):
            continue
        cur = pieces[-1] if pieces and not pieces[-1]["eager"] else None
        if _is_meta_op(n):
            src = n.args[0].name if isinstance(n.args[0], fx.Node) else None
            if cur is not None and src in cur["names"]:
                cur["ops"].append(n.name)
                cur["names"].add(n.name)
            else:
                (cur or start(None))["pre"].append(n.name)
            continue
        d = dev_of[n.name]
        if n.op == "call_module" and b.module_home(n.target) not in (None, d):
            start(d, eager=True)["ops"].append(n.name)
            continue
        if cur is None or (cur["dev"] is not None and cur["dev"] != d):
            cur = start(d)
        cur["dev"] = d
        cur["ops"].append(n.name)
        cur["names"].add(n.name)
    units: list[tuple[list[tuple[int, str]], bool]] = []
    steps = sorted((c + mb, mb, c) for c in range(len(pieces)) for mb in range(m))
    for _, mb, c in steps:
        p = pieces[c]
        units.extend(([(mb, name)], False) for name in p["pre"])
        compute = [x for x in p["ops"] if not _is_meta_op(nodes[x])]
        if not p["ops"]:
            continue
        if p["eager"] or len(compute) < 2:
            units.extend(([(mb, name)], False) for name in p["ops"])
        else:
            units.append(([(mb, name) for name in p["ops"]], True))
    return units


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
    """
    if copy_streams is None:
        copy_streams = os.environ.get(COPY_STREAMS_ENV, "0") == "1"
    if graphs is None:
        graphs = graphs_from_env()
    graphs = bool(graphs and not plan.recompute)
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

    rc = set(plan.recompute)
    units: list[list[tuple[int, str]]] = []
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
            grp = plan.groups[name] if (plan.groups[name] in rc and not _is_meta_op(node)) \
                else None
            last = units[-1] if units else None
            if (grp is not None and last and last[0][0] == mb
                    and plan.groups[last[0][1]] == grp and not _is_meta_op(nodes[last[0][1]])
                    and plan.groups[last[0][1]] in rc):
                last.append((mb, name))
            else:
                units.append([(mb, name)])

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
    for i_unit, unit in enumerate(units):
        emit_losses()
        mb, first = unit[0]
        node = nodes[first]
        dev = dev_of[first]
        if i_unit not in graphed and len(unit) == 1 and (
                plan.groups[first] not in rc or _is_meta_op(node)):
            if _is_meta_op(node):
                arg = lambda a, mb=mb: b.env[b.key(a, mb)]  # noqa: E731
            else:
                arg = lambda a, mb=mb, dev=dev: b.value(a, mb, dev)  # noqa: E731
            b.env[(first, mb)] = b.copy(g, node, arg, dev)
            continue
        # a recomputed piece: its own GraphModule under torch.utils.checkpoint
        names = {n for _, n in unit}
        ext: list[fx.Node] = []
        for _, n in unit:
            for a in nodes[n].all_input_nodes:
                if a.name not in names and a not in ext:
                    ext.append(a)
        users = [nodes[n] for _, n in unit
                 if any(u.name not in names for u in nodes[n].users)]
        sub = fx.Graph()
        local: dict[str, fx.Node] = {a.name: sub.placeholder(a.name) for a in ext}
        for _, n in unit:
            local[n] = b.copy(sub, nodes[n], lambda a, local=local: local[a.name], dev)
        sub.output(tuple(local[u.name] for u in users))
        sub_gm = fx.GraphModule({t: b.attrs[t] for t in b.attrs}, sub)
        if i_unit in graphed:
            target = f"_graphed{n_rc}"
            b.attrs[target] = _Graphed(sub_gm, devices[dev])
        else:
            target = f"_recompute{n_rc}"
            b.attrs[target] = _Checkpointed(sub_gm)
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
    input_devices = [devices[dev_of[p.name]] for p in placeholders]
    used = sorted(set(plan_dev.values()))
    return LocalProgram(program, m, input_devices, devices[out_dev], [devices[i] for i in used],
                        flatten=lambda xs, gm=gm: program_inputs(gm, xs))
