"""The training loop of one process: build the plan's program, train, measure.

Runs alone (local placement, one process) or as one rank under torchrun (data
parallel, pipeline, or both, with local placement inside a replica). Every step's
batch is ``torch.manual_seed(seed + step)`` then ``workload.make_batch`` on the CPU,
so all ranks and the reference see the same data; replica ``r`` takes its slice
of the global batch. Rank 0 returns the :class:`RunReport`.
"""

from __future__ import annotations

import contextlib
import copy
import gc
import math
import os
import re
import signal
import statistics
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from autoplace.capture import random_ops
from autoplace.cluster import Cluster
from autoplace.errors import PlanError
from autoplace.executor import build
from autoplace.executor.checkpoint import load_checkpoint, save_checkpoint
from autoplace.executor.inputs import capture_graph, global_batch
from autoplace.executor.local import graphs_from_env, move_to, split_value
from autoplace.executor.memory_record import MemoryRecorder, recorded_step
from autoplace.executor.offload import host_threads, offload_optimizer, on_host, one_rank_group
from autoplace.executor.pieces import compile_summary
from autoplace.executor.report import RunReport
from autoplace.executor.tensor_parallel import process_count
from autoplace.lowering import validate
from autoplace.plan import Plan
from autoplace.workloads import Workload

__all__ = ["RunOptions", "capture_graph", "global_batch", "reference_losses", "run_here",
           "workload_autocast", "workload_optimizer"]


@dataclass(kw_only=True)
class RunOptions:
    """How long to train and what to record."""

    steps: int = 10
    """Training steps, warm-up included."""
    warmup: int = 2
    """Steps not timed."""
    reference: bool = True
    """Also train the unpartitioned model on one device on the same batches."""
    checkpoint_dir: str | None = None
    """Where to save checkpoints (None: none)."""
    checkpoint_every: int = 1
    """Save every this many steps."""
    resume: bool = False
    """Continue from the latest checkpoint in ``checkpoint_dir``."""
    seed: int = 0
    """Data of step ``s`` is drawn after ``torch.manual_seed(seed + s)``."""
    progress: bool = False
    """Print one line per step."""
    weights_file: str | None = None
    """Processes of a multi-process run read the initial weights from this file
    (:func:`autoplace.executor.weights.save_weights`) instead of initialising the model."""
    trace_dir: str | None = None
    """Record the timed steps with ``torch.profiler`` and write one Chrome trace per rank
    here (``trace-rank<R>.json``, viewable in Perfetto). Tracing slows the steps it records."""
    memory_dir: str | None = None
    """Record the CUDA caching allocator's history over one step (the last warm-up step,
    :func:`autoplace.executor.memory_record.recorded_step`) and write per rank its snapshot
    and a summary here (:mod:`autoplace.executor.memory_record`). A run that fails in that
    step writes them too."""


def _has_batch_coupling(model: nn.Module) -> bool:
    return any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in model.modules())


def workload_autocast(workload: Workload, device: torch.device, cache: bool | None = None):
    """The workload's autocast on CUDA. ``cache``: keep autocast's cast copies of the
    weights within a forward (default: unless CUDA graphs are on, which cannot capture
    with it: ``AUTOPLACE_CUDA_GRAPHS=1``)."""
    if cache is None:
        cache = not graphs_from_env()
    if device.type == "cuda" and workload.autocast_dtype:
        return torch.autocast("cuda", dtype=getattr(torch, workload.autocast_dtype),
                              cache_enabled=cache)
    return torch.autocast(device.type, enabled=False)


class NoParameters:
    """The optimizer of a rank whose part of the plan holds no parameters (a pipeline
    stage of parameter-free ops): nothing to update, an empty state."""

    def step(self) -> None:
        pass

    def zero_grad(self, set_to_none: bool = True) -> None:
        pass

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass


