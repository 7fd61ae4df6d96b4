"""Data parallelism over a placed program: DDP, or FSDP2 ``fully_shard`` per block.

No model-specific code. FSDP2 shards "blocks" found by one generic rule: every
child of an ``nn.ModuleList`` / ``nn.Sequential`` that holds parameters (deepest
first), then the root. A captured program calls leaf modules, never the block
containers, so a block is sharded as the list of modules its program calls
(``fully_shard([...])``: one all-gather per block, when its first module runs); a child
that is itself a called module (an ``nn.LSTM`` in a ``ModuleList``) is a unit of its own
unless a block around it claimed it (until session 23 it fell into the root group, so
GNMT-4's FSDP2 gathered the whole model as one unit);
parameters read directly (``get_attr``) or shared between blocks stay in the root
group, which is gathered when the program starts. With ``units="modules"`` (a plan's
``parallel.shard_units``) every other called module holding parameters (embeddings, an
output head) is a unit of its own too: gathered only around its own use, its gradient
reduce-scattered as soon as it is complete, where in the root group it stays gathered for
the whole forward and again the whole backward, its unsharded gradient held until the
backward ends. It is a trade, measured on GNMT-4 over 2x H200 before the fix above, so
against the whole model as one unit (``scripts/bench_fsdp_units.py``): by modules FSDP2
peaked at 3.23 GiB instead of 4.16 and ran 66.5 ms instead of 87.3 under a 4.4 GiB cap,
but 61.2 ms instead of 46.6 without it (22 all-gathers a step instead of 2). ``auto``
measures the ``modules`` twin of a sharded plan that peaked near the cap.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.fx as fx
from torch import nn

__all__ = ["allreduce_grads", "block_paths", "sum_grads", "wrap_data_parallel"]


def block_paths(model: nn.Module) -> list[str]:
    """Qualified names of the blocks of ``model``, deepest first."""
    out = []
    for name, mod in model.named_modules():
        if isinstance(mod, (nn.ModuleList, nn.Sequential)):
            for child_name, child in mod.named_children():
                if any(True for _ in child.parameters()):
                    out.append(f"{name}.{child_name}" if name else child_name)
    return sorted(out, key=lambda p: -p.count("."))


def _called_modules(program: nn.Module) -> dict[str, nn.Module]:
    """Qualified call_module targets of every fx graph inside ``program``."""
    called: dict[str, nn.Module] = {}
    for sub in program.modules():
        if isinstance(sub, fx.GraphModule):
            for n in sub.graph.nodes:
                if n.op == "call_module":
                    called.setdefault(n.target, sub.get_submodule(n.target))
    return called


def wrap_data_parallel(
    program: nn.Module,
    model: nn.Module,
    shard: str,
    *,
    group: Any = None,
    mesh: Any = None,
    device: torch.device | None = None,
    param_dtype: torch.dtype | None = None,
    units: str = "blocks",
) -> nn.Module:
    """``program`` replicated over ``group`` (DDP) or sharded over ``mesh`` (FSDP2).

    Args:
        program: the per-replica program (a local program or a pipeline stage).
        model: the original model, whose hierarchy names the blocks.
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
        units: FSDP2 only: ``blocks`` or ``modules`` (the plan's ``parallel.shard_units``).
    """
    if shard == "none":
        from torch.nn.parallel import DistributedDataParallel as DDP

        ids = [device] if device is not None and device.type == "cuda" else None
        # gradients as views into DDP's buckets: one copy of them between steps (DDP still
        # holds two while it rebuilds its buckets after the first: sim_model.DDP_GRAD_COPIES)
        return DDP(program, device_ids=ids, process_group=group, broadcast_buffers=True,
                   find_unused_parameters=False, gradient_as_bucket_view=True)
    from torch.distributed.fsdp import fully_shard

    reshard = shard == "fsdp"
    mp = None
    if param_dtype is not None:
        from torch.distributed.fsdp import MixedPrecisionPolicy

        mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
    kw: dict[str, Any] = {"mp_policy": mp} if mp is not None else {}
    called = _called_modules(program)
    counts: dict[int, int] = {}
    for _, p in model.named_parameters(remove_duplicate=False):
        counts[id(p)] = counts.get(id(p), 0) + 1
    getattr_params = {
        id(t)
        for sub in program.modules() if isinstance(sub, fx.GraphModule)
        for n in sub.graph.nodes if n.op == "get_attr"
        for t in _tensors(sub, n.target)
    }

    def unit_of_its_own(target: str) -> bool:
        """A top-level called module whose parameters no other module reads."""
        if any(target.startswith(c + ".") for c in called if c != target):
            return False  # inside another called module
        params = list(called[target].parameters())
        return bool(params) and not any(counts.get(id(p), 1) > 1 or id(p) in getattr_params
                                        for p in params)

    def shard_alone(target: str) -> None:
        fully_shard(called[target], mesh=mesh, reshard_after_forward=reshard, **kw)
        claimed.add(target)

    blocks = block_paths(model)
    claimed: set[str] = set()
    for block in blocks:
        members = [t for t in sorted(called) if t.startswith(block + ".")
                   and t not in claimed and unit_of_its_own(t)]
        if members:
            fully_shard([called[t] for t in members], mesh=mesh, reshard_after_forward=reshard,
                        **kw)
            claimed.update(members)
    # a list's child that is itself a called module (GNMT's LSTMs in a ModuleList) and no
    # container block claimed: a unit of its own (it has no called modules inside)
    for block in blocks:
        if block in called and block not in claimed and unit_of_its_own(block):
            shard_alone(block)
    if units == "modules":
        for target in sorted(called):
            if target not in claimed and unit_of_its_own(target):
                shard_alone(target)
    fully_shard(program, mesh=mesh, reshard_after_forward=reshard, **kw)
    return program


def _tensors(root: nn.Module, target: str) -> list[torch.Tensor]:
    obj: Any = root
    for part in target.split("."):
        obj = getattr(obj, part)
    if isinstance(obj, nn.Module):
        return list(obj.parameters())
    return [obj] if isinstance(obj, torch.Tensor) else []


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
        lists = buckets.setdefault((p.grad.device, p.grad.dtype), [[]])
        if sum(g.numel() * g.element_size() for g in lists[-1]) > bucket_bytes:
            lists.append([])
        lists[-1].append(p.grad)
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
