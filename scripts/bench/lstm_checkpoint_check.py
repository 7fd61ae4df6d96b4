"""Whether a checkpointed cuDNN LSTM's backward fails on a GPU, alone and in GNMT-4's
annealed placement.

GNMT-4's annealed placement at 4.37 GiB (one checkpointed group holding a decoder LSTM,
compiled) died in ``loss.backward()`` with "SystemError: <built-in method run_backward>
returned NULL without setting an exception" when run third in one process of
``bench_memory_record.py gnmt-placements``, after two other placements. This runs one
LSTM under ``torch.utils.checkpoint`` with its weights packed and not, under bf16
autocast, reentrant, without cuDNN; then the annealed placement and its twin without
recompute, in a fresh process. Prints ``ok`` or the exception per case.

    python scripts/bench/lstm_checkpoint_check.py
"""

from __future__ import annotations

import traceback
import warnings

import torch
from bench_memory_record import GNMT, GNMT_CAP
from torch import nn
from torch.utils.checkpoint import checkpoint

from autoplace import planners, workloads
from autoplace.cluster import Cluster
from autoplace.costs.profile import profile
from autoplace.executor.launch import run_plan
from autoplace.executor.runner import RunOptions
from autoplace.plan import Plan


def one_lstm(name: str, unpacked: bool = False, ignore: bool = False, autocast: bool = False,
             reentrant: bool = False, cudnn: bool = True) -> None:
    dev = torch.device("cuda:0")
    torch.manual_seed(0)
    lstm = nn.LSTM(256, 256).to(dev)
    if unpacked:  # a storage per weight, as moving them one at a time leaves them
        for n in lstm._flat_weights_names:
            setattr(lstm, n, nn.Parameter(getattr(lstm, n).detach().clone()))
    x = torch.randn(20, 8, 256, device=dev, requires_grad=True)
    try:
        with warnings.catch_warnings(), torch.backends.cudnn.flags(enabled=cudnn), \
                torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
            if ignore:
                warnings.simplefilter("ignore")
            y = checkpoint(lambda t: lstm(t)[0], x, use_reentrant=reentrant)
            y.float().sum().backward()
        torch.cuda.synchronize()
        print(f"{name}: ok", flush=True)
    except Exception as e:  # the point: which case fails, and how
        print(f"{name}: {type(e).__name__}: {str(e)[:300]}", flush=True)


def main() -> None:
    one_lstm("packed")
    one_lstm("packed, autocast", autocast=True)
    one_lstm("unpacked", unpacked=True)
    one_lstm("unpacked, warnings ignored", unpacked=True, ignore=True)
    one_lstm("unpacked, autocast", unpacked=True, autocast=True)
    one_lstm("packed, reentrant", reentrant=True)
    one_lstm("unpacked, reentrant", unpacked=True, reentrant=True)
    one_lstm("unpacked, no cuDNN", unpacked=True, cudnn=False)
    wl = workloads.get("gnmt-4", **GNMT)
    g = profile(wl, ["cuda:0"], repeats=3, cache_dir="/tmp/autoplace-profile")
    base = Cluster.detect().subset([0, 1])
    p = planners.get("anneal")(g, base.with_memory_cap(GNMT_CAP))
    print("anneal plan:", p.describe(), "recompute groups", sorted(p.recompute), flush=True)
    for gid in sorted(p.recompute):
        print("  group", gid, [n for n, x in p.groups.items() if x == gid][:12], flush=True)
    plain = Plan.from_groups(g, p.groups, list(p.placement), parallel=p.parallel)
    for label, plan in (("anneal", p), ("anneal without recompute", plain)):
        try:
            r = run_plan(plan, wl, cluster=base, timeout_s=300,
                         options=RunOptions(steps=3, warmup=1, reference=False))
            print(label, "ok" if r.error is None else r.error[:300], r.step_time_s, flush=True)
        except Exception as e:  # reported, as above
            print(label, type(e).__name__, str(e)[:300], flush=True)
            traceback.print_exc(limit=3)


if __name__ == "__main__":
    main()