def workload_optimizer(params: list[nn.Parameter], workload: Workload,
                       device: torch.device, *, shard_state: bool = False
                       ) -> torch.optim.Optimizer | NoParameters:
    """The workload's AdamW over ``params`` (fused on CUDA); a stand-in that steps nothing
    for a program without parameters. ``shard_state`` (``parallel.shard_optimizer``, DDP
    replicas in the default process group): ZeRO-1, each rank keeping the state of and
    updating its share of ``params``, then broadcasting them (``ZeroRedundancyOptimizer``,
    tensor by tensor: packed into one buffer per rank, an LSTM's weights leave cuDNN's
    flat buffer, and every call then compacts them again, on 2x H200 GNMT-4 peaked 0.3 GiB
    higher)."""
    if not params:
        return NoParameters()
    # fused on CUDA, sharded (DTensor) parameters included: foreach AdamW allocates
    # temporaries as large as all the parameters it updates, which a memory cap feels
    kw: dict[str, Any] = {"fused": True} if device.type == "cuda" else {}
    if shard_state:
        from torch.distributed.optim import ZeroRedundancyOptimizer

        return ZeroRedundancyOptimizer(params, optimizer_class=torch.optim.AdamW,
                                       parameters_as_bucket_view=False, lr=workload.lr, **kw)
    return torch.optim.AdamW(param_groups(params), lr=workload.lr, **kw)


def param_groups(params: list[nn.Parameter]) -> list[nn.Parameter] | list[dict[str, Any]]:
    """``params`` as the optimizer's groups: one, or where DTensor parameters (tensor
    parallel's) sit beside plain ones (the norms it leaves whole), one group of each. A
    fused or foreach step takes one group's tensors at once and refuses the mix (2x H200,
    torch 2.11: "aten._fused_adamw_.default: got mixed torch.Tensor and DTensor")."""
    split = [[p for p in params if isinstance(p, DTensor)],
             [p for p in params if not isinstance(p, DTensor)]]
    if not split[0] or not split[1]:
        return params
    return [{"params": group} for group in split]


def _sync(devices: list[torch.device]) -> None:
    for d in {d for d in devices if d.type == "cuda"}:
        torch.cuda.synchronize(d)


def reference_losses(workload: Workload, steps: int, seed: int, device: torch.device,
                     chunks: int = 1, start: int = 0) -> list[float]:
    """Losses of the unpartitioned model trained on one device on the same batches.

    ``chunks > 1`` cuts each batch into equal pieces whose losses are averaged (used
    only for models whose layers couple the samples of a batch, like BatchNorm, so
    the reference sees the same per-piece statistics as the plan).
    """
    model = copy.deepcopy(workload.model).to(device)
    opt = workload_optimizer(list(model.parameters()), workload, device)
    out = []
    for step in range(steps):
        inputs, targets = global_batch(workload, step, seed)
        pieces = list(zip(*[split_value(x, chunks) for x in (*inputs, targets)]))
        total = 0.0
        with workload_autocast(workload, device):
            for piece in pieces:
                *xs, y = (move_to(t, device) for t in piece)
                loss = workload.loss_fn(model(*xs), y) / len(pieces)
                loss.backward()
                total += loss.detach()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if step >= start:
            out.append(float(total))
    del model, opt
    _free()
    return out


def _free() -> None:
    """Give a run's GPU memory back, so that a long-lived process (a benchmark's pool job)
    starts its next run with nothing of this one: its cycles collected, cuBLAS's workspaces
    released (one per stream a matmul ran on, taken from the caching allocator and kept
    until cleared: a pool job held 192-384 MiB after GNMT-4's placements, and a CUDA-graph
    plan near the cap ran out of memory in its next run), the cache emptied."""
    if torch.cuda.is_available():
        gc.collect()
        clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
        if clear is not None:
            clear()
        torch.cuda.empty_cache()


def _device_name(d: torch.device) -> str:
    if d.type == "cuda":
        return torch.cuda.get_device_name(d)
    import platform

    return platform.processor() or platform.machine() or "cpu"


