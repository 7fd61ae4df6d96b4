"""The peak memory of one training step on the CPU, measured tensor storage by storage,
against the simulator's peak for the same graph and plan.

    python scripts/bench/step_memory.py --model gpt-tiny --options vocab_size=8192,d_model=128 \
        --recipes single,checkpoint-blocks --microbatches 1,2 --autocast none,bfloat16

Builds the executor's own one-device program (``executor.build.build_rank``) with the
workload's AdamW, runs one step (the optimizer's state is made there) and measures the
second: under a dispatch mode every storage an op makes is counted until it dies, whoever
holds it (autograd's saved tensors too), so the peak and what was alive at it are exact
at op granularity. Autocast, where asked, is one CPU region over forward and backward with
its cast cache on, as the executor's loop runs it on GPUs. Prints one line per case
(measured and simulated MiB, the op at the peak and its largest live tensors) and, with
``--json``, writes them. The simulated peak is ``autoplace.sim.simulate`` on
``resolve("cpu-x1")``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from pathlib import Path
from typing import Any

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from autoplace import workloads
from autoplace.cluster import resolve
from autoplace.executor import build
from autoplace.executor.runner import capture_graph, global_batch, workload_optimizer
from autoplace.plan import Plan
from autoplace.planners.manual import lever_plans
from autoplace.sim import simulate

MiB = 2**20


class LiveStorages(TorchDispatchMode):
    """Bytes of the storages made under the mode and alive, op by op; their peak and what
    was alive there (``known``: storages made before, not counted)."""

    def __init__(self, known: list[torch.Tensor]) -> None:
        super().__init__()
        self.live: dict[int, tuple[StorageWeakRef, int, str]] = {}
        for t in known:
            s = t.untyped_storage()
            self.live[s._cdata] = (StorageWeakRef(s), 0, "before")
        self.total = self.peak = 0
        self.at_peak: tuple[str, list[tuple[int, str]]] = ("", [])

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        for k in [k for k, (ref, _, _) in self.live.items() if ref.expired()]:
            self.total -= self.live.pop(k)[1]
        out = func(*args, **(kwargs or {}))
        for t in pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.untyped_storage()._cdata not in self.live:
                s = t.untyped_storage()
                what = f"{func.__name__} {list(t.shape)} {str(t.dtype).removeprefix('torch.')}"
                self.live[s._cdata] = (StorageWeakRef(s), s.nbytes(), what)
                self.total += s.nbytes()
        if self.total > self.peak:
            self.peak = self.total
            self.at_peak = (func.__name__, sorted(((n, w) for _, n, w in self.live.values()
                                                   if n), reverse=True))
        return out


def measure(model: str, options: dict[str, Any], recipe: str, microbatches: int,
            autocast: str | None) -> dict[str, Any]:
    """One case: the measured and the simulated peak (bytes) and what was alive."""
    wl = workloads.get(model, **options, autocast_dtype=autocast)
    graph = capture_graph(wl)
    cluster = resolve("cpu-x1")
    plans = {"single": Plan.single(graph, cluster=cluster), **lever_plans(graph, cluster)}
    if recipe not in plans:
        raise SystemExit(f"recipe {recipe!r} unknown; valid: {', '.join(plans)}")
    plan = plans[recipe].with_parallel(microbatches=microbatches)
    built = build.build_rank(wl, graph, plan, cluster, 0, wl.batch_size // microbatches)
    params = [p for p in built.model.parameters() if p.requires_grad]
    opt = workload_optimizer(params, wl, built.devices[0])
    region = (lambda: torch.autocast("cpu", dtype=getattr(torch, autocast))) if autocast \
        else contextlib.nullcontext
    for step in range(2):
        inputs, targets = global_batch(wl, step, 0)
        before = [*params, *inputs, targets,
                  *(v for s in opt.state.values() for v in s.values() if torch.is_tensor(v))]
        mode = LiveStorages(before)
        with mode:
            with region():
                built.step(inputs, targets)
            opt.step()
            opt.zero_grad(set_to_none=True)
    static = sum({t.untyped_storage()._cdata: t.untyped_storage().nbytes()
                  for t in before}.values())
    res = simulate(graph, plan, cluster)
    return {"model": model, "options": options, "recipe": recipe,
            "microbatches": microbatches, "autocast": autocast,
            "measured_bytes": static + mode.peak, "static_bytes": static,
            "simulated_bytes": res.peak_memory_bytes[0], "breakdown": res.memory_breakdown[0],
            "peak_op": mode.at_peak[0],
            "alive_at_peak": [[n, w] for n, w in mode.at_peak[1][:8]]}


def _options(text: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for item in filter(None, text.split(",")):
        key, _, value = item.partition("=")
        out[key] = int(value) if value.lstrip("-").isdigit() else value
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="gpt-tiny", help="a zoo workload name")
    ap.add_argument("--options", default="", help="workload options: key=value,key=value")
    ap.add_argument("--recipes", default="single,checkpoint-blocks",
                    help="single and/or lever_plans names, comma-separated")
    ap.add_argument("--microbatches", default="1", help="microbatch counts, comma-separated")
    ap.add_argument("--autocast", default="none,bfloat16",
                    help="none and/or an autocast dtype, comma-separated")
    ap.add_argument("--json", default=None, help="write the cases to this file")
    args = ap.parse_args(argv)
    torch.manual_seed(0)
    rows = []
    for ac in args.autocast.split(","):
        for recipe in args.recipes.split(","):
            for m in (int(x) for x in args.microbatches.split(",")):
                r = measure(args.model, _options(args.options), recipe, m,
                            None if ac == "none" else ac)
                rows.append(r)
                err = r["simulated_bytes"] / r["measured_bytes"] - 1
                print(f"{recipe} mb={m} autocast={ac}: measured {r['measured_bytes'] / MiB:.2f}"
                      f" MiB, simulated {r['simulated_bytes'] / MiB:.2f} ({err:+.2%}); peak at "
                      f"{r['peak_op']}: " + ", ".join(
                          f"{w} {n / MiB:.1f}" for n, w in r["alive_at_peak"][:4]), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"torch": torch.__version__, "cases": rows},
                                              indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
