"""The torchrun entry: one rank of a multi-process plan (``-m autoplace.executor.worker``)."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from autoplace import workloads
from autoplace.cluster import Cluster
from autoplace.executor.runner import RunOptions, run_here
from autoplace.executor.weights import load_workload
from autoplace.plan import Plan


def _write(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + f".{os.getpid()}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def main(argv: list[str] | None = None) -> int:
    """Read the config, join the process group, run this rank, write the report."""
    t0 = time.perf_counter()
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", required=True)
    cfg = json.loads(Path(ap.parse_args(argv).config).read_text())
    plan = Plan.from_json(cfg["plan"])
    cluster = Cluster.from_json(cfg["cluster"])
    spec = cfg["workload"]
    opts = RunOptions(**cfg["options"])
    rank = int(os.environ["RANK"])
    k = plan.devices_per_replica
    first = rank if plan.parallel.pipeline > 1 else rank * k
    device = torch.device(cluster.devices[first].name)
    if device.type == "cuda":
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
    else:
        dist.init_process_group("gloo")
    t_init = time.perf_counter()
    if opts.weights_file:
        workload = load_workload(spec, opts.weights_file)
    else:
        workload = workloads.get(spec["spec"], seed=spec.get("seed", 0),
                                 **spec.get("options", {}))
    t_loaded = time.perf_counter()
    report = run_here(workload, plan, cluster, opts, copy_model=not opts.reference)
    report.extra["init_s"] = round(t_loaded - t_init, 3)
    report.extra["group_init_s"] = round(t_init - t0, 3)
    out = Path(cfg["out"])
    if report.error:
        _write(out.with_name(f"{out.name}.rank{rank}"), report.dumps())
        print(f"rank {rank}: {report.error}", file=sys.stderr, flush=True)
        os._exit(1)  # the other ranks may wait in a collective: torchrun stops them
    if rank == 0:
        _write(out, report.dumps())
    dist.barrier()
    dist.destroy_process_group()
    # Skip interpreter teardown: on CPU/gloo it sometimes aborts ("terminate called without
    # an active exception") while destroying a background thread, after the run is done.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    sys.exit(main())
