"""Every plan of every scenario executed for real, side by side, in one run on one machine.

    python scripts/bench/bench_plans.py                                     # GPUs present
    python scripts/bench/bench_plans.py --cpu --scenarios tiny --out /tmp/b # CPU smoke run
    python scripts/bench/bench_plans.py --scenarios hf-gpt2 --hf-module mymodels

This process drives: it profiles and plans, and hands every plan to torchrun jobs it
keeps alive between runs (:class:`autoplace.executor.pool.PlanPool`: a one-process job
for one-process plans, one rank per device for DDP, FSDP2 and
torch.distributed.pipelining), so plans run in interleaved order without a process start
per plan. Each workload's first scenario starts fresh jobs, which load the model while
this process profiles and plans, and they serve that workload's scenarios; every run
reads the workload's initial weights from a file in /dev/shm written once per workload
(``RunOptions.weights_file``). A multi-process run that fails on a rank (out of memory
under a cap) ends its job, and a run past ``RUN_LIMIT_S`` (``COMPILED_RUN_LIMIT_S`` for a
compiled plan, whose first run compiles first) is stopped; on GPUs an idle spare job
per multi-process layout takes its place (``PlanPool(spares=True)``) and the next
spare starts at once.

First (on GPUs, or with ``--links``) it measures copy speeds between every device pair
and all-reduce / all-gather / reduce-scatter speed, and simulates with them.

For each scenario (workload x devices x memory cap):
1. capture the workload; on GPUs profile per-op costs on cuda:0 (calibrated), and its
   first blocks compiled, checkpointed and as CUDA graphs (``profile_block``, as
   ``autoplace profile`` does), which price those levers;
2. hand-written options (single device, two halves (n parts) in one process, DDP, FSDP2,
   even torch pipelining in GPipe and 1F1B) and the planners (expert, hash, critical-path,
   m-etf, m-sct, hybrid-dp, an RL policy trained briefly on the simulator, auto) make
   plans, plus named hybrids: ``local-xN-mb`` (microbatches flowing through a
   one-process placement) and on 4+ devices ``hybrid-dpDxppP`` (plain DDP over
   pipelines); identical plans are measured once and credited to every planner;
3. every distinct plan runs ``--reps`` times in interleaved order (within a repetition a
   plan whose job is up goes first), ``--steps`` steps after ``--warmup`` each; the step time is the median over all timed steps, with the
   spread of the per-repetition medians. auto measures its candidates with the same
   steps, and such a measurement is the plan's first repetition (no plan runs twice in
   a row for nothing);
4. results: JSON (card, driver, torch version, date, scenarios with plans, ratios,
   simulator error and Kendall tau, wall time per scenario) and a markdown table,
   written after every measurement so a cut-off run keeps what it measured.

With ``--memory`` every run records the CUDA allocator over its last warm-up step
(``RunOptions.memory_dir``) and each plan's row keeps rank 0's summary of its first run
(``memory_record``: memory reserved per stream, what was alive at the allocated peak).

Results go to ``--out`` (``suite.json``, ``suite.md``, ``suite.png``), by default a new
run folder ``bench/results/<date>-<card>x<n>-<tag>/`` with its ``env.json`` and ``run.json``
(``results.py``). The ``hf-*`` scenarios train Hugging Face models a user brings: their
workloads are ``MODULE:<factory>`` with ``--hf-module MODULE`` (for example
``tests.helpers.hf_models`` with the repository root on ``PYTHONPATH``).
"""

from __future__ import annotations

import argparse
import datetime as dt
import gc
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch
from results import write_run
from run_folder import output_folder

from autoplace.planners.manual import hand_written

CACHE = "/tmp/autoplace-profile"  # profile cache; auto saves its calibration here too
#: a plan's run (its warm-up and timed steps) is stopped after this many seconds
RUN_LIMIT_S = 60.0
#: a compiled plan's run, which compiles each kind of piece first: Inception-v3's 11 kinds
#: of block compiled for 129 s on 2x H200, so its hand-written compiled recipes had no
#: measurement under the plain limit (suite-levers-gnmt-inception)
COMPILED_RUN_LIMIT_S = 240.0

HF = "{hf}:"  # the workload module of the hf-* scenarios: --hf-module

