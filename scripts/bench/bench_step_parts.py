"""Where a training step's time goes beyond its ops, measured on one card.

    python scripts/bench/bench_step_parts.py OUT MODEL [MODEL ...]
    python scripts/bench/bench_step_parts.py /tmp/parts user_models:unet user_models:residual_mlp

The profile (:mod:`autoplace.costs.profile`) times a model's ops and calibrates them on a
whole forward + backward of the captured graph; a training step also runs the loss, the
optimizer's update and ``zero_grad``, inside the workload's autocast. Per model, in one
process, interleaved over ``ROUNDS`` rounds (the host's speed drifts within a lease):

* ``hand``: the loop a user writes (forward and loss under autocast, backward outside it,
  fused AdamW, ``zero_grad(set_to_none=True)``), timed whole (one sync a step);
* ``parts``: the same loop with a sync after each part (forward + loss, backward,
  ``opt.step``, ``zero_grad``): each part's wall time, and its host time (the time to
  issue it, the device idle at its start);
* ``graph``: the profile's whole pass, forward + backward of the captured graph with ones
  as output gradients, autocast uncached (:func:`autoplace.costs.passes._step_fns`);
* ``executor``: autoplace's executor on the one-device plan (``run_here``).

It also records allocated memory after the forward, after the backward and the peak of
each loop, and the profile's own calibration (``whole_step_s``) taken in the same process.
Writes ``OUT/parts.json`` and prints a table.
"""

from __future__ import annotations

import copy
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

ROUNDS = 3
STEPS = 15
WARMUP = 5


CUDA = torch.cuda.is_available()  # a CPU run checks the script, its times mean nothing


def _sync() -> None:
    if CUDA:
        torch.cuda.synchronize()


def _allocated() -> int:
    return torch.cuda.memory_allocated() if CUDA else 0


def _median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def hand_loop(model, wl, opt, batches, parts: bool) -> dict[str, Any]:
    """Steps of the user's loop; with ``parts`` a sync after each part."""
    amp = torch.autocast("cuda", dtype=getattr(torch, wl.autocast_dtype)) \
        if wl.autocast_dtype and CUDA else torch.autocast("cpu", enabled=False)
    rec: dict[str, list[float]] = {}

    def add(k: str, v: float) -> None:
        rec.setdefault(k, []).append(v)

    def part(name: str, since: float, memory: bool = False) -> float:
        """Record a part begun at ``since``: its issue time, then (synced) its wall time;
        returns when the next part begins."""
        add(f"{name}_host", time.perf_counter() - since)
        _sync()
        add(name, time.perf_counter() - since)
        if memory:
            add(f"mem_after_{name}", _allocated())
        return time.perf_counter()

    if CUDA:
        torch.cuda.reset_peak_memory_stats()
    for i, (xs, y) in enumerate(batches):
        _sync()
        t0 = t1 = time.perf_counter()
        with amp:
            loss = wl.loss_fn(model(*xs), y)
        if parts:
            t1 = part("fwd", t1, memory=True)
        loss.backward()
        if parts:
            t1 = part("bwd", t1, memory=True)
        opt.step()
        if parts:
            t1 = part("opt", t1)
        opt.zero_grad(set_to_none=True)
        if parts:
            add("zero_host", time.perf_counter() - t1)
        _sync()
        add("step", time.perf_counter() - t0)
        if not torch.isfinite(loss.detach()):
            raise RuntimeError(f"non-finite loss at step {i}")
    out = {k: _median(v[WARMUP:]) for k, v in rec.items()}
    out["peak"] = torch.cuda.max_memory_allocated() if CUDA else 0
    return out


