"""Session-23 probe (not kept): traces of GNMT-4 FSDP2 by blocks and by modules, no cap."""
import os, subprocess, sys
sys.path.insert(0, "scripts")
from bench_plans import SCENARIOS
from autoplace import baselines, workloads
from autoplace.capture import capture_workload
from autoplace.cluster import resolve
from autoplace.executor.launch import run_plan

out = sys.argv[1]
sc = SCENARIOS["gnmt4-capped"]
wl = workloads.get(sc["model"], **sc["options"])
spec = {"spec": sc["model"], "options": sc["options"]}
cl = resolve("detect")
plan = baselines.get("fsdp")(capture_workload(wl), cl)
for units in ("blocks", "modules"):
    d = f"/tmp/tr-{units}"
    rep = run_plan(plan.with_parallel(shard_units=units), spec, cluster=cl, steps=6, warmup=3,
                   reference=False, timeout_s=120, trace_dir=d)
    print(units, [round(t * 1e3, 1) for t in rep.step_times_s], flush=True)
    r = subprocess.run([sys.executable, "scripts/trace_summary.py", "--top", "25",
                        f"{d}/trace-rank0.json"], capture_output=True, text=True)
    open(f"{out}/summary-{units}.txt", "w").write(r.stdout + r.stderr)
    print(r.stdout[-6000:], r.stderr[-2000:], flush=True)