def _oom_device(msg: str, devices: list[torch.device]) -> str | None:
    m = re.search(r"GPU (\d+)", msg)
    if m:
        return f"cuda:{m.group(1)}"
    return str(devices[0]) if devices else None


def _out_of_memory_cause(e: BaseException) -> BaseException | None:
    """The CUDA out-of-memory error behind ``e``, if any.

    torch.distributed.pipelining re-raises a stage's failure as a RuntimeError ("Failed
    to run stage backward") whose cause is the ``torch.OutOfMemoryError``.
    """
    seen = 0
    while e is not None and seen < 8:
        if isinstance(e, torch.OutOfMemoryError) or "CUDA out of memory" in str(e):
            return e
        e = e.__cause__ or e.__context__
        seen += 1
    return None


def _maybe_fail(step: int, rank: int) -> None:
    """Fault injection for tests: SIGKILL this process at a given step."""
    at = os.environ.get("AUTOPLACE_FAIL_AT_STEP")
    if at is not None and int(at) == step and int(os.environ.get("AUTOPLACE_FAIL_RANK", "0")) == rank:
        os.kill(os.getpid(), signal.SIGKILL)


class NonFiniteLoss(Exception):
    """The training loss became NaN or infinite at ``step``."""

    def __init__(self, step: int, value: float) -> None:
        super().__init__(f"the loss is {value} at step {step}: training diverged (lower the "
                         "learning rate, check the data and the model's numerics)")
        self.step = step


class _Tracer:
    """``torch.profiler`` over the timed steps of a run, when ``opts.trace_dir`` asks."""

    def __init__(self, opts: RunOptions, devices: list[torch.device], rank: int,
                 start: int) -> None:
        self.devices = devices
        self.first = max(start, opts.warmup)
        self.prof: Any = None
        self.span: Any = None
        self.path = str(Path(opts.trace_dir) / f"trace-rank{rank}.json") \
            if opts.trace_dir else None

    def step(self, step: int) -> None:
        """Start recording at the first timed step; mark each step as a span."""
        if self.path is None or step < self.first:
            return
        if self.prof is None:
            from torch.profiler import ProfilerActivity, profile

            acts = [ProfilerActivity.CPU]
            if any(d.type == "cuda" for d in self.devices):
                acts.append(ProfilerActivity.CUDA)
            self.prof = profile(activities=acts, record_shapes=False)
            self.prof.__enter__()
        self._end_span()
        self.span = torch.profiler.record_function(f"autoplace step {step}")
        self.span.__enter__()

    def _end_span(self) -> None:
        if self.span is not None:
            self.span.__exit__(None, None, None)
            self.span = None

    def close(self, save: bool = True) -> bool:
        """Stop recording; write the trace when ``save`` (a failed run writes none).
        Whether a trace was written."""
        if self.prof is None:
            return False
        self._end_span()
        self.prof.__exit__(None, None, None)
        prof, self.prof = self.prof, None
        if save:  # atomically: a trace this folder held before stays whole until replaced
            path = Path(self.path)
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
            try:
                prof.export_chrome_trace(str(tmp))
                os.replace(tmp, path)
            finally:
                tmp.unlink(missing_ok=True)
        return save