def graph_pass(gm, flat, autocast_dtype) -> float:
    """The profile's whole forward + backward of the captured graph (median seconds)."""
    from autoplace.costs.passes import _step_fns

    _, step = _step_fns(gm, flat)
    cast = torch.autocast("cuda", dtype=getattr(torch, autocast_dtype), cache_enabled=False) \
        if autocast_dtype and CUDA else torch.autocast("cpu", enabled=False)
    ts = []
    with cast:
        for _ in range(STEPS + WARMUP):
            _sync()
            t0 = time.perf_counter()
            step()
            _sync()
            ts.append(time.perf_counter() - t0)
    gm.zero_grad(set_to_none=True)
    return _median(ts[WARMUP:])


def measure(spec: str) -> dict[str, Any]:
    from autoplace import workloads
    from autoplace.capture import program_inputs
    from autoplace.cluster import resolve
    from autoplace.costs.profile import profile
    from autoplace.executor.runner import RunOptions, run_here
    from autoplace.plan import Plan

    dev = torch.device("cuda", 0) if CUDA else torch.device("cpu")
    wl = workloads.get(spec, seed=0, device=str(dev))
    model = wl.model
    n_params = sum(1 for _ in model.parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=wl.lr, **({"fused": True} if CUDA else {}))
    torch.manual_seed(0)
    batches = []
    for _ in range(STEPS + WARMUP):
        xs, y = wl.make_batch(wl.batch_size, "cpu")
        batches.append(([x.to(dev) if isinstance(x, torch.Tensor) else x for x in xs],
                        y.to(dev)))
    t = time.perf_counter()
    graph = profile(wl, [str(dev)], repeats=3)
    profile_s = time.perf_counter() - t
    info = getattr(graph, "profile_info", None) or {}
    whole = next((v.get("calibration") for v in info.values()
                  if isinstance(v, dict) and v.get("calibration")), {})
    gm = graph.module
    if next(iter(gm.parameters())).device != dev:
        gm = copy.deepcopy(gm).to(dev)
    flat = tuple(program_inputs(graph.module, tuple(
        x.to(dev) if isinstance(x, torch.Tensor) else x
        for x in wl.example_inputs(graph.batch_size, "cpu"))))
    cluster = resolve("h200x1" if CUDA else "cpu-x1")
    plan = Plan.single(graph)
    rounds = []
    for r in range(ROUNDS):
        row: dict[str, Any] = {}
        order = ["hand", "parts", "graph", "executor"]
        for what in (order if r % 2 == 0 else order[::-1]):
            if what == "hand":
                row["hand"] = hand_loop(model, wl, opt, batches, parts=False)
            elif what == "parts":
                row["parts"] = hand_loop(model, wl, opt, batches, parts=True)
            elif what == "graph":
                row["graph_s"] = graph_pass(gm, flat, wl.autocast_dtype)
            else:
                opts = RunOptions(steps=STEPS + WARMUP, warmup=WARMUP, reference=False, seed=0)
                rep = run_here(wl, plan, cluster, opts)
                row["executor_s"] = _median(rep.step_times_s)
                row["executor_peak"] = max(rep.peak_memory_bytes or [0])
        rounds.append(row)
        print(f"[parts] {spec} round {r}: hand {row['hand']['step'] * 1e3:.2f} ms, "
              f"graph {row['graph_s'] * 1e3:.2f}, executor {row['executor_s'] * 1e3:.2f}; "
              + ", ".join(f"{k} {v * 1e3:.2f}" for k, v in row["parts"].items()
                          if not k.startswith(("mem", "peak"))), flush=True)
    return {"model": spec, "params": n_params,
            "param_bytes": sum(p.numel() * p.element_size() for p in model.parameters()),
            "ops": len(graph.nodes) if hasattr(graph, "nodes") else None,
            "profile_s": profile_s, "calibration": whole, "rounds": rounds}


def main(argv: list[str]) -> int:
    out = Path(argv[0])
    out.mkdir(parents=True, exist_ok=True)
    sys.path.insert(0, str(Path(__file__).parent))
    results = {"card": torch.cuda.get_device_name(0) if CUDA else "cpu", "torch": torch.__version__,
               "models": []}
    for spec in argv[1:]:
        results["models"].append(measure(spec))
        (out / "parts.json").write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