SCENARIOS: dict[str, dict[str, Any]] = {
    # the workload of shared/MEASURED.md
    "gpt1b-16GB": dict(model="gpt-1b", options={}, cap="16GB"),
    "gpt1b": dict(model="gpt-1b", options={}, cap=None),
    # GNMT at the papers' size, capped at 75% of what one device needs (measured first: a
    # cap from the simulator's estimate, and one at 60% of the measured need, were below
    # what any plan needed on 2x H200)
    "gnmt4-capped": dict(model="gnmt-4", options=dict(hidden=1024, vocab_size=32000, src_len=50,
                                                      tgt_len=50, batch_size=128),
                         cap="auto"),
    "inception": dict(model="inception-v3", options=dict(image_size=299, width=1.0,
                                                         num_classes=1000, batch_size=32),
                      cap=None),
    "branchy-mlp": dict(model="branchy-mlp", options=dict(in_dim=1024, hidden=2048, branches=8,
                                                          depth=4, num_classes=1000,
                                                          batch_size=1024), cap=None),
    # Hugging Face models, unmodified, from the module --hf-module names (HF below): GPT-2
    # small, BERT-base, T5-small sizes, bf16 autocast
    "hf-gpt2": dict(model=HF + "gpt2", options=dict(layers=12, hidden=768, heads=12,
                                                         vocab=50257, seq=512, batch_size=16,
                                                         lr=3e-4, autocast_dtype="bfloat16"),
                    cap=None),
    "hf-bert": dict(model=HF + "bert", options=dict(layers=12, hidden=768, heads=12,
                                                         vocab=30522, seq=256, batch_size=32,
                                                         lr=3e-4, autocast_dtype="bfloat16"),
                    cap=None),
    "hf-t5": dict(model=HF + "t5", options=dict(layers=6, hidden=512, heads=8, vocab=32128,
                                                     seq=128, batch_size=32, lr=3e-4,
                                                     autocast_dtype="bfloat16"), cap=None),
    # the sizes device_bench.sh's models mode measures on one H200
    "hf-llama": dict(model=HF + "llama", options=dict(layers=12, hidden=768, heads=12,
                                                           kv_heads=4, vocab=32000, seq=512,
                                                           batch_size=16, lr=3e-4,
                                                           autocast_dtype="bfloat16"), cap=None),
    "hf-mixtral": dict(model=HF + "mixtral", options=dict(layers=8, hidden=512, heads=8,
                                                               kv_heads=4, experts=8, vocab=32000,
                                                               seq=256, batch_size=16, lr=3e-4,
                                                               autocast_dtype="bfloat16"),
                       cap=None),
    "hf-vit": dict(model=HF + "vit", options=dict(image=224, patch=16, layers=12, hidden=768,
                                                       heads=12, classes=1000, batch_size=64,
                                                       lr=3e-4, autocast_dtype="bfloat16"),
                   cap=None),
    # CPU smoke scenarios
    "tiny": dict(model="gpt-tiny", options=dict(batch_size=8), cap=None),
    "tiny-mlp": dict(model="branchy-mlp", options=dict(batch_size=16), cap=None),
    "tiny-capped": dict(model="gpt-tiny", options=dict(batch_size=8), cap="auto"),
    "tiny-hf": dict(model=HF + "t5", options=dict(batch_size=8), cap=None),
}


def scenario(name: str, hf_module: str | None = None) -> dict[str, Any]:
    """The scenario ``name`` with its workload resolved (``hf-*``: ``hf_module:<factory>``).

    Raises:
        SystemExit: for an unknown name (the message lists the names), or an ``hf-*``
            scenario without ``hf_module``.
    """
    if name not in SCENARIOS:
        raise SystemExit(f"unknown scenario {name!r}; valid: {', '.join(SCENARIOS)}")
    sc = dict(SCENARIOS[name])
    if sc["model"].startswith(HF):
        if not hf_module:
            raise SystemExit(f"scenario {name!r} trains a Hugging Face model: pass "
                             "--hf-module MODULE, a module with the factories gpt2, bert, t5, "
                             "llama, mixtral and vit (e.g. tests.helpers.hf_models)")
        sc["model"] = f"{hf_module}:{sc['model'][len(HF):]}"
    return sc


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--scenarios", default="gpt1b-16GB,gpt1b,gnmt4-capped,branchy-mlp,inception")
    p.add_argument("--steps", type=int, default=10,
                   help="timed steps per repetition (a plan's median pools its repetitions)")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps per repetition")
    p.add_argument("--reps", type=int, default=2, help="repetitions per plan, interleaved")
    p.add_argument("--deadline-s", type=float, default=540, help="stop starting new work after")
    p.add_argument("--auto-budget", default="90s",
                   help="time budget of the auto planner (a 1B model compiles for 30-40 s)")
    p.add_argument("--memory", action="store_true",
                   help="record the CUDA allocator over each run's last warm-up step "
                        "(run --memory) and keep rank 0's summary in each plan's row")
    p.add_argument("--policy", default="gnn", help="RL policy trained on the simulator")
    p.add_argument("--policy-budget", default="6s")
    p.add_argument("--profile", action=argparse.BooleanOptionalAction, default=True,
                   help="profile per-op costs on the first device (GPU only)")
    p.add_argument("--block-profile", action=argparse.BooleanOptionalAction, default=True,
                   help="with --profile, also time the first blocks compiled, checkpointed "
                        "and as CUDA graphs (autoplace profile's --block)")
    p.add_argument("--links", action=argparse.BooleanOptionalAction, default=None,
                   help="measure copy and collective speeds first and simulate with them "
                        "(default: on GPUs)")
    p.add_argument("--cpu", action="store_true", help="CPU devices, gloo (smoke test)")
    p.add_argument("--nproc", type=int, default=None,
                   help="devices to use (default: every GPU present; 2 on CPU)")
    p.add_argument("--out", default=None,
                   help="folder for suite.json / .md / .png (default: a new run folder under "
                        "bench/results)")
    p.add_argument("--tag", default="suite", help="the new run folder's tag (without --out)")
    p.add_argument("--hf-module", default=None, metavar="MODULE",
                   help="module of the hf-* scenarios' model factories (importable: on "
                        "PYTHONPATH or in the working directory)")
    p.add_argument("--render", default=None, metavar="JSON",
                   help="only regenerate the markdown table of a results JSON")
    return p.parse_args(argv)


