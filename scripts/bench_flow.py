"""One-process placement with flowing microbatches: autoplace's program against the hand-written one.

``shared/MEASURED.md`` has a hand-written two-halves split of gpt-1b in one process
whose batch is cut into microbatches that flow through both GPUs (86.8 ms with 2,
82.4 ms with 4 under the 16 GiB cap, on 2x H200). autoplace's one-process executor
(:func:`autoplace.executor.local.build_local`) runs the same plan. This script runs
both, in one process on the same parameters (the captured program shares the
model's parameters), for 1, 2 and 4 microbatches, in interleaved rounds, so that
any difference is the executor's:

* ``native-mbM``: ``for each microbatch: h = first_half(x); h = h.to(dev1);
  loss += loss_fn(second_half(h), y) / M``, then ``loss.backward()``;
* ``autoplace-mbM``: ``build_local(graph, plan with M microbatches)`` with the issue
  order the executor uses;
* ``streams-mbM`` (with ``--copy-streams``): the same program whose GPU-to-GPU edges skip
  PyTorch's two-way stream barrier (``build_local(copy_streams=True)``,
  ``AUTOPLACE_COPY_STREAMS=1`` in the executor).

Both use one fused AdamW over all parameters and bf16 autocast; step time covers
forward, backward and the optimizer step, from synchronised devices to
synchronised devices. Before timing, both compute the loss of the same batch with
the same parameters and the script checks that they agree. ``--trace DIR`` writes a
Chrome trace of 3 steps of every variant (``scripts/trace_summary.py`` reads them).

    python scripts/bench_flow.py --cap-gib 16 --out bench/results/flow.json

Without 2 GPUs it runs a small model on the CPU (a smoke test of the script).
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

MB = (1, 2, 4)


def _halves(model, cut: int, devices):
    """The hand-written split: embeddings and blocks[:cut] | blocks[cut:], ln_f, head."""

    positions = model.positions.to(devices[0])

    def first(tokens):
        x = model.tok_emb(tokens) + model.pos_emb(positions)
        for b in model.blocks[:cut]:
            x = b(x)
        return x

    def second(x):
        for b in model.blocks[cut:]:
            x = b(x)
        return model.head(model.ln_f(x))

    def step(tokens, targets, m, loss_fn):
        total = None
        for x, y in zip(tokens.to(devices[0]).chunk(m), targets.to(devices[1]).chunk(m)):
            h = first(x).to(devices[1], non_blocking=True)
            part = loss_fn(second(h), y) / m
            total = part if total is None else total + part
        return total

    return step


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--workload", default=None, help="gpt-* workload (default: gpt-1b on "
                    "GPUs, gpt-tiny on CPU)")
    ap.add_argument("--steps", type=int, default=15, help="timed steps per variant and round")
    ap.add_argument("--warmup", type=int, default=3, help="untimed steps before them")
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds")
    ap.add_argument("--cap-gib", type=float, default=None, help="memory cap per GPU")
    ap.add_argument("--cut", type=int, default=None,
                    help="first block on the second GPU (default: half the blocks)")
    ap.add_argument("--copy-streams", action="store_true",
                    help="also run autoplace's program with stream-aware copies (streams-mbM)")
    ap.add_argument("--trace", default=None, help="directory for Chrome traces")
    ap.add_argument("--out", default=None, help="result JSON")
    a = ap.parse_args()

    from autoplace import workloads
    from autoplace.executor.build import _issue_order
    from autoplace.executor.local import build_local
    from autoplace.executor.runner import _autocast, _optimizer, capture_graph, global_batch
    from autoplace.plan import ParallelConfig, Plan

    gpu = torch.cuda.is_available() and torch.cuda.device_count() >= 2
    devices = ([torch.device("cuda", 0), torch.device("cuda", 1)] if gpu
               else [torch.device("cpu"), torch.device("cpu")])
    wl = workloads.get(a.workload or ("gpt-1b" if gpu else "gpt-tiny"))
    card = torch.cuda.get_device_name(0) if gpu else "cpu"
    if gpu and a.cap_gib:
        for d in devices:
            total = torch.cuda.get_device_properties(d).total_memory
            torch.cuda.set_per_process_memory_fraction(min(1.0, a.cap_gib * 2**30 / total), d)
    graph = capture_graph(wl)
    cut = a.cut if a.cut is not None else wl.model.config.n_layers // 2
    first = next(i for i, op in enumerate(graph) if op.module_path.startswith(f"blocks.{cut}"))
    groups = {op: int(i >= first) for i, op in enumerate(graph.order)}
    names = ("native", "autoplace") + (("streams",) if a.copy_streams else ())
    programs: dict[str, dict[int, torch.nn.Module]] = {"autoplace": {}, "streams": {}}
    for m in MB:
        plan = Plan.from_groups(graph, groups, [0, 1], planner="bench-flow",
                                parallel=ParallelConfig(microbatches=m))
        for name in names[1:]:
            programs[name][m] = build_local(graph.module, plan, devices, wl.loss_fn,
                                            order=_issue_order(graph, plan),
                                            copy_streams=name == "streams")
    native = _halves(wl.model, cut, devices)  # parameters: where build_local put them
    opt = _optimizer([p for p in wl.model.parameters() if p.requires_grad], wl, devices[0])

    def run(name: str, m: int, inputs, targets):
        with _autocast(wl, devices[0]):
            if name == "native":
                return native(inputs[0], targets, m, wl.loss_fn)
            return programs[name][m](inputs, targets)

    # same parameters, same batch: the two programs must compute the same loss
    inputs, targets = global_batch(wl, 0, 0)
    check = {}
    with torch.no_grad():
        for name in names:
            for m in MB:
                check[f"{name}-mb{m}"] = float(run(name, m, inputs, targets))
    ref = check["native-mb1"]
    worst = max(abs(v - ref) / abs(ref) for v in check.values())
    print(f"loss of batch 0 (no update): {check}; largest relative difference {worst:.1e}",
          flush=True)
    if worst > 2e-2:
        raise SystemExit(f"the programs disagree: {check}")

    def sync():
        for d in devices:
            if d.type == "cuda":
                torch.cuda.synchronize(d)

    def steps(name: str, m: int, n: int, first_step: int) -> list[float]:
        out = []
        for s in range(n):
            inputs, targets = global_batch(wl, first_step + s, 0)
            sync()
            t0 = time.perf_counter()
            loss = run(name, m, inputs, targets)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            sync()
            out.append(time.perf_counter() - t0)
        return out

    variants = [(name, m) for m in MB for name in names]
    times: dict[str, list[list[float]]] = {f"{n}-mb{m}": [] for n, m in variants}
    peaks: dict[str, list[int]] = {}
    t_start = time.time()
    step_no = 1
    for rnd in range(a.rounds):
        for name, m in variants:
            key = f"{name}-mb{m}"
            for d in devices:
                if d.type == "cuda":
                    torch.cuda.reset_peak_memory_stats(d)
            try:
                steps(name, m, a.warmup, step_no)
                t = steps(name, m, a.steps, step_no + a.warmup)
            except torch.OutOfMemoryError as e:
                print(f"round {rnd} {key}: out of memory ({str(e).splitlines()[0][:120]})",
                      flush=True)
                opt.zero_grad(set_to_none=True)
                times[key].append([])
                continue
            step_no += a.warmup + a.steps
            times[key].append(t)
            peaks[key] = [torch.cuda.max_memory_allocated(d) if d.type == "cuda" else 0
                          for d in devices]
            print(f"round {rnd} {key}: median {statistics.median(t) * 1e3:.1f} ms "
                  f"(min {min(t) * 1e3:.1f}, max {max(t) * 1e3:.1f})", flush=True)

    if a.trace:
        from torch.profiler import ProfilerActivity, profile

        Path(a.trace).mkdir(parents=True, exist_ok=True)
        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if gpu else [])
        for name, m in variants:
            try:
                steps(name, m, 2, step_no)
                with profile(activities=acts) as prof:
                    steps(name, m, 3, step_no + 2)
                prof.export_chrome_trace(str(Path(a.trace) / f"{name}-mb{m}.json"))
            except torch.OutOfMemoryError:
                opt.zero_grad(set_to_none=True)
            step_no += 5

    summary = {}
    for key, rs in times.items():
        flat = [x for r in rs for x in r]
        if not flat:
            summary[key] = {"oom": True}
            continue
        meds = [statistics.median(r) for r in rs if r]
        summary[key] = {"step_time_s": statistics.median(flat), "round_medians_s": meds,
                        "spread_s": [min(meds), max(meds)], "peak_memory_bytes": peaks.get(key),
                        "oom": any(not r for r in rs)}
    for m in MB:
        theirs = summary[f"native-mb{m}"]
        for name in names[1:]:
            ours = summary[f"{name}-mb{m}"]
            if "step_time_s" in ours and "step_time_s" in theirs:
                ours["vs_native"] = ours["step_time_s"] / theirs["step_time_s"]
                print(f"mb={m}: {name} {ours['step_time_s'] * 1e3:.1f} ms, hand-written "
                      f"{theirs['step_time_s'] * 1e3:.1f} ms: {ours['vs_native']:.3f}x")
    result = {"benchmark": "one-process-flow", "workload": wl.name, "card": card,
              "torch_version": torch.__version__, "date": datetime.date.today().isoformat(),
              "memory_cap_gib": a.cap_gib, "steps": a.steps, "warmup": a.warmup,
              "rounds": a.rounds, "batch_size": wl.batch_size, "split_block": cut,
              "loss_check": check, "wall_s": time.time() - t_start, "results": summary}
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(json.dumps(result, indent=1))
        print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
