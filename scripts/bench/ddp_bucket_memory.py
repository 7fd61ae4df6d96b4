"""DDP's bucket rebuild and memory: each step's peak, with and without
``find_unused_parameters`` (which keeps the buckets DDP made first), on one GPU.

Without the flag DDP starts with one bucket of every parameter and rebuilds its buckets at
the second step; the first bucket lives on through that step, so its peak holds two copies
of the gradients. One process (a DDP group of one), a toy MLP and GNMT-4 at the suite's
size (per-rank batch 64), plain AdamW and ZeRO-1's ``ZeroRedundancyOptimizer``; step times
interleaved over three repetitions. Writes ``<out>/ddp_bucket_memory.json``.

    python scripts/bench/ddp_bucket_memory.py --out DIR
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel as DDP

from autoplace import workloads

MiB = 2**20


def _model(kind: str, dev: torch.device):
    torch.manual_seed(0)
    if kind == "mlp":
        m = nn.Sequential(*[nn.Linear(4096, 4096) for _ in range(8)]).to(dev)
        x = torch.randn(256, 4096, device=dev)
        return m, lambda mod: mod(x).float().pow(2).mean()
    w = workloads.get("gnmt-4", device=dev, hidden=1024, vocab_size=32000, src_len=50,
                      tgt_len=50, batch_size=64)
    inputs, targets = w.make_batch(64, dev)
    return w.model.to(dev), lambda mod: w.loss_fn(mod(*inputs), targets)


def run(kind: str, find_unused: bool, zero: bool, steps: int, dev: torch.device) -> dict:
    """Each step's peak above what was allocated before the model, and its time."""
    gc.collect()
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated(dev)
    model, loss_of = _model(kind, dev)
    ddp = DDP(model, device_ids=[dev], gradient_as_bucket_view=True,
              find_unused_parameters=find_unused)
    params = list(ddp.parameters())
    if zero:
        opt = ZeroRedundancyOptimizer(params, optimizer_class=torch.optim.AdamW, lr=1e-4,
                                      fused=True, parameters_as_bucket_view=False)
    else:
        opt = torch.optim.AdamW(params, lr=1e-4, fused=True)

    peaks, times = [], []
    for _ in range(steps):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats(dev)
        t0 = time.perf_counter()
        loss_of(ddp).backward()  # the loss's graph is gone when the step ends
        opt.step()
        opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        peaks.append((torch.cuda.max_memory_allocated(dev) - base) / MiB)
    rebuilt = bool(ddp._get_ddp_logging_data().get("has_rebuilt_buckets"))
    del ddp, model, opt, params
    gc.collect()
    return {"peak_mib": [round(p) for p in peaks], "step_ms": [round(t * 1e3, 3) for t in times],
            "rebuilt_buckets": rebuilt}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--steps", type=int, default=14)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    dist.init_process_group("nccl", init_method="tcp://127.0.0.1:29533", rank=0, world_size=1)
    dev = torch.device("cuda", 0)
    torch.cuda.set_device(dev)
    rows = []
    for rep in range(args.repeats):  # interleaved: every variant once per repetition
        for kind in ("mlp", "gnmt-4"):
            for find_unused in (False, True):
                for zero in (False, True):
                    r = run(kind, find_unused, zero, args.steps, dev)
                    r.update(model=kind, find_unused_parameters=find_unused, zero1=zero,
                             repeat=rep, median_ms=statistics.median(r["step_ms"][4:]))
                    rows.append(r)
                    print(f"{kind} find_unused={find_unused} zero1={zero} rep {rep}: "
                          f"peaks MiB {r['peak_mib'][:4]}... median {r['median_ms']:.2f} ms, "
                          f"rebuilt {r['rebuilt_buckets']}", flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    out = {"device": torch.cuda.get_device_name(dev), "torch": torch.__version__, "rows": rows}
    (args.out / "ddp_bucket_memory.json").write_text(json.dumps(out, indent=1))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
