"""Host costs of data parallelism, measured on one GPU: DDP and FSDP2 over a group of one.

    python scripts/bench/bench_host_costs.py                      # on a GPU machine
    python scripts/bench/bench_host_costs.py --cpu --scenarios tiny --synthetic 4x1 --out /tmp/h

The simulator charges DDP's and FSDP2's own work per parameter tensor (``Device.
ddp_param_host_s``, ``shard_param_host_s``: constants fitted on 2-GPU suites). That work
(DDP's autograd hooks and buckets; FSDP2's copy-in, all-gather, copy-out, hooks and
reduce-scatter) does not depend on how many ranks there are, so one GPU can measure it:
every model is trained plain, under DDP and under FSDP2 (by blocks, as the executor wraps
it) and ZeRO-2, in one process group of one rank, built by the executor's own code
(``build_local``, ``wrap_data_parallel``), and the step times are compared.

Two kinds of model: the suite's scenarios (``bench_plans.py``; the ``hf-*`` ones with
``--hf-module``) at the batch one
replica of a 2-GPU data-parallel plan trains (half the scenario's), and synthetic stacks
of ``B`` blocks of ``L`` tiny linear layers (``--synthetic BxL,...``: 2 B L parameter
tensors, ``B`` FSDP2 units) whose steps are host-bound, so that the extra step time of a
mode is its host work: a fit over them gives the per-tensor and per-unit cost.

Per model and mode the JSON holds the median step time (synchronised), the median host
time of a step (the wall time until ``optimizer.step()`` returns, before synchronising),
parameter tensors, FSDP2 units, parameter bytes and the peak allocated and reserved memory.
It is ``host-costs.json`` in ``--out``, by default a new run folder
``bench/results/<date>-<card>x1-host-costs/`` (with ``env.json`` and ``run.json``).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time
from dataclasses import replace
from typing import Any

import bench_plans as bp
import torch
import torch.distributed as dist
import torch.nn.functional as F
from results import write_run
from run_folder import output_folder
from torch import nn

MODES = ("plain", "ddp", "fsdp", "zero2")


class Stack(nn.Module):
    """``blocks`` blocks of ``layers`` linear layers of width ``width``."""

    def __init__(self, blocks: int, layers: int, width: int = 64) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(
            nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)])
            for _ in range(blocks))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = b(x)
        return x


def synthetic(blocks: int, layers: int, seed: int = 0):
    from autoplace.workloads import Workload

    torch.manual_seed(seed)

    def make_batch(bs, device):
        return (torch.randn(bs, 64, device=device),), torch.randn(bs, 64, device=device)

    return Workload(name=f"stack-{blocks}x{layers}", model=Stack(blocks, layers),
                    make_batch=make_batch, loss_fn=F.mse_loss, batch_size=8)


def scenario(name: str, seed: int = 0, hf_module: str | None = None):
    from autoplace import workloads

    sc = bp.scenario(name, hf_module)
    wl = workloads.get(sc["model"], seed=seed, **sc["options"])
    return replace(wl, batch_size=max(1, wl.batch_size // 2))  # one replica of dp=2


def fsdp_units(model: nn.Module) -> int:
    """FSDP2 parameter groups (one all-gather each) in ``model``."""
    groups = set()
    for m in model.modules():
        state = m._get_fsdp_state() if hasattr(m, "_get_fsdp_state") else None
        group = getattr(state, "_fsdp_param_group", None)
        if group is not None:
            groups.add(id(group))
    return len(groups)


def measure(make, mode: str, dev: torch.device, steps: int, warmup: int) -> dict[str, Any]:
    """Train a fresh workload under ``mode`` for ``warmup + steps`` steps in this process."""
    from autoplace.executor.data import wrap_data_parallel
    from autoplace.executor.local import build_local
    from autoplace.executor.runner import (
        capture_graph,
        global_batch,
        workload_autocast,
        workload_optimizer,
    )
    from autoplace.lowering import ROOT_UNIT, fsdp_unit_keys, gather_dtype, issue_order
    from autoplace.plan import Plan

    wl = make()
    graph = capture_graph(wl)
    plan = Plan.from_groups(graph, {op: 0 for op in graph.order}, [0])
    program = build_local(graph.module, plan, [dev], wl.loss_fn,
                          order=issue_order(graph, plan), graphs=False)
    model: nn.Module = program
    if mode != "plain":
        mesh = None
        if mode != "ddp":
            from torch.distributed.device_mesh import init_device_mesh

            mesh = init_device_mesh(dev.type, (1,))
        # FSDP2's units as the executor shards them: by blocks, the root takes the rest
        keys = dict(zip(graph.order, fsdp_unit_keys(graph, "blocks")))
        units = {op.target: keys[op.name] for op in graph.ops if keys[op.name] != ROOT_UNIT}
        dtype = gather_dtype(graph, dev.type)
        model = wrap_data_parallel(program, units, "none" if mode == "ddp" else mode,
                                   mesh=mesh, device=dev,
                                   param_dtype=getattr(torch, dtype) if dtype else None)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = workload_optimizer(params, wl, dev)
    cuda = dev.type == "cuda"
    if cuda:
        torch.cuda.synchronize(dev)
        torch.cuda.reset_peak_memory_stats(dev)
    step_s, host_s = [], []
    for step in range(warmup + steps):
        inputs, targets = global_batch(wl, step, 0, pin=cuda)
        if cuda:
            torch.cuda.synchronize(dev)
        t0 = time.perf_counter()
        with workload_autocast(wl, dev):
            loss = model(inputs, targets)
            loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        t1 = time.perf_counter()
        if cuda:
            torch.cuda.synchronize(dev)
        t2 = time.perf_counter()
        if step >= warmup:
            step_s.append(t2 - t0)
            host_s.append(t1 - t0)
    rec = {
        "mode": mode, "step_s": statistics.median(step_s), "host_s": statistics.median(host_s),
        "step_min_s": min(step_s), "param_tensors": len(params),
        "param_bytes": sum(p.numel() * p.element_size() for p in params),
        "fsdp_units": fsdp_units(model) if mode in ("fsdp", "zero2") else 0,
        "ops": len(graph.order), "batch_size": wl.batch_size,
        "loss": float(loss.detach().float()),
    }
    if cuda:
        rec["peak_allocated_bytes"] = torch.cuda.max_memory_allocated(dev)
        rec["peak_reserved_bytes"] = torch.cuda.max_memory_reserved(dev)
    del model, program, opt, params, graph, wl, loss
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    return rec


def fit(rows: list[dict[str, Any]], mode: str) -> dict[str, float] | None:
    """Least squares of a mode's extra step time over plain on the synthetic stacks:
    ``extra = a * tensors + u * units + c`` (FSDP2) or ``a * tensors + c`` (DDP)."""
    import numpy as np

    pts = []
    for r in rows:
        if not r["name"].startswith("stack-") or mode not in r["modes"]:
            continue
        m, p = r["modes"][mode], r["modes"]["plain"]
        pts.append((m["param_tensors"], m["fsdp_units"], m["step_s"] - p["step_s"]))
    if len(pts) < 3:
        return None
    a = np.array([[t, u, 1.0] if mode != "ddp" else [t, 1.0] for t, u, _ in pts])
    y = np.array([e for *_, e in pts])
    coef, *_ = np.linalg.lstsq(a, y, rcond=None)
    if mode == "ddp":
        return {"per_tensor_s": float(coef[0]), "const_s": float(coef[1])}
    return {"per_tensor_s": float(coef[0]), "per_unit_s": float(coef[1]),
            "const_s": float(coef[2])}


def fits_summary(fits: dict[str, Any]) -> str:
    """One line of the fitted host costs per mode, for ``run.json``."""
    def us(x):
        return "-" if x is None else f"{x * 1e6:.0f} us"

    parts = []
    for mode, f in fits.items():
        if f and f.get("per_tensor_s") is not None:
            unit = f" + {us(f['per_unit_s'])} per unit" if "per_unit_s" in f else ""
            parts.append(f"{mode} {us(f['per_tensor_s'])} per tensor{unit}")
    return ("Host work of data parallelism in a group of one: " + "; ".join(parts) + "."
            if parts else "Host work of data parallelism in a group of one: no fit.")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--scenarios", default=None,
                    help="bench_plans.py scenarios (default: branchy-mlp, inception, "
                         "gnmt4-capped, gpt1b, and with --hf-module hf-gpt2, hf-bert, hf-t5)")
    ap.add_argument("--hf-module", default=None, metavar="MODULE",
                    help="module of the hf-* scenarios' model factories, as bench_plans.py's")
    ap.add_argument("--synthetic", default="4x1,4x8,16x1,16x4,32x1,32x4",
                    help="BxL stacks (B blocks of L linear layers); '' for none")
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--deadline-s", type=float, default=420)
    ap.add_argument("--cpu", action="store_true", help="CPU and gloo (a smoke test)")
    ap.add_argument("--out", default=None,
                    help="folder for host-costs.json (default: a new run folder under "
                         "bench/results)")
    args = ap.parse_args()
    if args.scenarios is None:
        args.scenarios = ",".join(["branchy-mlp", "inception", "gnmt4-capped", "gpt1b"]
                                  + (["hf-gpt2", "hf-bert", "hf-t5"] if args.hf_module else []))
    names = [s for s in args.scenarios.split(",") if s]
    for name in names:
        bp.scenario(name, args.hf_module)  # an unknown or unresolvable name stops here
    t_start = time.perf_counter()
    cuda = torch.cuda.is_available() and not args.cpu
    dev = torch.device("cuda:0" if cuda else "cpu")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    if cuda:
        torch.cuda.set_device(dev)
        dist.init_process_group("nccl", rank=0, world_size=1, device_id=dev)
    else:
        dist.init_process_group("gloo", rank=0, world_size=1)
    modes = [m for m in args.modes.split(",") if m]
    jobs: list[tuple[str, Any]] = []
    for spec in [s for s in args.synthetic.split(",") if s]:
        b, layers = (int(x) for x in spec.split("x"))
        jobs.append((f"stack-{b}x{layers}", lambda b=b, layers=layers: synthetic(b, layers)))
    for name in names:
        jobs.append((name, lambda name=name: scenario(name, hf_module=args.hf_module)))
    card = torch.cuda.get_device_name(dev) if cuda else "cpu"
    folder = output_folder(args.out, "host-costs", card=card, gpus=1)
    path = folder / "host-costs.json"
    out: dict[str, Any] = {
        "device": card,
        "torch_version": torch.__version__, "steps": args.steps, "warmup": args.warmup,
        "models": []}
    for name, make in jobs:
        rec: dict[str, Any] = {"name": name, "modes": {}}
        for mode in modes:
            if time.perf_counter() - t_start > args.deadline_s:
                rec.setdefault("skipped", []).append(mode)
                continue
            try:
                r = measure(make, mode, dev, args.steps, args.warmup)
            except Exception as e:  # a mode that fails on a model is recorded, not fatal
                rec["modes"][mode] = {"mode": mode, "error": f"{type(e).__name__}: {e}"[:500]}
                print(f"{name} {mode}: {type(e).__name__}: {str(e)[:200]}", flush=True)
                gc.collect()
                if cuda:
                    torch.cuda.empty_cache()
                continue
            rec["modes"][mode] = r
            base = rec["modes"].get("plain", {}).get("step_s")
            extra = f" (+{(r['step_s'] - base) * 1e3:.2f} ms)" if base and mode != "plain" else ""
            print(f"{name} {mode}: step {r['step_s'] * 1e3:.2f} ms{extra}, host "
                  f"{r['host_s'] * 1e3:.2f} ms, {r['param_tensors']} tensors, "
                  f"{r['fsdp_units']} units, {time.perf_counter() - t_start:.0f} s", flush=True)
        out["models"].append(rec)
        path.write_text(json.dumps(out, indent=1))
    out["fits"] = {m: fit(out["models"], m) for m in modes if m != "plain"}
    print("fits over the synthetic stacks:", json.dumps(out["fits"], indent=1), flush=True)
    path.write_text(json.dumps(out, indent=1))
    write_run(folder, tag="host-costs", scenarios=["host:ddp-fsdp"], kind="experiment",
              script="scripts/bench/bench_host_costs.py", summary=fits_summary(out["fits"]))
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
