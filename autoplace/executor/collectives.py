"""Measured collective speed: all-reduce, all-gather and reduce-scatter between devices.

:func:`measure_collectives` starts a torchrun job with one process per device (NCCL on
GPUs, gloo on CPU: the process groups plans run with), times each collective at
several sizes, and fits ``time = alpha + bus_bytes / bus_bandwidth`` per kind, where
``bus_bytes`` is what each rank sends over the slowest link in a ring (all-reduce
``2(p-1)/p * n``, all-gather and reduce-scatter ``(p-1)/p * n`` for an ``n``-byte
buffer): the terms of :mod:`autoplace.costs.collectives`.
:func:`with_measured_links` puts them, and measured copy speeds between every device
pair, into a :class:`~autoplace.cluster.Cluster`.

    python -m torch.distributed.run --standalone --nproc-per-node 2 \\
        -m autoplace.executor.collectives --out coll.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from autoplace.cluster import Cluster
from autoplace.costs.links import fit_alpha_beta, measure_links
from autoplace.errors import AutoplaceError

__all__ = ["measure_collectives", "measured_cluster", "with_measured_links"]

KINDS = ("allreduce", "allgather", "reducescatter")
GPU_SIZES = (2**20, 2**23, 2**26, 2**28)
CPU_SIZES = (2**12, 2**16, 2**20)


def bus_factor(kind: str, p: int) -> float:
    """Bytes each rank sends per buffer byte in a ring collective over ``p`` ranks."""
    return (2 if kind == "allreduce" else 1) * (p - 1) / p


def measure_collectives(devices: list[str], *, sizes: tuple[int, ...] | None = None,
                        repeats: int = 5, timeout_s: float = 180) -> dict[str, Any]:
    """Time collectives over ``devices`` (one process each) and fit their speed.

    Returns:
        ``{"allreduce": {"alpha_s", "bus_bandwidth", "points"}, "allgather": ...,
        "reducescatter": ..., "devices", "backend"}``; ``points`` are ``[bytes,
        seconds]`` per size (the slowest rank's mean of ``repeats`` calls).

    Raises:
        AutoplaceError: fewer than two devices, or the job failed or timed out.
    """
    if len(devices) < 2:
        raise AutoplaceError(f"collectives need at least two devices, got {devices}")
    cpu = all(d.startswith("cpu") for d in devices)
    sizes = sizes or (CPU_SIZES if cpu else GPU_SIZES)
    with tempfile.TemporaryDirectory(prefix="autoplace-coll-") as tmp:
        out = Path(tmp) / "coll.json"
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               f"--nproc-per-node={len(devices)}", "-m", "autoplace.executor.collectives",
               "--out", str(out), "--devices", ",".join(devices),
               "--sizes", ",".join(str(s) for s in sizes), "--repeats", str(repeats)]
        env = dict(os.environ, NCCL_NVLS_ENABLE="0", TORCH_SYMM_MEM_DISABLE_MULTICAST="1")
        env.setdefault("OMP_NUM_THREADS", "1")
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, env=env,
                                  timeout=timeout_s)
        except subprocess.TimeoutExpired as e:
            raise AutoplaceError(f"measuring collectives over {devices} took longer than "
                                 f"{timeout_s:.0f} s") from e
        if proc.returncode != 0 or not out.exists():
            tail = "\n".join((proc.stdout + proc.stderr).splitlines()[-12:])
            raise AutoplaceError(f"measuring collectives over {devices} failed "
                                 f"(exit {proc.returncode}):\n{tail}")
        raw = json.loads(out.read_text())
    p = len(devices)
    result: dict[str, Any] = {"devices": list(devices), "backend": raw["backend"]}
    for kind in KINDS:
        pts = raw["points"][kind]
        alpha, bw = fit_alpha_beta([int(n * bus_factor(kind, p)) for n, _ in pts],
                                    [t for _, t in pts])
        result[kind] = {"alpha_s": alpha, "bus_bandwidth": bw, "points": pts}
    return result


def with_measured_links(cluster: Cluster, links: tuple[list[list[float]], list[list[float]]]
                        | None, collectives: dict[str, Any] | None) -> Cluster:
    """``cluster`` with measured copy latency/bandwidth per device pair (``links``, from
    :func:`autoplace.costs.links.measure_links`) and measured collective speed: the median
    over the three kinds of their latency per ring step and bus bandwidth."""
    out = cluster
    if links is not None:
        alpha, bw = links
        n = cluster.num_devices
        if len(alpha) != n:
            raise AutoplaceError(f"links measured for {len(alpha)} devices, cluster has {n}")
        out = replace(out, alpha_s=tuple(tuple(r) for r in alpha),
                      bandwidth=tuple(tuple(r) for r in bw))
    if collectives is not None:
        p = len(collectives["devices"])
        steps = {"allreduce": 2 * (p - 1)}
        alphas = [collectives[k]["alpha_s"] / steps.get(k, p - 1) for k in KINDS]
        out = replace(out, collective_alpha_s=statistics.median(alphas),
                      collective_bandwidth=statistics.median(
                          collectives[k]["bus_bandwidth"] for k in KINDS))
    return out


def measured_cluster(cluster: Cluster) -> tuple[Cluster, str]:
    """``cluster`` with copy speeds between every pair of its devices and collective
    speeds measured here (:func:`with_measured_links`), and a one-line summary."""
    names = [d.name for d in cluster.devices]
    links = measure_links(names)
    coll = measure_collectives(names)
    out = with_measured_links(cluster, links, coll)
    bw = [x for i, row in enumerate(links[1]) for j, x in enumerate(row) if i != j]
    summary = (f"copies {min(bw) / 1e9:.0f}-{max(bw) / 1e9:.0f} GB/s; collectives' bus "
               "bandwidth " + ", ".join(f"{k} {coll[k]['bus_bandwidth'] / 1e9:.0f} GB/s"
                                        for k in KINDS)
               + f" (simulated with {out.collective_bandwidth / 1e9:.0f} GB/s, "
                 f"{out.collective_alpha_s * 1e6:.0f} us a ring step)")
    return out, summary


# ------------------------------------------------------------------ one rank
def _collective(kind: str, full: Any, part: Any) -> Any:
    if kind == "allreduce":
        return lambda: dist.all_reduce(full)
    if kind == "allgather":
        return lambda: dist.all_gather_into_tensor(full, part)
    return lambda: dist.reduce_scatter_tensor(part, full)


def _rank_main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="one rank of measure_collectives")
    ap.add_argument("--out", required=True)
    ap.add_argument("--devices", required=True)
    ap.add_argument("--sizes", required=True)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args(argv)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    device = torch.device(args.devices.split(",")[rank])
    if device.type == "cuda":
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
    else:
        dist.init_process_group("gloo")

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    points: dict[str, list[list[float]]] = {k: [] for k in KINDS}
    for kind in KINDS:
        for nbytes in (int(s) for s in args.sizes.split(",")):
            n = max(world, nbytes // 4 // world * world)
            full = torch.ones(n, device=device)
            part = torch.ones(n // world, device=device)
            call = _collective(kind, full, part)
            for _ in range(2):
                call()
            sync()
            dist.barrier()
            t0 = time.perf_counter()
            for _ in range(args.repeats):
                call()
            sync()
            t = torch.tensor([(time.perf_counter() - t0) / args.repeats], device=device)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)  # the slowest rank's time
            points[kind].append([n * 4, float(t.item())])
    if rank == 0:
        Path(args.out).write_text(json.dumps({"backend": dist.get_backend(),
                                               "points": points}))
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(_rank_main())
