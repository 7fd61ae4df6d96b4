"""Pieces of a local program: a run of one group's ops, recomputed and/or compiled.

A plan's ``recompute`` groups run under ``torch.utils.checkpoint`` (their activations
recomputed in backward), its ``selective`` groups under a selective checkpoint policy
(``torch.utils.checkpoint.create_selective_checkpoint_contexts``: the outputs of
matmuls, convolutions, attention and recurrent kernels are kept, the cheap rest is
recomputed), and with ``parallel.compile`` every piece is compiled with ``torch.compile``
outside the checkpoint, as torchtitan compiles a checkpointed block. A piece whose
compile fails runs eager, and says so once.
"""

from __future__ import annotations

import functools
import os
import time
import types
import warnings
from typing import Any

import torch
from torch import fx, nn
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
)

__all__ = ["COMPILE_BACKEND_ENV", "SELECTIVE_SAVED_OPS", "CompiledPiece", "Piece",
           "canonical_piece", "compile_summary", "direct_children", "piece"]

#: the ``torch.compile`` backend pieces use (default: inductor); tests on CPU use
#: ``aot_eager``, which compiles nothing to machine code
COMPILE_BACKEND_ENV = "AUTOPLACE_COMPILE_BACKEND"


def _aten(*names: str) -> frozenset:
    ops = []
    for name in names:
        packet, _, overload = name.partition(".")
        op = getattr(torch.ops.aten, packet, None)
        if op is not None and hasattr(op, overload or "default"):
            ops.append(getattr(op, overload or "default"))
    return frozenset(ops)


#: the kernels whose outputs a selective recompute keeps: what
#: :data:`autoplace.lowering.SELECTIVE_SAVED_KINDS` names at the captured graph's level
SELECTIVE_SAVED_OPS = _aten(
    "mm", "addmm", "bmm", "baddbmm", "convolution", "_convolution",
    "_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_flash_attention_for_cpu",
    "_cudnn_rnn", "lstm.input",
)


