"""Data parallelism over a placed program: DDP, or FSDP2 ``fully_shard`` per unit.

No model-specific code. FSDP2's units come from the lowering
(:func:`autoplace.lowering.fsdp_unit_keys`): the modules a program calls that belong to
one block (a child of an ``nn.ModuleList`` / ``nn.Sequential``) are sharded together
(``fully_shard([...])``: one all-gather per block, when its first module runs); parameters
read directly or shared between modules stay in the root's unit, gathered when the program
starts. With a plan's ``parallel.shard_units="modules"`` every other called module holding
parameters (embeddings, an output head) is a unit of its own too: gathered only around its
own use and its gradient reduce-scattered as soon as it is complete, at the price of more
collectives (docs/executor.md). ``auto`` measures the ``modules`` twin of a sharded plan
that peaked near the cap. With a plan's ``parallel.offload`` every unit (the root's too)
is sharded under FSDP2's ``CPUOffloadPolicy`` (:mod:`autoplace.executor.offload`).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.fx as fx
from torch import nn
from torch.distributed.tensor import DTensor

from autoplace.executor.offload import offload_policy
from autoplace.executor.pieces import CompiledPiece, Piece

__all__ = ["allreduce_grads", "sum_grads", "unit_members", "wrap_data_parallel"]


def _called_modules(program: nn.Module) -> dict[str, nn.Module]:
    """Qualified call_module targets of every fx graph inside ``program``, as the captured
    graph names them (a piece's graph renames its modules: ``source_targets``)."""
    called: dict[str, nn.Module] = {}
    for sub in program.modules():
        if isinstance(sub, fx.GraphModule):
            source = getattr(sub, "source_targets", {})
            for n in sub.graph.nodes:
                if n.op == "call_module":
                    called.setdefault(source.get(n.target, n.target), sub.get_submodule(n.target))
    return called


def unit_members(program: nn.Module, units: dict[str, str]) -> list[list[nn.Module]]:
    """The modules ``fully_shard`` wraps together, unit by unit in order of first call
    (the root's unit, ``program`` itself, not included).

    A unit's modules are the called modules ``units`` maps to it. A piece of the program
    (a checkpointed or compiled region, :mod:`autoplace.executor.pieces`) whose modules
    all belong to one unit, and whose parameters are all theirs, is wrapped whole in their
    place, as torchtitan wraps a checkpointed, compiled block: FSDP2's hooks then run
    around the checkpoint and the compiled graph, not inside them. A compiled piece that
    holds modules of several units (or parameters of none) leaves them to the root's
    unit (hooks inside a compiled graph break it); a checkpointed one keeps them as they
    are (FSDP2 supports checkpointing inside a unit). A piece holding an RNN (``nn.LSTM``
    and kin) leaves its modules to the root's unit: GNMT-4's checkpointed LSTM layers,
    sharded whole, failed on 2x H200 in the recomputation ("SystemError: <built-in method
    lstm> returned NULL without setting an exception", torch 2.11)."""
    called = _called_modules(program)
    unit_of = {id(m): units[t] for t, m in called.items() if t in units}
    members: dict[str, list[nn.Module]] = {}
    for t, module in called.items():
        if t in units:
            members.setdefault(units[t], []).append(module)
    for module in called.values():
        if not isinstance(module, (Piece, CompiledPiece)):
            continue
        inside = [m for m in module.modules() if id(m) in unit_of]
        found = {unit_of[id(m)] for m in inside}
        if not found:
            continue
        drop = {id(m) for m in inside}
        unit = next(iter(found))
        own = {id(p) for m in members.get(unit, []) for p in m.parameters()}
        rnn = any(isinstance(m, nn.RNNBase) for m in inside)
        whole = len(found) == 1 and not rnn and all(id(p) in own for p in module.parameters())
        if not whole and not rnn and not isinstance(module, CompiledPiece):
            continue
        for u in found:
            kept = [m for m in members[u] if id(m) not in drop]
            if whole and u == unit:  # the piece where its first module was
                at = next(i for i, m in enumerate(members[u]) if id(m) in drop)
                kept.insert(at, module)  # every member before ``at`` was kept
            members[u] = kept
    return [ms for ms in members.values() if ms]


def wrap_data_parallel(
    program: nn.Module,
    units: dict[str, str],
    shard: str,
    *,
    group: Any = None,
    mesh: Any = None,
    device: torch.device | None = None,
    param_dtype: torch.dtype | None = None,
    offload: bool = False,
) -> nn.Module:
    """``program`` replicated over ``group`` (DDP) or sharded over ``mesh`` (FSDP2).

    Args:
        program: the per-replica program (a local program or a pipeline stage).
        units: FSDP2 only: called module path -> its unit, for the modules outside the
            root's unit (:meth:`autoplace.lowering.Lowering.module_units`). The modules of
            one unit that ``program`` calls are sharded together (one all-gather when the
            first runs), unit by unit in order of first call; the root takes the rest.
        shard: ``none`` (DDP), ``zero2`` (``reshard_after_forward=False``) or ``fsdp``.
        group: data-parallel process group for DDP (None: the world).
        mesh: 1-D data-parallel ``DeviceMesh`` for FSDP2.
        device: the replica's device (DDP gets ``device_ids=[device]`` on CUDA). A replica
            spread over several devices is not wrapped: :func:`allreduce_grads` reduces
            its gradients on its first device.
        param_dtype: FSDP2 only: gather parameters in this dtype (the workload's autocast
            dtype), reduce gradients in fp32. Without it FSDP2 gathers fp32 parameters and
            autocast keeps a low-precision copy of every gathered block until the forward
            ends, so resharding frees little and the all-gathers move twice the bytes.
        offload: FSDP2 only: keep every unit's shards, gradients and optimizer state on
            the host (``CPUOffloadPolicy``; ``parallel.offload``).
    """
    if shard == "none":
        from torch.nn.parallel import DistributedDataParallel as DDP

        ids = [device] if device is not None and device.type == "cuda" else None
        # gradients as views into DDP's buckets: one copy of them. Without
        # ``find_unused_parameters`` DDP starts with one bucket of every parameter and, at
        # the second step, rebuilds its buckets in the order the gradients became ready;
        # the first bucket lives on through that step, a second copy of the gradients at
        # the activations' peak (on one H200, GNMT-4 peaked 4.68 GiB in that step, 4.02 in
        # the others; with the flag 3.86 in every step, the step 0.1 ms slower of 42:
        # docs/executor.md, data parallel). With it the buckets stay those first made, in
        # reverse order of registration, and DDP walks the autograd graph from the outputs
        # each step (PyTorch says so once per rank, on stderr, when it finds every
        # parameter used).
        return DDP(program, device_ids=ids, process_group=group, broadcast_buffers=True,
                   find_unused_parameters=True, gradient_as_bucket_view=True)
    from torch.distributed.fsdp import fully_shard

    reshard = shard == "fsdp"
    mp = None
    if param_dtype is not None:
        from torch.distributed.fsdp import MixedPrecisionPolicy

        mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
    kw: dict[str, Any] = {"mp_policy": mp} if mp is not None else {}
    if offload:
        kw["offload_policy"] = offload_policy(device or torch.device("cpu"))
    for modules in unit_members(program, units):
        fully_shard(modules if len(modules) > 1 else modules[0], mesh=mesh,
                    reshard_after_forward=reshard, **kw)
    fully_shard(program, mesh=mesh, reshard_after_forward=reshard, **kw)
    return program


def all_reduce_mean(t: torch.Tensor, group: Any = None) -> torch.Tensor:
    """Mean of ``t`` over ``group`` (``t`` itself when not distributed)."""
    if not (dist.is_available() and dist.is_initialized()):
        return t
    t = t.clone()
    dist.all_reduce(t, group=group)
    return t / dist.get_world_size(group)


def allreduce_grads(params: list[nn.Parameter], group: Any = None,
                    bucket_bytes: int = 25 * 2**20, device: torch.device | None = None) -> None:
    """Average the gradients of ``params`` over ``group`` in flat buckets.

    Used for data parallelism over pipeline stages: DDP's reducer inside
    ``PipelineStage`` fails its first-iteration bucket rebuild when a stage runs
    several microbatches ("rebuilt parameter indices size is not same as original
    model parameters size"), so stages all-reduce after the schedule's step. Also for
    replicas spread over several devices in one process: a NCCL process group is bound
    to one device per process, so buckets on the replica's other devices are reduced
    on ``device`` (copied there and back).
    """
    from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

    world = dist.get_world_size(group)
    buckets: dict[tuple[Any, Any], list[list[torch.Tensor]]] = {}
    for p in params:
        if p.grad is None:
            continue
        # a tensor-parallel parameter's gradient is a DTensor: its shard is reduced
        grad = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
        lists = buckets.setdefault((grad.device, grad.dtype), [[]])
        if sum(g.numel() * g.element_size() for g in lists[-1]) > bucket_bytes:
            lists.append([])
        lists[-1].append(grad)
    for lists in buckets.values():
        for grads in lists:
            flat = _flatten_dense_tensors(grads)
            moved = device is not None and flat.device != device
            if moved:
                flat = flat.to(device)
            dist.all_reduce(flat, group=group)
            flat /= world
            if moved:
                flat = flat.to(grads[0].device)
            for g, reduced in zip(grads, _unflatten_dense_tensors(flat, grads)):
                g.copy_(reduced)


def sum_grads(params: list[nn.Parameter], group: Any) -> None:
    """Replace each parameter's gradient by its sum over ``group`` (one flat all-reduce).

    For a parameter copied to several pipeline stages (tied embeddings): each copy has
    the gradient of its own stage's uses, and the parameter's gradient is their sum. A
    copy without a gradient contributes zeros (every rank must send the same buffer).
    """
    from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
    flat = _flatten_dense_tensors(grads)
    dist.all_reduce(flat, group=group)
    for p, g, summed in zip(params, grads, _unflatten_dense_tensors(flat, grads)):
        g.copy_(summed)
        p.grad = g