def say(msg: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", flush=True)


# ------------------------------------------------------------------ measuring
class Driver:
    """Runs plans: one-process plans here, multi-process plans in a :class:`PlanPool`."""

    def __init__(self, cluster, log_dir: Path, memory: bool = False) -> None:
        from autoplace.executor.pool import PlanPool

        self.cluster = cluster
        self.memory = memory  # record the allocator over each run's last warm-up step
        # a run (23 steps) takes seconds; one that takes minutes is stopped, not waited for
        self.pool = PlanPool(cluster, timeout_s=COMPILED_RUN_LIMIT_S, log_dir=log_dir,
                             spares=torch.cuda.is_available())
        self.workloads: dict[str, Any] = {}
        self._weights: tuple[str, str] | None = None  # (workload key, weights file)
        self.warm_for: tuple[str, str] | None = None  # what the pool's jobs preloaded
        self.runs = 0

    def workload(self, spec: dict[str, Any]):
        """The scenario's model, for profiling and the weights file. Built on the first
        GPU (initialising gpt-1b on one CPU core takes ~16 s); this process runs no plan,
        so the memory it holds there counts against no plan's cap."""
        from autoplace import workloads

        key = json.dumps(spec, sort_keys=True)
        if key not in self.workloads:
            self.workloads.clear()
            gc.collect()
            dev = self.cluster.devices[0].name if torch.cuda.is_available() else None
            self.workloads[key] = workloads.get(spec["spec"], seed=spec.get("seed", 0),
                                                device=dev, **spec["options"])
        return self.workloads[key]

    def weights_file(self, spec: dict[str, Any]) -> str:
        """The workload's initial weights in a file (written once per workload), which
        the pool's processes load instead of initialising the model."""
        from autoplace.executor.weights import save_weights

        key = json.dumps(spec, sort_keys=True)
        if self._weights is None or self._weights[0] != key:
            folder = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(CACHE)
            path = folder / f"autoplace-bench-weights-{os.getpid()}.pt"
            t = time.perf_counter()
            save_weights(self.workload(spec).model, path)
            say(f"  initial weights saved to {path} in {time.perf_counter() - t:.1f} s")
            self._weights = (key, str(path))
        return self._weights[1]

    def measure(self, spec, plan, cluster, steps: int, warmup: int,
                time_limit_s: float | None = None):
        """Run ``plan`` in the pool and return (rank 0's) report; a failure is a report
        with an error. ``time_limit_s``: this run's limit (default ``RUN_LIMIT_S``, or
        ``COMPILED_RUN_LIMIT_S`` for a compiled plan; at most the pool's)."""
        from autoplace.executor.report import RunReport
        from autoplace.executor.runner import RunOptions

        self.runs += 1
        t0 = time.perf_counter()
        mem_dir = Path(CACHE) / "memory" / f"run-{self.runs}" if self.memory else None
        try:
            replaced = self.pool.replaced
            rep = self.pool.run(plan, spec, RunOptions(
                steps=steps + warmup, warmup=warmup, reference=False,
                weights_file=self.weights_file(spec),
                memory_dir=str(mem_dir) if mem_dir else None), cluster=cluster,
                timeout_s=min(self.pool.timeout_s, run_limit(plan, time_limit_s)))
            rep.extra["wall_s"] = round(time.perf_counter() - t0, 3)
            if mem_dir is not None and (mem_dir / "memory-rank0.json").exists():
                rep.extra["memory_summary"] = json.loads(
                    (mem_dir / "memory-rank0.json").read_text())["devices"]
                shutil.rmtree(mem_dir, ignore_errors=True)  # the snapshots are large
            if rep.extra.get("pool_run") == 1:
                js = rep.extra.get("job_start_s") or {}
                say(f"    first run of a fresh job: {rep.extra['wall_s']:.1f} s (its start: "
                    + ", ".join(f"{k} {v:.1f} s" for k, v in js.items())
                    + f"; weights {rep.extra.get('init_s', '?')} s, "
                    f"build {rep.extra.get('build_s', '?')} s)")
            if self.pool.replaced != replaced:
                say("    its job ended; a replacement is starting")
            return rep
        except Exception as e:  # noqa: BLE001 - a plan that fails is a result
            return RunReport(plan=plan.describe(), error=f"{type(e).__name__}: {e}").finish()

    def close(self) -> None:
        self.pool.close()
        if self._weights is not None:
            Path(self._weights[1]).unlink(missing_ok=True)


# ------------------------------------------------------------------- planning
def run_limit(plan, time_limit_s: float | None = None) -> float:
    """A run's limit in seconds: ``time_limit_s`` where given (auto's, the budget left),
    else ``COMPILED_RUN_LIMIT_S`` for a compiled plan and ``RUN_LIMIT_S`` for the rest."""
    if time_limit_s:
        return float(time_limit_s)
    return COMPILED_RUN_LIMIT_S if plan.parallel.compile else RUN_LIMIT_S


def hybrid_plans(graph, cluster) -> dict[str, Any]:
    """Hybrid plans measured by name whatever auto picks: the best simulated plan with
    microbatches flowing through a one-process placement on every device, and on 4+
    devices the best of every data x pipeline factorisation (dp=2 x pp=2, ...)."""
    from autoplace.planners.pipeline_dp import hybrid_candidates

    n = cluster.num_devices
    out: dict[str, Any] = {}
    if n < 2:
        return out
    # (data, pipeline, devices per replica, shard) -> name
    wanted = {(1, 1, n, "none"): f"local-x{n}-mb"}
    for d in range(2, n):
        if n % d == 0 and n // d > 1:
            wanted[(d, n // d, n // d, "none")] = f"hybrid-dp{d}xpp{n // d}"
    for plan, _, oom in hybrid_candidates(graph, cluster):
        par = plan.parallel
        key = (par.data, par.pipeline, plan.devices_per_replica, par.shard)
        if key[:3] == (1, 1, n) and par.microbatches == 1:
            continue
        if key in wanted and wanted[key] not in out and not oom:
            out[wanted[key]] = plan
    return out


def run_phases(rep) -> str:
    """Where a run's wall time went, as the job reported it: `` [4.1 s: load 0.1, ...]``."""
    x = rep.extra
    if "wall_s" not in x or "run_s" not in x:
        return ""
    parts = [(k, x.get(k + "_s")) for k in ("init", "build", "steps", "teardown", "post")]
    warm = "/".join(f"{t:.2f}" for t in x.get("warmup_step_s", []))
    left = x.get("leftover_allocated_bytes") or 0
    return (f" [{x['wall_s']:.1f} s: " + ", ".join(f"{k} {v:.2f}" for k, v in parts
                                                   if v is not None)
            + (f"; warm-up steps {warm}" if warm else "")
            + (f"; {left / 2**20:.0f} MiB still allocated after it" if left else "")
            + (f"; {rep.allocator_retries} allocator retries"
               if getattr(rep, "allocator_retries", 0) else "") + "]")


def kendall_tau(xs: list[float], ys: list[float]) -> float | None:
    if len(xs) < 3:
        return None
    from scipy.stats import kendalltau

    return float(kendalltau(xs, ys).statistic)


def tau_beyond_spread(rows: list[dict[str, Any]]) -> tuple[float | None, int]:
    """Kendall tau of simulated against measured step times over the pairs of distinct
    measured plans whose repetition spreads (min-max of their medians) do not overlap,
    and the number of such pairs: the ranking where the measurement can tell the plans
    apart (pipelines vary by 20% between repetitions; near-ties flip either way)."""
    import itertools

    seen, pts = set(), []
    for r in rows:
        m, sp = r.get("measured_step_time_s"), r.get("spread_s")
        if not m or not sp or r.get("oom_measured"):
            continue
        key = (r["parallel"], m)
        if key not in seen:
            seen.add(key)
            pts.append((m, sp, r["sim_step_time_s"]))
    score = n = 0
    for (m1, s1, x1), (m2, s2, x2) in itertools.combinations(pts, 2):
        if s1[1] < s2[0] or s2[1] < s1[0]:
            n += 1
            if x1 != x2:  # a simulated tie is neither concordant nor discordant
                score += 1 if (m1 > m2) == (x1 > x2) else -1
    return (score / n if n else None), n


def run_scenario(name: str, sc: dict[str, Any], args, h: Driver, t_start: float,
                 out: dict[str, Any], save) -> None:
    from autoplace import planners, workloads
    from autoplace.capture import capture_workload
    from autoplace.cluster import parse_bytes, resolve
    from autoplace.executor.launch import short_error
    from autoplace.search.auto import auto_plan, signature
    from autoplace.sim import lower_bound, simulate

    t_scenario = time.perf_counter()
    base = h.cluster
    n = base.num_devices
    cluster = base
    spec = {"spec": sc["model"], "options": dict(sc["options"]), "seed": 0}
    meta = workloads.get(spec["spec"], device="meta", **spec["options"])
    graph = capture_workload(meta)
    # fresh pool processes for this scenario's workload (one-process plans, and one rank
    # per device) load the model while we profile and plan; a scenario of the workload
    # before (another memory cap) keeps its jobs. Not kept across workloads: after a DDP
    # run a job still holds a gradient-sized allocation (3.9 GiB for gpt-1b on 2x H200)
    # until its next run, which a smaller workload's memory cap would count
    first = [planners.get("single")(graph, cluster), planners.get("ddp")(graph, cluster)]
    weights = h.weights_file(spec)
    preload = (json.dumps(spec, sort_keys=True), weights)
    if h.warm_for != preload:
        h.pool.warm(first, spec, weights)
        h.warm_for = preload
    else:
        h.pool.ensure(first, cluster=cluster)
    t0 = time.perf_counter()
    if args.profile and not args.cpu:
        from autoplace.costs.profile import profile

        wl = h.workload(spec)
        graph = profile(wl, [cluster.devices[0].name], repeats=3, cache_dir=CACHE)
        graph.spec = dict(spec)
        if args.block_profile:  # compiled, checkpointed and graphed blocks, as `profile` does
            from autoplace.errors import AutoplaceError
            from autoplace.executor.profile_block import describe, profile_block

            try:
                rec = profile_block(graph, wl.example_inputs(graph.batch_size, "cpu"),
                                    cluster.devices[0].name, autocast_dtype=wl.autocast_dtype,
                                    repeats=3, cache_dir=CACHE)
                say(f"  first block: {describe(rec)}")
            except (AutoplaceError, torch.OutOfMemoryError) as e:
                say(f"  block profile failed ({str(e).splitlines()[0][:120]}): levers estimated")
    profile_s = time.perf_counter() - t0
    cap = sc["cap"]
    if cap == "auto":  # 75% of what one device really needs (measured; simulated on CPU)
        single = planners.get("single")(graph, cluster)
        need = simulate(graph, single, cluster).peak_memory_bytes[0]
        rep = h.measure(spec, single, cluster, steps=2, warmup=1)
        if rep.peak_memory_bytes and max(rep.peak_memory_bytes) > 0 and not rep.error:
            say(f"  single-device peak: {max(rep.peak_memory_bytes) / 2**30:.2f} GiB measured, "
                f"{need / 2**30:.2f} GiB simulated")
            need = max(rep.peak_memory_bytes)
        cap = int(0.75 * need)
    cap = parse_bytes(cap) if cap is not None else None
    cluster = resolve(cluster, cap)
    lb = lower_bound(graph, cluster)
    say(f"{name}: {len(graph)} ops, {graph.param_bytes / 2**30:.2f} GiB params on "
        f"{cluster.name} (profile {profile_s:.1f} s)")

    # ---- plans
    plans: dict[str, Any] = {}
    search: dict[str, float] = {}
    # hand-written options, split by the analytic (FLOP) costs, not the profile
    # (with the lever recipes: per-block compile and checkpointing, DDP + compile, FSDP2 +
    # checkpointing + compile, FSDP2 + offload)
    hand = hand_written(graph, cluster)
    for k, plan in hand.items():
        plans[k], search[k] = plan, float(plan.planner.get("search_time_s", 0.0))
    for k in ("expert", "hash", "critical-path", "m-etf", "m-sct", "hybrid-dp"):
        t = time.perf_counter()
        try:
            plans[k] = planners.get(k)(graph, cluster)
        except Exception as e:  # noqa: BLE001 - a failing planner is a result
            say(f"  {k} failed: {e}")
            continue
        search[k] = time.perf_counter() - t
    for k, plan in hybrid_plans(graph, cluster).items():
        plans[k], search[k] = plan, float(plan.planner.get("search_time_s", 0.0))
    # a job for every other process layout starts now, while the policy trains
    h.pool.ensure(list(plans.values()), cluster=cluster)
    if args.policy:
        from autoplace.policies import train

        t = time.perf_counter()
        res = train(graph, cluster, policy=args.policy, backend="sim",
                    budget=args.policy_budget, out_dir=None, progress=False, max_groups="auto")
        plans[f"rl-{args.policy}"] = res.best_plan
        search[f"rl-{args.policy}"] = time.perf_counter() - t

    def run(plan, steps: int, warmup: int, time_limit_s: float | None = None):
        return h.measure(spec, plan, cluster, steps=steps, warmup=warmup,
                         time_limit_s=time_limit_s)

    auto_runs: dict[tuple, Any] = {}  # auto's measurements, a plan's first repetition

    def measure_for_auto(plan, time_limit_s: float | None = None):
        rep_ = run(plan, args.steps, args.warmup, time_limit_s)
        auto_runs.setdefault(signature(plan), rep_)
        return rep_

    t = time.perf_counter()
    try:
        rl = {f"policy:{args.policy}": plans[f"rl-{args.policy}"]} if args.policy else None
        plans["auto"] = auto_plan(spec, cluster, budget=args.auto_budget, graph=graph,
                                  measure=measure_for_auto, top_k=3, cache_dir=CACHE,
                                  extra_plans=rl)
        search["auto"] = time.perf_counter() - t
    except Exception as e:  # noqa: BLE001
        say(f"  auto failed: {e}")

    # ---- the calibration auto saved (its measurements, and earlier runs' on this machine)
    from autoplace.search.calibration import Calibration

    cal = Calibration.load(CACHE, graph, cluster)
    say(f"  calibration: {len(cal.samples)} samples, "
        + ", ".join(f"{f} x{v:.2f}" for f, v in cal.time_factors.items()))

    # ---- distinct plans, simulated
    distinct: dict[str, dict[str, Any]] = {}
    for k, plan in plans.items():
        sig = signature(plan)
        if sig not in distinct:
            r = simulate(graph, plan, cluster)
            distinct[sig] = {"plan": plan, "planners": [], "sim": r, "runs": []}
        distinct[sig]["planners"].append(k)
    rec = {"name": name, "model": sc["model"], "options": sc["options"],
           "memory_cap_bytes": cap, "num_devices": n, "lower_bound_s": lb,
           "profile_s": profile_s, "plans": []}
    out["scenarios"].append(rec)

    def record() -> None:
        rows = []
        for d in distinct.values():
            meds = [r["median"] for r in d["runs"] if r.get("median")]
            steps = [s for r in d["runs"] for s in r.get("steps", [])]
            err = next((r["error"] for r in d["runs"] if r.get("error")), None)
            for k in d["planners"]:
                rows.append({
                    "planner": k, "manual": k in hand, "parallel": d["plan"].split(),
                    "same_plan_as": [x for x in d["planners"] if x != k],
                    "executed": bool(d["runs"]),
                    "measured_step_time_s": statistics.median(steps) if steps else None,
                    "rep_medians_s": meds,
                    "spread_s": [min(meds), max(meds)] if meds else None,
                    "sim_step_time_s": d["sim"].step_time_s,
                    "calibrated_sim_step_time_s": cal.step_time(d["plan"],
                                                                d["sim"].step_time_s),
                    "sim_peak_memory_bytes": d["sim"].peak_memory_bytes,
                    "peak_memory_bytes": next((r["peak"] for r in d["runs"] if r.get("peak")),
                                              None),
                    "oom": any(r.get("oom") for r in d["runs"]) if d["runs"] else d["sim"].oom,
                    "oom_measured": any(r.get("oom") for r in d["runs"]),
                    # the allocator's retries in each run's timed steps (it hit the cap)
                    "alloc_retries": [r.get("alloc_retries", 0) for r in d["runs"]],
                    # the allocator's peak reserved memory of a device (allocated + cached)
                    "reserved_peak_bytes": max((r["reserved"] for r in d["runs"]
                                                if r.get("reserved")), default=None),
                    # with --memory: rank 0's allocator record of its first run (reserved
                    # memory per stream, what was alive at the peak; memory_record.py)
                    "memory_record": next((r["memory"] for r in d["runs"] if r.get("memory")),
                                          None),
                    "error": err,
                    "search_time_s": search.get(k),
                })
        rec["plans"] = rows
        ok = {r["planner"]: r["measured_step_time_s"] for r in rows
              if r["measured_step_time_s"] and not r["oom_measured"]}
        manual = [v for k, v in ok.items() if k in hand]
        rec["best_manual_s"] = min(manual) if manual else None
        rec["best_manual"] = min((k for k in ok if k in hand), key=ok.get, default=None)
        a = ok.get("auto")
        rec["auto_vs_best_manual"] = a / rec["best_manual_s"] if a and manual else None
        rec["auto_vs_lower_bound"] = a / lb if a else None
        pairs = [(d["sim"].step_time_s, statistics.median(s), d["plan"])
                 for d in distinct.values()
                 if (s := [x for r in d["runs"] for x in r.get("steps", [])])
                 and not any(r.get("oom") for r in d["runs"])]
        for suffix, sims in (("", [p[0] for p in pairs]),
                             ("_calibrated", [cal.step_time(p[2], p[0]) for p in pairs])):
            errs = [abs(s - p[1]) / p[1] for s, p in zip(sims, pairs)]
            rec["sim_error_median" + suffix] = statistics.median(errs) if errs else None
            rec["kendall_tau" + suffix] = kendall_tau(sims, [p[1] for p in pairs])
        rec["kendall_tau_beyond_spread"], rec["pairs_beyond_spread"] = tau_beyond_spread(rows)
        rec["calibration"] = {"samples": len(cal.samples), "time_factors": cal.time_factors}
        save()

    def add_run(d: dict[str, Any], rep_, rep: int, source: str = "") -> None:
        d["runs"].append({"median": rep_.step_time_s if not rep_.error else None,
                          "steps": list(rep_.step_times_s) if not rep_.error else [],
                          "peak": list(rep_.peak_memory_bytes), "oom": rep_.oom,
                          "error": rep_.error,
                          "alloc_retries": getattr(rep_, "allocator_retries", 0),
                          "reserved": getattr(rep_, "reserved_peak_bytes", None),
                          "memory": rep_.extra.get("memory_summary")})
        say(f"  rep {rep}{source} {'/'.join(d['planners'])}: "
            + (f"{rep_.step_time_s * 1e3:.2f} ms (sim {d['sim'].step_time_s * 1e3:.2f})"
               if not rep_.error else f"error: {short_error(rep_.error)}")
            + run_phases(rep_))

    # ---- measure, interleaved; auto's measurement of a plan is that plan's first
    for sig, d in distinct.items():
        if sig in auto_runs:
            add_run(d, auto_runs[sig], 0, " (auto's run)")
    order = list(distinct.values())
    for rep in range(args.reps):
        pending = [d for d in order if len(d["runs"]) <= rep  # else auto measured it
                   and not any(r.get("oom") or r.get("error") for r in d["runs"])]
        while pending:
            # in this repetition's order, but first a plan whose job is up: a job that is
            # (re)starting after a failed run is not waited for while others can run
            d = next((x for x in pending if h.pool.ready(x["plan"], cluster)), pending[0])
            pending.remove(d)
            if time.perf_counter() - t_start > args.deadline_s:
                say("deadline reached: stopping measurements")
                rec["wall_s"] = time.perf_counter() - t_scenario
                record()
                return
            add_run(d, run(d["plan"], args.steps, args.warmup), rep)
            rec["wall_s"] = time.perf_counter() - t_scenario
            record()
    rec["wall_s"] = time.perf_counter() - t_scenario
    record()
    say(f"{name} done in {rec['wall_s']:.0f} s")


def retried(row: dict[str, Any]) -> str:
    """`` (cap hit: N allocator retries)`` where a plan's timed steps made the allocator
    retry (it ran into the memory cap: each retry frees the cache and synchronises)."""
    n = sum(row.get("alloc_retries") or [])
    return f" (cap hit: {n} allocator retries)" if n else ""


def markdown(out: dict[str, Any], figure: str | None = None) -> str:
    lines = [f"# Plans measured on {out['num_devices']}x {out['card']}",
             "", f"torch {out['torch_version']}, driver {out['driver']}, {out['date']}. "
             f"Measured: median of the {out['steps'] * out['reps']} timed steps of "
             f"{out['reps']} interleaved repetitions ({out['steps']} steps after "
             f"{out['warmup']} warm-up each; spread = min-max of the repetitions' medians).",
             ""]
    if figure:
        lines += [f"![every plan measured, and simulated against measured]({figure})", ""]
    if out.get("links"):
        lk = out["links"]
        bw = [x for i, row in enumerate(lk["bandwidth"]) for j, x in enumerate(row) if i != j]
        lines += [f"Simulated with measured links: copies {min(bw) / 1e9:.0f}-"
                  f"{max(bw) / 1e9:.0f} GB/s between devices, collectives at "
                  f"{lk['collective_bandwidth'] / 1e9:.0f} GB/s bus bandwidth.", ""]
    lines += [f"- {n}" for n in out.get("notes", [])] + ([""] if out.get("notes") else [])
    for sc in out["scenarios"]:
        cap = sc["memory_cap_bytes"]
        lines += [f"## {sc['name']}: {sc['model']}"
                  + (f", cap {cap / 2**30:.1f} GiB" if cap else ", no cap")
                  + (f" ({sc['run']})" if sc.get("run") else ""), ""]
        lines += ["| planner | split | measured ms | spread ms | sim ms | calibrated sim ms "
                  "| peak GiB | search s |", "|---|---|---|---|---|---|---|---|"]
        for r in sorted(sc["plans"], key=lambda r: (r["measured_step_time_s"] is None,
                                                    r["measured_step_time_s"] or 0)):
            m = r["measured_step_time_s"]
            sp = r["spread_s"]
            peak = r["peak_memory_bytes"] or r["sim_peak_memory_bytes"]
            status = "OOM" if r["oom_measured"] else ("not run" if not r["executed"] else "")
            lines.append(
                f"| {r['planner']}{' (hand-written)' if r['manual'] else ''} | {r['parallel']} | "
                f"{f'{m * 1e3:.1f}' if m else status or 'error'} | "
                f"{f'{sp[0] * 1e3:.1f}-{sp[1] * 1e3:.1f}' if sp else ''} | "
                f"{r['sim_step_time_s'] * 1e3:.1f} | "
                f"{r.get('calibrated_sim_step_time_s', r['sim_step_time_s']) * 1e3:.1f} | "
                f"{' / '.join(f'{b / 2**30:.1f}' for b in peak) if peak else ''}"
                f"{retried(r)} | "
                f"{r['search_time_s']:.1f} |" if r['search_time_s'] is not None else
                f"| {r['planner']} | {r['parallel']} | {m} | | | | | |")
        beyond = tau_beyond_spread(sc["plans"])

        def fmt(x, spec=".2f"):
            return "n/a" if x is None else format(x, spec)
        lines += ["", f"best hand-written: {sc.get('best_manual')} "
                  f"({fmt(sc.get('best_manual_s') and sc['best_manual_s'] * 1e3, '.1f')} ms); "
                  f"auto / best hand-written: {fmt(sc.get('auto_vs_best_manual'))}; "
                  f"auto / lower bound: {fmt(sc.get('auto_vs_lower_bound'))}; "
                  f"median |sim-real|/real: {fmt(sc.get('sim_error_median'))} "
                  f"(calibrated: {fmt(sc.get('sim_error_median_calibrated'))}); "
                  f"Kendall tau: {fmt(sc.get('kendall_tau'))} "
                  f"(calibrated: {fmt(sc.get('kendall_tau_calibrated'))}; over the "
                  f"{beyond[1]} pairs of plans whose repetitions do not overlap: "
                  f"{fmt(beyond[0])})", ""]
        if sc.get("calibration"):
            c = sc["calibration"]
            lines += [f"calibration ({c['samples']} measured samples, from auto's runs): "
                      + ", ".join(f"{f} x{v:.2f}" for f, v in c["time_factors"].items()), ""]
    return "\n".join(lines)


def draw(out: dict[str, Any], path: Path) -> str | None:
    """The suite's figure beside its JSON (``autoplace.viz.suite_figure``); its file name,
    or None when there is nothing to draw."""
    from autoplace.viz import suite_figure

    try:
        return suite_figure(out, path.with_suffix(".png")).name
    except ValueError:
        return None


def main() -> int:
    args = parse_args()
    if args.render:
        path = Path(args.render)
        out = json.loads(path.read_text())
        path.with_suffix(".md").write_text(markdown(out, draw(out, path)))
        print(path.with_suffix(".md").read_text())
        return 0
    from autoplace.cluster import Cluster, preset
    from autoplace.plan import strict_json

    if args.cpu or not torch.cuda.is_available():
        cluster = preset(f"cpu-x{args.nproc or 2}")
    else:
        cluster = Cluster.detect()
        if args.nproc:
            cluster = cluster.subset(list(range(args.nproc)))
    scenarios = {name: scenario(name, args.hf_module) for name in args.scenarios.split(",")}
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
    if args.cpu:
        card, driver = "cpu", "-"
    else:
        card = torch.cuda.get_device_name(0)
        try:
            driver = subprocess.run(["nvidia-smi", "--query-gpu=driver_version",
                                     "--format=csv,noheader"], capture_output=True,
                                    text=True).stdout.split("\n")[0].strip()
        except OSError:
            driver = "?"
    date = dt.date.today().isoformat()
    folder = output_folder(args.out, args.tag, card=card, gpus=cluster.num_devices,
                           driver=None if driver in ("-", "?") else driver)
    h = Driver(cluster, log_dir=Path(CACHE) / "pool-logs", memory=args.memory)
    t_start = time.perf_counter()
    out: dict[str, Any] = {"card": card, "driver": driver, "torch_version": torch.__version__,
                           "date": date, "num_devices": cluster.num_devices,
                           "steps": args.steps,
                           "warmup": args.warmup, "reps": args.reps, "scenarios": []}
    if args.links if args.links is not None else not args.cpu:
        from autoplace.executor.collectives import measured_cluster

        t = time.perf_counter()
        h.cluster, summary = measured_cluster(cluster)
        say(f"links measured in {time.perf_counter() - t:.1f} s: {summary}")
        out["links"] = {"alpha_s": h.cluster.alpha_s, "bandwidth": h.cluster.bandwidth,
                        "collective_alpha_s": h.cluster.collective_alpha_s,
                        "collective_bandwidth": h.cluster.collective_bandwidth}
    path = folder / "suite.json"

    def save() -> None:
        out["wall_s"] = time.perf_counter() - t_start
        # strict JSON: a device's link to itself (infinite bandwidth) is written as null
        path.write_text(json.dumps(strict_json(out), indent=1, default=str, allow_nan=False))
        path.with_suffix(".md").write_text(markdown(out))

    try:
        for name, sc in scenarios.items():
            if time.perf_counter() - t_start > args.deadline_s:
                say(f"deadline reached before {name}")
                break
            try:
                run_scenario(name, sc, args, h, t_start, out, save)
            except Exception as e:  # noqa: BLE001 - keep the other scenarios
                import traceback

                traceback.print_exc()
                out.setdefault("failed", {})[name] = f"{type(e).__name__}: {e}"
                save()
    finally:
        h.close()
        save()
        path.with_suffix(".md").write_text(markdown(out, draw(out, path)))
        done = [sc["name"] for sc in out["scenarios"]]
        write_run(folder, tag=args.tag, scenarios=done, kind="suite",
                  script="scripts/bench/bench_plans.py",
                  summary=f"{len(done)} scenarios on {cluster.num_devices}x {card}: every "
                          "hand-written option and planner's plan, measured and simulated.")
        say(f"wrote {path}, {path.with_suffix('.md')} and {path.with_suffix('.png')}")
        print(path.with_suffix(".md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
