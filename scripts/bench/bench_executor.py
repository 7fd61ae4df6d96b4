"""Benchmark the executor against the same parallelism written by hand (gpt-1b, 2 GPUs).

Two variants per mode (``--modes``), each its own torchrun job, repeated in interleaved
order:

* ``autoplace-ddp``: autoplace's dp=2 plan (DDP over the captured fx program);
* ``native-ddp``: the eager model under ``DistributedDataParallel``, written by hand;
* ``autoplace-pp``: autoplace's 2-stage GPipe plan (stages cut from the captured graph);
* ``native-pp``: the same split (blocks[:L/2] | blocks[L/2:]) written by hand with
  ``torch.distributed.pipelining``;
* ``autoplace-fsdp`` / ``autoplace-zero2``: autoplace's dp=2 plans with
  ``shard="fsdp"`` / ``"zero2"`` (FSDP2 over the captured program's blocks);
* ``native-fsdp`` / ``native-zero2``: the eager model with ``fully_shard`` on every
  block and the root, bf16 gathers and fp32 reductions, ``reshard_after_forward``
  True / False, written by hand.

``--trace DIR`` then runs each variant once more under ``torch.profiler`` (Chrome traces
``DIR/<variant>/trace-rank<R>.json``; summarise them with ``autoplace trace-summary``).

Same data (``torch.manual_seed(seed + step)``), AdamW (fused), bf16 autocast.
Step time = median over >= 20 steps after warm-up per job; the spread is the
min..max of the per-job medians. ``executor.json`` to ``--out``, by default a new run
folder ``bench/results/<date>-<card>x2-executor/`` (with ``env.json`` and ``run.json``).

    python scripts/bench/bench_executor.py --steps 25 --warmup 5 --rounds 2
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from results import write_run
from run_folder import output_folder

WORKLOAD = "gpt-1b"
MICROBATCHES = 8
MODES = ("ddp", "pp", "fsdp", "zero2")


def split_plan(graph, stages: int, cut_block: str, **parallel):
    """Ops before the first op of module ``cut_block`` on stage 0, the rest on stage 1."""
    from autoplace.plan import ParallelConfig, Plan

    first = next(i for i, op in enumerate(graph) if op.module_path.startswith(cut_block))
    groups = {op: int(i >= first) for i, op in enumerate(graph.order)}
    return Plan.from_groups(graph, groups, [0, 1], parallel=ParallelConfig(**parallel),
                            planner="bench-split")


# ----------------------------------------------------------------- hand-written runs
def _native(kind: str, steps: int, warmup: int, seed: int, out: str,
            trace: str | None = None) -> None:
    import torch.distributed as dist
    from torch import nn

    from autoplace import workloads

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dev = torch.device("cuda", rank)
    torch.cuda.set_device(dev)
    dist.init_process_group("nccl", device_id=dev)
    wl = workloads.get(WORKLOAD)
    model = wl.model
    amp = torch.autocast("cuda", dtype=torch.bfloat16)
    if kind == "ddp":
        model = nn.parallel.DistributedDataParallel(model.to(dev), device_ids=[dev])
        params = list(model.parameters())
    elif kind in ("fsdp", "zero2"):
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        mesh = init_device_mesh("cuda", (world,))
        kw = dict(mesh=mesh, reshard_after_forward=kind == "fsdp",
                  mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                                 reduce_dtype=torch.float32))
        model = model.to(dev)
        for block in model.blocks:
            fully_shard(block, **kw)
        fully_shard(model, **kw)
        params = list(model.parameters())
    else:
        from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

        half = len(model.blocks) // 2

        class Stage0(nn.Module):
            def __init__(self, m):
                super().__init__()
                self.tok_emb, self.pos_emb = m.tok_emb, m.pos_emb
                self.register_buffer("positions", m.positions, persistent=False)
                self.blocks = nn.ModuleList(m.blocks[:half])

            def forward(self, tokens):
                x = self.tok_emb(tokens) + self.pos_emb(self.positions)
                for b in self.blocks:
                    x = b(x)
                return x

        class Stage1(nn.Module):
            def __init__(self, m):
                super().__init__()
                self.blocks = nn.ModuleList(m.blocks[half:])
                self.ln_f, self.head = m.ln_f, m.head

            def forward(self, x):
                for b in self.blocks:
                    x = b(x)
                return self.head(self.ln_f(x))

        stage_mod = (Stage0 if rank == 0 else Stage1)(model).to(dev)
        params = list(stage_mod.parameters())
        stage = PipelineStage(stage_mod, rank, world, dev)
        sched = ScheduleGPipe(stage, n_microbatches=MICROBATCHES, loss_fn=wl.loss_fn)
    opt = torch.optim.AdamW(params, lr=wl.lr, fused=True)
    times, losses = [], []
    prof = None
    for step in range(steps):
        if trace and step == warmup:
            from torch.profiler import ProfilerActivity, profile

            prof = profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA])
            prof.__enter__()
        torch.manual_seed(seed + step)
        x, y = wl.make_batch(wl.batch_size, "cpu")
        x, y = x[0].to(dev), y.to(dev)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        # the span autoplace trace-summary cuts a trace's steps by
        span = torch.profiler.record_function(f"autoplace step {step}") if prof else None
        if span is not None:
            span.__enter__()
        with amp:
            if kind != "pp":  # data parallel: each rank its share of the batch
                xs, ys = x.chunk(world)[rank], y.chunk(world)[rank]
                loss = wl.loss_fn(model(xs), ys)
                loss.backward()
            elif rank == 0:  # the losses are all a step needs: no outputs kept or merged
                sched.step(x, return_outputs=False)
                loss = None
            else:
                mb_losses: list[torch.Tensor] = []
                sched.step(target=y, losses=mb_losses, return_outputs=False)
                loss = torch.stack(mb_losses).mean()
        opt.step()
        opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        if span is not None:
            span.__exit__(None, None, None)
        losses.append(float(loss) if loss is not None else None)
    if prof is not None:
        prof.__exit__(None, None, None)
        Path(trace).mkdir(parents=True, exist_ok=True)
        prof.export_chrome_trace(str(Path(trace) / f"trace-rank{rank}.json"))
    peak = torch.cuda.max_memory_allocated(dev)
    gathered = [None] * world
    dist.all_gather_object(gathered, (times, losses, peak))
    if rank == 0:
        step_times = [max(t[i] for t, _, _ in gathered) for i in range(steps)]
        loss = [next(v[i] for _, v, _ in gathered if v[i] is not None) for i in range(steps)]
        if kind != "pp":  # mean over replicas
            loss = [statistics.mean(v[i] for _, v, _ in gathered) for i in range(steps)]
        Path(out).write_text(json.dumps({
            "step_times_s": step_times[warmup:], "loss": loss,
            "peak_memory_bytes": [p for _, _, p in gathered]}))
    dist.barrier()
    dist.destroy_process_group()


def run_native(kind: str, steps: int, warmup: int, seed: int, trace: str | None = None
               ) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "r.json"
        env = {**os.environ, "NCCL_NVLS_ENABLE": "0"}
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               "--nproc-per-node=2", __file__, "--worker", kind, "--steps", str(steps),
               "--warmup", str(warmup), "--seed", str(seed), "--result", str(out)]
        if trace:
            cmd += ["--trace", trace]
        p = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if p.returncode != 0 or not out.exists():
            raise RuntimeError(f"native {kind} failed:\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}")
        return json.loads(out.read_text())


# ---------------------------------------------------------------------- main
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=25, help="steps per job, warm-up included")
    ap.add_argument("--warmup", type=int, default=5, help="untimed steps per job")
    ap.add_argument("--rounds", type=int, default=2, help="interleaved repetitions")
    ap.add_argument("--seed", type=int, default=0, help="data seed")
    ap.add_argument("--out", default=None,
                    help="folder for executor.json (default: a new run folder under "
                         "bench/results)")
    ap.add_argument("--modes", default="ddp,pp,fsdp,zero2",
                    help="comma-separated: ddp, pp, fsdp, zero2")
    ap.add_argument("--trace", default=None,
                    help="then run every variant once more under torch.profiler, traces here")
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--result", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.worker:
        _native(a.worker, a.steps, a.warmup, a.seed, a.result, a.trace)
        return
    modes = [m for m in a.modes.split(",") if m]
    unknown = sorted(set(modes) - set(MODES))
    if unknown:
        ap.error(f"unknown mode(s) {', '.join(unknown)}; valid: {', '.join(MODES)}")

    from autoplace import workloads
    from autoplace.cluster import Cluster
    from autoplace.executor import execute
    from autoplace.executor.launch import run_plan
    from autoplace.executor.runner import RunOptions, capture_graph
    from autoplace.plan import ParallelConfig, Plan

    card = torch.cuda.get_device_name(0)
    folder = output_folder(a.out, "executor", card=card, gpus=2)
    cluster = Cluster.detect().subset([0, 1])
    real = workloads.get(WORKLOAD)
    graph = capture_graph(real)
    half = real.model.config.n_layers // 2
    one = {op: 0 for op in graph.order}
    plans = {
        "autoplace-ddp": Plan.from_groups(graph, one, [0], parallel=ParallelConfig(data=2),
                                          planner="bench-ddp"),
        "autoplace-pp": split_plan(graph, 2, f"blocks.{half}", pipeline=2,
                                   microbatches=MICROBATCHES),
        "autoplace-fsdp": Plan.from_groups(graph, one, [0], planner="bench-fsdp",
                                           parallel=ParallelConfig(data=2, shard="fsdp")),
        "autoplace-zero2": Plan.from_groups(graph, one, [0], planner="bench-zero2",
                                            parallel=ParallelConfig(data=2, shard="zero2")),
    }
    runs: dict[str, list[dict]] = {f"{who}-{m}": [] for m in modes
                                   for who in ("autoplace", "native")}
    t_start = time.time()
    for rnd in range(a.rounds):
        for name in runs:
            t0 = time.time()
            if name.startswith("autoplace"):
                r = execute(real, plans[name], cluster=cluster, steps=a.steps, warmup=a.warmup,
                            reference=False, seed=a.seed)
                if not r.ok:
                    raise RuntimeError(f"{name}: {r.error}")
                res = {"step_times_s": r.step_times_s, "loss": r.loss,
                       "peak_memory_bytes": r.peak_memory_bytes}
            else:
                res = run_native(name.split("-")[1], a.steps, a.warmup, a.seed)
            res["median_step_s"] = statistics.median(res["step_times_s"])
            res["job_wall_s"] = time.time() - t0
            runs[name].append(res)
            print(f"round {rnd} {name}: {res['median_step_s'] * 1e3:.1f} ms "
                  f"(job {res['job_wall_s']:.0f} s)", flush=True)
            _write(a, folder, card, real.batch_size, runs, t_start, partial=True)
    _write(a, folder, card, real.batch_size, runs, t_start, partial=False)
    if a.trace:
        for name in runs:
            where = str(Path(a.trace) / name)
            if name.startswith("autoplace"):
                r = run_plan(plans[name], real, cluster=cluster,
                             options=RunOptions(steps=a.warmup + 5, warmup=a.warmup,
                                                reference=False, seed=a.seed, trace_dir=where))
                if not r.ok:
                    raise RuntimeError(f"{name} (traced): {r.error}")
            else:
                run_native(name.split("-")[1], a.warmup + 5, a.warmup, a.seed, trace=where)
            print(f"traced {name}: {where}", flush=True)


def _write(a, folder: Path, card: str, batch: int, runs: dict, t_start: float,
           partial: bool) -> None:
    """Summarise the jobs done so far and write the JSON (rewritten after every job)."""
    summary = {}
    for name, rs in runs.items():
        if not rs:
            continue
        meds = [r["median_step_s"] for r in rs]
        all_t = [t for r in rs for t in r["step_times_s"]]
        summary[name] = {
            "step_time_s": statistics.median(all_t), "job_medians_s": meds,
            "spread_s": [min(meds), max(meds)], "step_min_max_s": [min(all_t), max(all_t)],
            "samples_per_s": batch / statistics.median(all_t),
            "peak_memory_bytes": rs[-1]["peak_memory_bytes"], "loss_first_job": rs[0]["loss"],
        }
    for mode in MODES:
        if f"autoplace-{mode}" not in summary or f"native-{mode}" not in summary:
            continue
        ours, theirs = summary[f"autoplace-{mode}"], summary[f"native-{mode}"]
        ours["throughput_vs_native"] = ours["samples_per_s"] / theirs["samples_per_s"]
        ours["max_loss_rel_diff_vs_native"] = max(
            abs(x - y) / abs(y) for x, y in zip(ours["loss_first_job"], theirs["loss_first_job"]))
    result = {
        "benchmark": "executor-vs-native", "workload": WORKLOAD, "card": card,
        "num_gpus": 2, "torch_version": torch.__version__,
        "date": datetime.date.today().isoformat(), "steps": a.steps, "warmup": a.warmup,
        "rounds": a.rounds, "microbatches_pp": MICROBATCHES, "global_batch": batch,
        "wall_s": time.time() - t_start, "partial": partial, "results": summary,
    }
    out = folder / "executor.json"
    out.write_text(json.dumps(result, indent=1))
    if partial:
        return
    ratios = {m: summary[f"autoplace-{m}"]["throughput_vs_native"] for m in MODES
              if "throughput_vs_native" in summary.get(f"autoplace-{m}", {})}
    write_run(folder, tag="executor", scenarios=[f"executor:{m}" for m in ratios],
              kind="experiment", script="scripts/bench/bench_executor.py",
              summary=f"{WORKLOAD}: the executor's " + ", ".join(ratios) + " against the same "
                      "written by hand (" + ", ".join(f"{r:.3f}x" for r in ratios.values())
                      + " the hand-written throughput).")
    for mode in MODES:
        if "throughput_vs_native" not in summary.get(f"autoplace-{mode}", {}):
            continue
        s = summary[f"autoplace-{mode}"]
        print(f"{mode}: autoplace {s['step_time_s'] * 1e3:.1f} ms vs native "
              f"{summary[f'native-{mode}']['step_time_s'] * 1e3:.1f} ms -> throughput ratio "
              f"{s['throughput_vs_native']:.3f}, loss diff {s['max_loss_rel_diff_vs_native']:.1e}")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
