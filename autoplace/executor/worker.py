"""The torchrun entry: one rank of a multi-process plan (``-m autoplace.executor.worker``).

``--config FILE``: run one plan and exit (:func:`~autoplace.executor.launch.run_plan`).
``--serve FILE``: run plan after plan for a :class:`~autoplace.executor.pool.PlanPool`.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from autoplace import workloads
from autoplace.cluster import Cluster
from autoplace.executor.lifetime import die_with_parent, watch_launcher
from autoplace.executor.pool import rank_devices, write_atomic
from autoplace.executor.runner import RunOptions, run_here
from autoplace.executor.weights import load_workload
from autoplace.plan import Plan

_T_IMPORTED = time.time()  # a pool job's start-up is reported in phases (serve)


def main(argv: list[str] | None = None) -> int:
    """Read the config, join the process group, run this rank, write the report."""
    t0 = time.perf_counter()
    ap = argparse.ArgumentParser()
    mode = ap.add_mutually_exclusive_group(required=True)
    mode.add_argument("--config")
    mode.add_argument("--serve")
    args = ap.parse_args(argv)
    die_with_parent()  # torchrun started this process detached from its own group
    watch_launcher()
    if args.serve:
        return serve(Path(args.serve))
    cfg = json.loads(Path(args.config).read_text())
    plan = Plan.from_json(cfg["plan"])
    cluster = Cluster.from_json(cfg["cluster"])
    spec = cfg["workload"]
    opts = RunOptions(**cfg["options"])
    rank = int(os.environ["RANK"])
    device = torch.device(rank_devices(plan, cluster)[rank])
    if device.type == "cuda":
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
    else:
        dist.init_process_group("gloo")
    t_init = time.perf_counter()
    trusted = cfg.get("trusted", False) is True  # the launcher's decision (run_plan)
    if opts.weights_file:
        workload = load_workload(spec, opts.weights_file, trusted=trusted)
    else:
        workload = workloads.get(spec["spec"], seed=spec.get("seed", 0), trusted=trusted,
                                 **spec.get("options", {}))
    t_loaded = time.perf_counter()
    report = run_here(workload, plan, cluster, opts, copy_model=not opts.reference)
    report.extra["init_s"] = round(t_loaded - t_init, 3)
    report.extra["group_init_s"] = round(t_init - t0, 3)
    out = Path(cfg["out"])
    if report.error:  # the other ranks may wait in a collective: torchrun stops them
        _fail(out, rank, report)
    if rank == 0:
        write_atomic(out, report.dumps())
    dist.barrier()
    dist.destroy_process_group()
    # Skip interpreter teardown: on CPU/gloo it sometimes aborts ("terminate called without
    # an active exception") while destroying a background thread, after the run is done.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _fail(path: Path, rank: int, report) -> None:
    """Write this rank's failed report and end the job: a peer may wait in a collective."""
    write_atomic(path.with_name(f"{path.name}.rank{rank}"), report.dumps())
    print(f"rank {rank}: {report.error}", file=sys.stderr, flush=True)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(1)


#: A pool job whose process still holds more than this on a GPU after a run, collected
#: and with the allocator's cache emptied, ends after reporting it (``job_retired``), and a
#: fresh job serves the next run. Healthy runs leave 64-200 MiB (cuBLAS workspaces, NCCL).
#: On 2x H200 an out-of-memory CUDA-graph capture under GNMT-4's cap left 4.3 GiB of graph
#: pools reserved in its one-process job: every later plan of that job ran out of memory.
RETIRE_HELD_BYTES = 1 << 30


def held_after_run(devices: list[str]) -> int:
    """The most memory the caching allocator still reserves on one of ``devices`` (CUDA
    devices of the run; others count 0): call after a collection and ``empty_cache``."""
    held = 0
    for d in devices:
        dev = torch.device(d)
        if dev.type == "cuda" and torch.cuda.is_available():
            held = max(held, torch.cuda.memory_reserved(dev))
    return held


def _next_command(folder: Path, k: int, parent_pid: int) -> dict:
    """Rank 0: wait for the driver's ``cmd-K.json`` (a stop when the driver is gone)."""
    path = folder / f"cmd-{k}.json"
    while not path.exists():
        try:
            os.kill(parent_pid, 0)
        except ProcessLookupError:
            return {"op": "stop"}
        time.sleep(0.02)
    return json.loads(path.read_text())


