"""GPU: the two mended GPU tests; GNMT-4 uncapped on 2 GPUs: DDP, ZeRO-1 and critical-path,
each run with a trace and a report (step time, peak), then trace-summary."""
import os
import subprocess
import sys
import time

out = sys.argv[1]
os.makedirs(out, exist_ok=True)
def sh(cmd, log, timeout):
    t = time.time()
    with open(os.path.join(out, log), "a") as f:
        f.write(f"$ {cmd}\n")
        f.flush()
        try:
            r = subprocess.run(cmd, shell=True, stdout=f, stderr=subprocess.STDOUT, timeout=timeout)
            rc = r.returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
        f.write(f"# rc={rc} {time.time() - t:.1f}s\n")
    print(log, cmd[:90], rc, f"{time.time() - t:.1f}s", flush=True)
sh("python3 -m pytest -q -m gpu tests/executor/test_memory_record.py tests/executor/test_profile_block.py::test_block_on_a_gpu", "tests.txt", 200)
G = "--option hidden=1024 --option vocab_size=32000 --option src_len=50 --option tgt_len=50 --batch-size 128"
for name in ("ddp", "zero1", "critical-path"):
    sh(f"autoplace plan --cluster h200x2 --model gnmt-4 --planner {name} -o {out}/{name}.json {G}", "plans.txt", 120)
for name in ("ddp", "zero1", "critical-path"):
    sh(f"autoplace run {out}/{name}.json --steps 12 --warmup 4 --report {out}/rep-{name}.json --trace {out}/tr-{name}", f"run-{name}.txt", 150)
    sh(f"autoplace trace-summary {out}/tr-{name}/trace-rank*.json --top 12 --json {out}/sum-{name}.json", f"sum-{name}.txt", 60)
    sh(f"rm -rf {out}/tr-{name}", "plans.txt", 30)