def _save_matmuls(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in SELECTIVE_SAVED_OPS \
        else CheckpointPolicy.PREFER_RECOMPUTE


_selective_context = functools.partial(create_selective_checkpoint_contexts, _save_matmuls)


class Piece(nn.Module):
    """``inner`` run as it is, under a full checkpoint, or under a selective one."""

    def __init__(self, inner: nn.Module, recompute: str | None) -> None:
        super().__init__()
        if recompute not in (None, "full", "selective"):
            raise ValueError(f"recompute {recompute!r}; valid: None, full, selective")
        self.inner = inner
        self.recompute = recompute

    def forward(self, *args: Any) -> Any:
        if self.recompute is None:
            return self.inner(*args)
        # a GraphModule's generated forward, not its __call__: the recompute stops early by
        # raising inside it once the region's last saved tensor is made, and fx's __call__
        # formats the traceback of every exception it sees (0.1 ms and more a region)
        fn = self.inner.forward if isinstance(self.inner, fx.GraphModule) else self.inner
        if self.recompute == "full":
            return checkpoint(fn, *args, use_reentrant=False)
        return checkpoint(fn, *args, use_reentrant=False, context_fn=_selective_context)

    def __repr__(self) -> str:
        return f"Piece(recompute={self.recompute})"


class CompiledPiece(nn.Module):
    """A :class:`Piece` compiled with ``torch.compile``; eager where compiling fails.

    Compiling happens at the first call; its seconds are kept in ``compile_s`` and a
    failure's message in ``failed`` (the piece then runs eager, with a warning).

    Pieces of one ``kind`` (the same code: :func:`canonical_piece`, as a model's repeated
    blocks) are compiled through one code object, so torch.compile makes their graph once
    and reuses it, as it does for a model's blocks compiled one by one; each kind has a
    code object of its own: torch.compile keeps at most ``recompile_limit`` (8) graphs per
    code object, and through one shared ``Piece.forward`` the ninth kind on would silently
    run eager."""

    def __init__(self, piece: Piece, name: str, kind: Any = None) -> None:
        super().__init__()
        self.piece = piece
        self.name = name
        backend = os.environ.get(COMPILE_BACKEND_ENV) or "inductor"
        key = self.kind = (kind if kind is not None else id(piece), piece.recompute)
        forward = _FORWARDS.setdefault(key, _own_code(Piece.forward,
                                                      f"piece_{len(_FORWARDS)}"))
        # kept outside the module tree: it wraps ``piece``, whose parameters are there once
        object.__setattr__(self, "_compiled",
                           torch.compile(types.MethodType(forward, piece), backend=backend))
        self.compile_s: float | None = None
        self.failed: str | None = None

    def forward(self, *args: Any) -> Any:
        if self.failed is not None:
            return self.piece(*args)
        if self.compile_s is not None:
            return self._compiled(*args)
        t0 = time.perf_counter()
        try:
            out = self._compiled(*args)
        except torch.OutOfMemoryError:
            raise
        except Exception as e:  # compile errors surface at the first call
            self.failed = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
            warnings.warn(f"torch.compile of {self.name} failed ({self.failed}); it runs eager",
                          stacklevel=2)
            return self.piece(*args)
        self.compile_s = time.perf_counter() - t0
        return out


#: one ``Piece.forward`` code object per kind of piece (and recompute mode)
_FORWARDS: dict[Any, Any] = {}
#: one GraphModule class per piece code: identical pieces share their forward
_CLASSES: dict[str, type] = {}


def canonical_piece(graph: fx.Graph, attrs: dict[str, Any]) -> tuple[fx.GraphModule, str]:
    """``graph`` (a piece's ops) as a ``GraphModule`` whose names say nothing of where
    in the model it sits (values ``v0, v1, ...``, modules and tensors ``t0, t1, ...``,
    ``attrs`` holding them by their targets; ``source_targets`` maps each back to its
    target in ``graph``), and its code. Pieces with the same code
    (a model's repeated blocks) are instances of one class: torch.compile, which guards
    on the class, then reuses one compiled graph for all of them (its guards on the
    modules' attributes and tensors keep that correct)."""
    g = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    names: dict[str, str] = {}
    root: dict[str, Any] = {}
    for i, n in enumerate(graph.nodes):
        target = n.target
        if n.op in ("call_module", "get_attr"):
            if target not in names:
                names[target] = f"t{len(names)}"
                root[names[target]] = attrs[target]
            target = names[target]
        elif n.op == "placeholder":
            target = f"v{i}"
        args = fx.map_arg(n.args, lambda a: env[a])
        kwargs = fx.map_arg(n.kwargs, lambda a: env[a])
        env[n] = g.create_node(n.op, target, args, kwargs,
                               name=None if n.op == "output" else f"v{i}", type_expr=n.type)
    gm = fx.GraphModule(root, g)
    # what the captured graph calls its modules and tensors: FSDP2 finds its units by them
    gm.source_targets = {short: target for target, short in names.items()}
    code = gm.code
    cls = _CLASSES.setdefault(code, type(gm))
    if type(gm) is not cls:
        gm.__class__ = cls  # the same generated forward, one class for the compiler's guard
    return gm, code


def _own_code(fn: Any, name: str) -> Any:
    """``fn`` with a code object of its own (same body; ``name`` as its code's name)."""
    code = fn.__code__.replace(co_name=name)
    return types.FunctionType(code, fn.__globals__, name, fn.__defaults__, fn.__closure__)


def piece(inner: nn.Module, recompute: str | None, compiled: bool, name: str,
          kind: Any = None) -> nn.Module:
    """The module a local program calls for one piece (``kind``: pieces of one kind,
    the same code, share their compiled graph)."""
    p = Piece(inner, recompute)
    return CompiledPiece(p, name, kind) if compiled else p


def compile_summary(*modules: nn.Module) -> dict[str, Any] | None:
    """What compiling cost in these modules' pieces, for a run's report: pieces,
    distinct compiled graphs (kinds), seconds of their first calls (the forward's
    compilation; the backward's happens in the first backward: the run's report has the
    warm-up steps' whole cost beside it), and the pieces that failed to compile (they ran
    eager). None without compiled pieces."""
    found = {id(m): m for mod in modules for m in mod.modules() if isinstance(m, CompiledPiece)}
    if not found:
        return None
    pieces = list(found.values())
    return {"pieces": len(pieces), "kinds": len({m.kind for m in pieces}),
            "compile_s": round(sum(m.compile_s or 0.0 for m in pieces), 3),
            "failed": sorted({f"{m.name}: {m.failed}" for m in pieces if m.failed})}


def direct_children(program: nn.Module) -> int:
    """Make ``program``'s generated code find its modules without ``nn.Module.__getattr__``;
    returns how many lookups were made direct.

    fx's code calls a module by its path, ``getattr(self.blocks, "0").norm(x)``: three
    lookups, each through ``nn.Module.__getattr__`` (a Python function: the children
    live in ``_modules``, not in the instance's ``__dict__``), where a model's own
    ``forward`` makes one (``self.norm(x)``). On a launch-bound model that is a forward's
    largest overhead over the hand-written model's: a 1,005-op residual MLP on a CPU,
    8.7 against 8.0 ms a forward; with the children also in ``__dict__``, 7.9 against
    8.3. Done for ``program`` and the modules the executor made under it (fx's path
    containers, which are plain ``nn.Module`` instances, pieces and their GraphModules),
    not for the model's layers, and not inside a compiled piece, which torch.compile
    traces. ``nn.Module.__setattr__`` drops a name from ``__dict__`` before it stores a
    module, so replacing a child later stays correct (its lookups go through
    ``__getattr__`` again); ``state_dict``, ``parameters`` and ``named_modules`` read
    ``_modules``, which is unchanged."""
    def ours(m: nn.Module) -> bool:
        return type(m) is nn.Module or isinstance(m, (fx.GraphModule, Piece))

    made = 0
    todo = [program]
    while todo:
        m = todo.pop()
        for name, child in m._modules.items():
            if child is None or hasattr(type(m), name):  # a class attribute comes first
                continue
            m.__dict__[name] = child
            made += 1
            if ours(child) and not isinstance(child, CompiledPiece):
                todo.append(child)
    return made
