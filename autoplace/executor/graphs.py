"""CUDA graphs in a one-process placement: each run of ops on one device of one
microbatch replayed as a graph (:class:`_Graphed`), and the units a graphed program
issues (:func:`_graph_units`)."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
import torch.fx as fx
from torch import nn
from torch.utils import _pytree as pytree

from autoplace.executor.moves import _is_meta_op

if TYPE_CHECKING:
    from autoplace.executor.local import _Builder

__all__ = ["CUDA_GRAPHS_ENV", "GRAPH_WARMUP", "graphs_from_env"]


#: ``AUTOPLACE_CUDA_GRAPHS=1``: one-process placements replay each run of ops on one
#: device as a CUDA graph (read by :func:`build_local` when ``graphs`` is None)
CUDA_GRAPHS_ENV = "AUTOPLACE_CUDA_GRAPHS"

#: eager calls of a graphed piece before it is captured (lazy initialisation and cuDNN's
#: algorithm search happen there; the capture runs one more on its stream first, ``_capture``):
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
    was current at the first capture; a placement captures on every device.

    One forward and backward of ``fn`` runs first on that stream, outside any capture
    (lazy initialisation, cuBLAS's workspace for the stream), its results freed; then
    ``make_graphed_callables`` captures with no warm-up of its own: its warm-up keeps the
    last pass's gradients (the parameters' among them) alive until it returns, through
    both captures, which on a launch-bound one-piece model put the peak a parameter
    gradient's worth above the step's (a 1,005-op residual MLP on one H200: 4.05 GiB
    allocated against 3.33 in the steps after)."""
    with torch.cuda.device(device):
        stream = _capture_streams.get(device)
        if stream is None:
            stream = _capture_streams[device] = torch.cuda.Stream(device)
        torch.cuda.synchronize(device)
        with torch.cuda.stream(stream):
            _warm_up(fn, sample)
        torch.cuda.synchronize(device)
        keep = torch.cuda.graph.default_capture_stream
        torch.cuda.graph.default_capture_stream = stream
        try:
            return torch.cuda.make_graphed_callables(fn, sample, num_warmup_iters=0,
                                                     allow_unused_input=True)
        finally:
            torch.cuda.graph.default_capture_stream = keep


def _warm_up(fn: Callable[..., Any], sample: tuple[torch.Tensor, ...]) -> None:
    """One forward and backward of ``fn`` on ``sample``, as ``make_graphed_callables``
    warms up, with nothing of it kept."""
    outs = [o for o in fn(*sample) if o.requires_grad]
    wrt = [t for t in sample if t.requires_grad]
    if outs and wrt:
        torch.autograd.grad(outs, wrt, [torch.empty_like(o) for o in outs],
                            allow_unused=True)


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
