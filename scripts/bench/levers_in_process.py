"""autoplace's execution of eager and per-block checkpointing against the same by hand, in
one process, interleaved.

    PYTHONPATH=scripts/bench python scripts/bench/levers_in_process.py   # ROUNDS=12 default

Between processes a launch-bound model carries the host's speed, which on a shared GPU
host moves by 20% and more from one process to the next (the residual MLP's eager step
measured 94-162 ms within one lease of an H200), so ``bench_levers.py``'s interleaved
processes resolve a few percent only over many rounds. Here the four loops train copies
of one model with the same weights in one process, on the same batch, ``ROUNDS`` rounds
of five steps each in alternating order (the first round is warm-up):

* ``hand-eager``, ``hand-ckpt``: the model as it is, and with each block of its
  ModuleList under ``torch.utils.checkpoint`` (``bench_levers.apply_option``), forward and
  loss under the workload's autocast, fused AdamW;
* ``auto-eager``, ``auto-ckpt``: autoplace's executor (``build_rank``) on the one-device
  plans ``checkpoint-blocks`` (``lever_plans``) and the same block groups without
  recomputation, stepped as the runner steps them.

Prints the median step time of each (ms) and autoplace's over the same by hand, then a
cProfile summary of three steps of each checkpointed loop. On a CPU (no GPU present) the
model is the residual MLP at width 32 and batch 4, host-bound as the full model is on a
card.
"""

from __future__ import annotations

import copy
import cProfile
import io
import json
import os
import pstats
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch

sys.path[:0] = [str(Path(__file__).resolve().parents[2]), str(Path(__file__).parent)]

import bench_levers as bl  # noqa: E402
import user_models  # noqa: E402

from autoplace.cluster import Cluster, resolve  # noqa: E402
from autoplace.executor import build  # noqa: E402
from autoplace.executor.inputs import capture_graph  # noqa: E402
from autoplace.executor.runner import workload_autocast, workload_optimizer  # noqa: E402
from autoplace.planners.manual import lever_plans  # noqa: E402


def main() -> int:
    cuda = torch.cuda.is_available()
    dev = torch.device("cuda", 0) if cuda else torch.device("cpu")
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    torch.manual_seed(0)
    wl = user_models.residual_mlp() if cuda else user_models.residual_mlp(
        width=32, hidden=32, features=32, batch_size=4, autocast_dtype=None)
    wl.model.to(dev)
    init = copy.deepcopy(wl.model.state_dict())
    cluster = Cluster.detect().subset([0]) if cuda else resolve("cpu-x1")
    plans = lever_plans(capture_graph(wl), cluster)
    ckpt = plans["checkpoint-blocks"]
    loops = {}
    for name, plan in (("auto-ckpt", ckpt), ("auto-eager", replace(ckpt, recompute=frozenset()))):
        model = copy.deepcopy(wl.model)
        model.load_state_dict(init)
        w = replace(wl, model=model)
        built = build.build_rank(w, capture_graph(w), plan, cluster, 0, wl.batch_size)
        opt = workload_optimizer([p for p in built.model.parameters() if p.requires_grad], w,
                                 dev)

        def step(x, y, built=built, w=w):
            return built.step(x, y, lambda: workload_autocast(w, dev))
        loops[name] = (step, opt)
    for name, option in (("hand-ckpt", "checkpoint"), ("hand-eager", "eager")):
        model = copy.deepcopy(wl.model)
        model.load_state_dict(init)
        model = bl.apply_option(model, option, "inductor")
        opt = torch.optim.AdamW(model.parameters(), lr=wl.lr, fused=cuda)

        def step(x, y, model=model):
            amp = torch.autocast(dev.type, dtype=getattr(torch, wl.autocast_dtype)) \
                if wl.autocast_dtype else torch.autocast(dev.type, enabled=False)
            with amp:
                loss = wl.loss_fn(model(*x), y)
            loss.backward()
            return loss
        loops[name] = (step, opt)
    times: dict[str, list[float]] = {k: [] for k in loops}
    order = list(loops)
    x, y = wl.make_batch(wl.batch_size, "cpu")
    x, y = x[0].to(dev), y.to(dev)
    for rnd in range(int(os.environ.get("ROUNDS", 12))):
        for name in order if rnd % 2 == 0 else order[::-1]:
            step, opt = loops[name]
            for _ in range(5):
                sync()
                t = time.perf_counter()
                step((x,), y)
                opt.step()
                opt.zero_grad(set_to_none=True)
                sync()
                if rnd > 0:
                    times[name].append(time.perf_counter() - t)
    res = {k: round(statistics.median(v) * 1e3, 2) for k, v in times.items()}
    print(json.dumps(res))
    print("ckpt auto/hand", round(res["auto-ckpt"] / res["hand-ckpt"], 3),
          "eager auto/hand", round(res["auto-eager"] / res["hand-eager"], 3))
    for name in ("hand-ckpt", "auto-ckpt"):
        step, opt = loops[name]
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(3):
            step((x,), y)
            opt.step()
            opt.zero_grad(set_to_none=True)
        sync()
        prof.disable()
        out = io.StringIO()
        pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(14)
        print(name)
        print(out.getvalue()[:3500])
    return 0


if __name__ == "__main__":
    sys.exit(main())