def run_here(workload: Workload, plan: Plan, cluster: Cluster, opts: RunOptions,
             *, copy_model: bool = True) -> RunReport:
    """Run ``plan`` in this process (one rank of it when torch.distributed is initialised).

    ``copy_model=False``: train ``workload.model`` itself instead of a copy (a process
    that built the workload for this run only saves the copy's time and memory).
    """
    par = plan.parallel
    # a one-process plan ignores a process group it may run inside (a benchmark job)
    nproc = process_count(plan)
    distributed = dist.is_available() and dist.is_initialized() and nproc > 1
    rank = dist.get_rank() if distributed else 0
    world = dist.get_world_size() if distributed else 1
    if world != nproc:
        raise PlanError(f"plan needs {nproc} processes, this run has {world}")
    report = RunReport(plan=plan.describe(), global_batch_size=workload.batch_size,
                       steps=opts.steps, warmup=opts.warmup, torch_version=torch.__version__)
    all_devices = [torch.device(cluster.devices[i].name) for i in range(plan.num_devices)]
    report.devices = [str(d) for d in all_devices]
    report.device_names = [_device_name(d) for d in all_devices]

    t_run = time.perf_counter()
    graph = capture_graph(workload)
    validate(graph, plan, cluster)
    micro = build.micro_batch_size(workload.batch_size, plan)
    if graph.module is not None and (rnd := random_ops(graph.module)):
        report.extra["random_ops"] = len(rnd)
    start = 0

    if opts.reference and rank == 0:
        chunks = par.data * par.microbatches if _has_batch_coupling(workload.model) else 1
        report.reference_loss = reference_losses(workload, opts.steps, opts.seed,
                                                 all_devices[0], chunks)
        report.extra["reference_chunks"] = chunks
    if distributed:
        dist.barrier()

    built = None
    tracer = None
    recorder = None
    group = contextlib.ExitStack()  # an offloaded plan's process group of one, CPU threads
    t_build = time.perf_counter()
    try:
        if par.offload and not distributed:
            group.enter_context(one_rank_group(all_devices[0]))
        exec_workload = replace(workload, model=copy.deepcopy(workload.model)) \
            if copy_model else workload
        if micro != workload.batch_size:
            # not at 1: torch.export specialises a dimension of size 1, and the graph it
            # gives (Hugging Face T5: other ops) is not the one the plan names
            exec_graph = capture_graph(exec_workload, max(micro, min(2, workload.batch_size)))
        else:  # the model trained is the one captured above: reuse that capture
            exec_graph = capture_graph(exec_workload) if copy_model else graph
        report.extra["expandable_segments"] = build.cap_allocator(cluster)
        built = build.build_rank(exec_workload, exec_graph, plan, cluster, rank, micro)
        build.apply_memory_caps(built.devices, cluster, built.cluster_indices)
        report.extra.update(built.info)
        for d in built.devices:
            if d.type == "cuda":
                torch.cuda.reset_peak_memory_stats(d)
        params = [p for p in built.model.parameters() if p.requires_grad]
        if par.offload and params:  # the shards are on the host: AdamW steps on the CPU
            report.extra["host_threads"] = group.enter_context(host_threads(built.devices[0]))
            opt = offload_optimizer(params, workload.lr)
        else:
            opt = workload_optimizer(params, workload, built.devices[0],
                                     shard_state=par.shard_optimizer)
        if opts.resume and opts.checkpoint_dir:
            start = load_checkpoint(opts.checkpoint_dir, built.state_module, opt)
        losses: list[torch.Tensor] = []
        times: list[float] = []
        report.extra["build_s"] = round(time.perf_counter() - t_build, 3)
        t_steps = time.perf_counter()
        tracer = _Tracer(opts, built.devices, rank, start)
        recorder = MemoryRecorder(opts.memory_dir, built.devices, rank,
                                  recorded_step(start, opts.warmup))
        pin = any(d.type == "cuda" for d in built.devices)
        cache = False if plan.parallel.graphs else None  # a capture needs autocast uncached
        counts_before = None  # the allocator's counters at the first timed step
        for step in range(start, opts.steps):
            if step == max(start, opts.warmup):
                counts_before = build.allocator_counts(built)
            tracer.step(step)
            recorder.step(step)
            _maybe_fail(step, rank)
            inputs, targets = global_batch(workload, step, opts.seed, pin=pin)
            _sync(built.devices)
            t0 = time.perf_counter()
            loss = built.step(inputs, targets, lambda: workload_autocast(
                workload, built.devices[0], cache=cache))
            opt.step()
            opt.zero_grad(set_to_none=True)
            _sync(built.devices)
            times.append(time.perf_counter() - t0)
            losses.append(loss.detach().float().reshape(()))
            if built.has_loss and not math.isfinite(value := float(losses[-1])):
                raise NonFiniteLoss(step, value)
            if opts.checkpoint_dir and (step + 1) % opts.checkpoint_every == 0:
                save_checkpoint(opts.checkpoint_dir, built.state_module, opt, step + 1)
            if opts.progress and rank == 0:
                print(f"step {step}: {times[-1] * 1e3:.1f} ms", flush=True)
        report.extra["steps_s"] = round(time.perf_counter() - t_steps, 3)
        if par.offload:  # between steps every shard is back in host memory
            report.extra["params_on_host"] = on_host(built.model)
        if (compiled := compile_summary(built.model, built.state_module)) is not None:
            report.extra["compile"] = compiled  # its seconds are in the warm-up steps'
        if tracer.close():
            report.extra["trace"] = tracer.path
        if recorder.close():
            report.extra["memory_record"] = recorder.paths
        counts_after = build.allocator_counts(built)
        allocator = build.allocator_delta(counts_before or counts_after, counts_after, built)
        report.loss, step_times, report.peak_memory_bytes, allocator = build.gather_results(
            built, losses, times, plan, distributed, allocator)
        if allocator:  # CUDA devices only: what the timed steps cost the caching allocator
            report.extra["allocator"] = {str(i): allocator[i] for i in sorted(allocator)}
        report.step_times_s = step_times[max(0, opts.warmup - start):]
        report.extra["warmup_step_s"] = [round(t, 4) for t in
                                         step_times[:max(0, opts.warmup - start)]]
        if "compile" in report.extra and report.step_times_s:
            # what the warm-up steps cost beyond as many timed ones: compilation, mostly
            warm = report.extra["warmup_step_s"]
            report.extra["compile"]["warmup_overhead_s"] = round(
                sum(warm) - len(warm) * statistics.median(report.step_times_s), 3)
    except NonFiniteLoss as e:
        # stop here: the steps after a NaN or an infinity train nothing, and a report
        # without an error would read as a run that worked
        report.error = str(e)
        report.extra["non_finite_step"] = e.step
        report.loss = [float(x) for x in losses]
        if distributed:  # the other ranks wait in a collective: the worker ends the job
            print(f"rank {rank}: {report.error}", flush=True)
    except (torch.OutOfMemoryError, RuntimeError) as e:
        oom = _out_of_memory_cause(e)
        if oom is None:
            raise
        msg = str(oom).split("\n")[0]
        # the error's traceback holds this frame: don't let ``oom`` make that a cycle. The
        # model and activations are still only freed by a garbage collection after this
        # returns (fx graphs are cycles too): a long-lived process must collect between
        # runs, or its next run starts with this one's memory allocated
        oom = None
        report.oom = True
        report.oom_device = _oom_device(msg, built.devices if built else all_devices)
        report.error = f"out of memory on {report.oom_device}: {msg}"
        if distributed:  # the other ranks are stuck in a collective: stop them all
            print(f"rank {rank}: {report.error}", flush=True)
    finally:
        if tracer is not None:  # still recording: the run failed
            tracer.close(save=False)
        if recorder is not None and recorder.on:  # the failed step's history is kept
            report.extra["memory_record"] = recorder.close()
        recorder = None
        built = None
        tracer = None
        opt = None
        t_free = time.perf_counter()
        _free()
        build.reset_memory_caps(all_devices)
        build.cap_allocator(None)
        group.close()
        report.extra["teardown_s"] = round(time.perf_counter() - t_free, 3)
        report.extra["run_s"] = round(time.perf_counter() - t_run, 3)
    if start:
        report.extra["start_step"] = start
        report.reference_loss = report.reference_loss[start:]
    return report.finish()