def serve(config: Path) -> int:
    """One rank of a :class:`~autoplace.executor.pool.PlanPool` job: run commands until stop.

    Each rank keeps the workload it built (by spec and weights file) between runs and
    trains a copy each time. A run that fails on a rank ends the job (see the pool): an
    out-of-memory run writes this rank's report first; any other exception is printed
    to the job's log, as in a one-shot run. A run after which a rank's allocator still
    reserves more than :data:`RETIRE_HELD_BYTES` on one of the run's GPUs also ends the
    job, after its report (``extra["job_retired"]``).
    """
    import traceback
    from datetime import timedelta

    cfg = json.loads(config.read_text())
    folder = config.parent
    rank = int(os.environ["RANK"])
    device = torch.device(cfg["devices"][rank])
    if device.type == "cuda":
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
        cmd_group = dist.new_group(backend="gloo", timeout=timedelta(days=1))
    else:
        dist.init_process_group("gloo", timeout=timedelta(days=1))
        cmd_group = dist.group.WORLD
    t_group = time.time()
    cache: dict[str, workloads.Workload] = {}

    def workload(spec: dict, weights_file: str | None) -> tuple[workloads.Workload, bool]:
        """The workload to train and whether it is this run's own (else: train a copy).
        From a weights file every run loads afresh (memory-mapped: no copy to make, and
        nothing of a run's model is kept); otherwise it is built once and copied."""
        if weights_file:
            return load_workload(spec, weights_file), True
        key = json.dumps(spec, sort_keys=True)
        if key not in cache:
            cache.clear()
            cache[key] = workloads.get(spec["spec"], seed=spec.get("seed", 0),
                                       **spec.get("options", {}))
        return cache[key], False

    if cfg.get("preload"):  # build it (and import what it needs) before the first run
        pre = cfg["preload"]
        try:
            workload(pre["workload"], pre.get("weights_file"))
        except Exception as e:  # noqa: BLE001 - a head start only: each run loads its own
            print(f"rank {rank}: preloading failed, runs will load their workload: "
                  f"{type(e).__name__}: {e}", file=sys.stderr, flush=True)
    # what lives now (torch, the modules imported, the preloaded workload) lives as long as
    # the job: keep it out of the collections after every run, which would scan it all
    gc.collect()
    gc.freeze()
    t_ready = time.time()
    # where the start-up went, reported with the first run: process start and imports
    # (torchrun's too), joining the process groups, building the preloaded workload
    start_s = {k: round(b - a, 2) for k, a, b in (
        ("imports", cfg.get("launched_at", _T_IMPORTED), _T_IMPORTED),
        ("groups", _T_IMPORTED, t_group), ("preload", t_group, t_ready))}
    if rank == 0:  # the driver may now send commands without waiting for a start
        write_atomic(folder / "ready", "")
    k = 0
    while True:
        k += 1
        box = [_next_command(folder, k, cfg["parent_pid"]) if rank == 0 else None]
        dist.broadcast_object_list(box, src=0, group=cmd_group)
        cmd = box[0]
        if cmd["op"] == "stop":
            break
        out = folder / f"rep-{k}.json"
        plan = Plan.from_json(cmd["plan"])
        cluster = Cluster.from_json(cmd["cluster"])
        spec = cmd["workload"]
        opts = RunOptions(**cmd["options"])
        try:
            if torch.device(rank_devices(plan, cluster)[rank]) != device:
                raise RuntimeError("the plan's process layout is not this job's")
            t_load = time.perf_counter()
            wl, own = workload(spec, opts.weights_file)
            load_s = time.perf_counter() - t_load
            report = run_here(wl, plan, cluster, opts, copy_model=not own)
            del wl
            report.extra["init_s"] = round(load_s, 3)
            report.extra["pool_run"] = k
            if k == 1:
                report.extra["job_start_s"] = start_s
            t_post = time.perf_counter()
            gc.collect()  # the run's reference cycles (autograd, pipelining stages)
            if device.type == "cuda":  # what this process still holds after the run
                torch.cuda.empty_cache()
                report.extra["leftover_allocated_bytes"] = torch.cuda.memory_allocated(device)
                report.extra["leftover_reserved_bytes"] = torch.cuda.memory_reserved(device)
                held = held_after_run(report.devices or [str(device)])
                if held > RETIRE_HELD_BYTES:
                    report.extra["job_retired"] = (
                        f"{held / 2**30:.2f} GiB still reserved on a GPU after the run and "
                        f"a collection (at most {RETIRE_HELD_BYTES / 2**30:g} GiB): the job "
                        "ends and a fresh one serves the next run")
            report.extra["post_s"] = round(time.perf_counter() - t_post, 3)
        except Exception:  # as a one-shot run: the log names the rank and the error
            traceback.print_exc()
            sys.stderr.flush()
            os._exit(1)
        if report.error and dist.get_world_size() > 1:  # out of memory: peers may wait
            _fail(out, rank, report)
        # every rank ends the job if one of them holds memory it cannot give back
        retire = torch.tensor([1 if "job_retired" in report.extra else 0])
        dist.all_reduce(retire, op=dist.ReduceOp.MAX, group=cmd_group)
        if retire.item() and "job_retired" not in report.extra:
            report.extra["job_retired"] = "another rank still held memory after the run"
        if rank == 0:
            write_atomic(out, report.dumps())
        if retire.item():
            break
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    sys.exit(main())
