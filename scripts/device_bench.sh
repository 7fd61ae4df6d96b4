#!/usr/bin/env bash
# One device call's worth of GPU benchmarking, as the session-15 results were made.
#   scripts/device_bench.sh suite OUT [GPUS] [DEADLINE_S] [SCENARIOS]
#                                                          # bench_plans: every scenario, or
#                                                          # the comma-separated SCENARIOS
#   scripts/device_bench.sh flow OUT                       # bench_flow (+ copy streams) and
#                                                          # the GPU tests of the executor
#   scripts/device_bench.sh copies OUT [SUITE] [TAG]       # bench_copies on the placements of
#                                                          # a stored suite
#   scripts/device_bench.sh gputests OUT                   # every GPU test (-m gpu)
#   scripts/device_bench.sh traces OUT [SUITE] [TAG] [SCENARIOS] [PLANNERS]
#                                                          # traces of such placements (a tarball)
#   scripts/device_bench.sh profiles OUT [SCENARIOS]       # the scenarios' per-op profiles alone
#   scripts/device_bench.sh graphs OUT [SUITE] [TAG] [JOBS] [ROUNDS] [WAYS]
#                                                          # bench_copies: eager against CUDA
#                                                          # graphs, one-process placements;
#                                                          # JOBS: "scen:plan,plan;scen:..."
#   scripts/device_bench.sh models OUT [SPECS] [BUDGET]    # tests/hf_models.py's models on
#                                                          # the devices present: profile,
#                                                          # auto, run (SPECS: "name:k=v,k=v
#                                                          # name:..."), demo with "demo"
#   scripts/device_bench.sh script OUT FILE [ARGS...]      # python3 FILE ARGS, logged
# Installs gymnasium from wheels in .whl/ when the machine lacks it (the device machines
# have torch, torch-geometric and networkx but no gymnasium), then autoplace itself
# (editable, no dependencies). Keeps NCCL's NVLink multicast off. Writes the results, the
# log, the GPUs' names and the profile cache (with auto's calibration) under OUT.
set -u -o pipefail
mode=${1:?usage: scripts/device_bench.sh suite|flow|copies|gputests|traces|profiles|script OUT [GPUS] [DEADLINE_S] [SCENARIOS]}
out=${2:?usage: scripts/device_bench.sh suite|flow|copies|gputests|traces|profiles|script OUT [GPUS] [DEADLINE_S] [SCENARIOS]}
gpus=${3:-}
[ "$mode" = suite ] || gpus=""  # other modes: $3 is something else
deadline=${4:-470}
scenarios=${5:-}
cd "$(dirname "$0")/.."
mkdir -p "$out"
if ! python3 -c "import gymnasium" 2>/dev/null; then
    ls .whl/*.whl >/dev/null 2>&1 || { echo "no gymnasium and no wheels in .whl/"; exit 2; }
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl || exit 2
    export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . >/dev/null 2>&1 \
    || { echo "installing autoplace failed"; exit 2; }
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
if [ -n "$gpus" ]; then
    CUDA_VISIBLE_DEVICES=$(seq -s, 0 $((gpus - 1)))
    export CUDA_VISIBLE_DEVICES
fi
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > "$out/gpus.txt"
case "$mode" in
suite)
    timeout $((deadline + 100)) python3 scripts/bench_plans.py --out "$out" \
        --deadline-s "$deadline" ${scenarios:+--scenarios "$scenarios"} 2>&1 \
        | tee "$out/log.txt"
    rc=$?
    tar czf "$out/cache.tgz" -C /tmp autoplace-profile 2>/dev/null
    ;;
flow)
    python3 -m pytest -q -m gpu tests/test_executor_gpu.py -k "streamed or local" 2>&1 \
        | tee "$out/gpu-tests.txt"
    timeout 400 python3 scripts/bench_flow.py --copy-streams --cap-gib 16 \
        --out "$out/flow-cap16.json" 2>&1 | tee "$out/log.txt"
    rc=$?
    ;;
copies)
    suite=${3:-bench/results/2026-11-27-h200x2-s17-suite.json}
    tag=${4:-s17}
    common=("$suite" --profiles bench/results/raw --tag "$tag")
    timeout 200 python3 scripts/bench_copies.py "${common[@]}" --scenarios branchy-mlp \
        --trace "$out/traces" --out "$out/copies-branchy.json" 2>&1 | tee "$out/log.txt"
    rc=$?
    timeout 300 python3 scripts/bench_copies.py "${common[@]}" \
        --scenarios inception,gnmt4-capped --out "$out/copies.json" 2>&1 | tee -a "$out/log.txt"
    rc=$((rc || $?))
    ;;
gputests)  # every GPU test (in session 18 they needed more than 240 s on 2x H200)
    timeout 540 python3 -m pytest -q -m gpu tests 2>&1 | tee "$out/gpu-tests.txt"
    rc=$?
    ;;
traces)  # Chrome traces of one-process placements (both copy ways), one tarball
    suite=${3:-bench/results/2026-11-27-h200x2-s17-suite.json}
    tag=${4:-s17}
    scenarios=${5:-inception}
    planners=${6:-two-halves,critical-path,m-sct}
    timeout 400 python3 scripts/bench_copies.py "$suite" --profiles bench/results/raw \
        --tag "$tag" --scenarios "$scenarios" --planners "$planners" --rounds 1 --steps 5 \
        --trace /tmp/traces --out "$out/traces.json" 2>&1 | tee "$out/log.txt"
    rc=$?
    tar czf "$out/traces.tgz" -C /tmp traces
    ;;
profiles)  # the suite's per-op profiles alone (for scripts/replay_suite.py)
    timeout 300 python3 - "$out" "${3:-gpt1b,gnmt4-capped,branchy-mlp,inception}" <<'PY' 2>&1 \
        | tee "$out/log.txt"
import sys, time
sys.path.insert(0, "scripts")
import bench_plans as bp
from autoplace import workloads
from autoplace.costs.profile import profile
for name in sys.argv[2].split(","):
    sc = bp.SCENARIOS[name]
    t0 = time.perf_counter()
    g = profile(workloads.get(sc["model"], **sc["options"]), ["cuda:0"], repeats=3,
                cache_dir=sys.argv[1] + "/profiles")
    cal = g.profile_info[next(iter(g.profile_info))]["calibration"]
    print(name, f"{time.perf_counter() - t0:.1f} s", {k: round(v, 5) for k, v in cal.items()},
          flush=True)
PY
    rc=$?
    ;;
graphs)  # one-process placements eagerly and replayed as CUDA graphs, side by side
    suite=${3:-bench/results/2026-11-27-h200x2-s19-suite.json}
    tag=${4:-s19}
    jobs=${5:-"gpt1b:single,two-halves,two-halves@mb2,two-halves@mb4,two-halves@mb8;inception:single,two-halves,two-halves@mb2,m-sct,critical-path;gnmt4-capped:two-halves,two-halves@mb2,m-etf,m-etf@mb2,expert;branchy-mlp:single,two-halves,two-halves@mb2,m-sct"}
    rounds=${6:-2}
    ways=${7:-to,graphs}
    common=("$suite" --profiles bench/results/raw --tag "$tag" --ways "$ways" --rounds "$rounds")
    : > "$out/log.txt"
    IFS=';' read -ra list <<< "$jobs"
    for job in "${list[@]}"; do
        scen=${job%%:*}
        timeout 135 python3 scripts/bench_copies.py "${common[@]}" --scenarios "$scen" \
            --planners "${job#*:}" --out "$out/graphs-$scen.json" 2>&1 | tee -a "$out/log.txt"
    done
    rc=0
    ;;
models)  # Hugging Face models as a user brings them: profile, plan --planner auto, run
    export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
    specs=${3:-"llama:layers=12,hidden=768,heads=12,kv_heads=4,vocab=32000,seq=512,batch_size=16"}
    budget=${4:-30s}
    : > "$out/log.txt"
    rc=0
    for spec in $specs; do
        if [ "$spec" = demo ]; then
            (cd /tmp && timeout 300 autoplace demo) 2>&1 | tee -a "$out/log.txt"
            rc=$((rc || $?))
            continue
        fi
        name=${spec%%:*}
        opts=(--option autocast_dtype=bfloat16 --option lr=3e-4)
        IFS=',' read -ra kv <<< "${spec#*:}"
        for x in "${kv[@]}"; do opts+=(--option "$x"); done
        echo "=== $spec" | tee -a "$out/log.txt"
        t0=$(date +%s)
        timeout 200 autoplace profile --model "tests.helpers.hf_models:$name" "${opts[@]}" --repeats 3 \
            --cache-dir /tmp/prof --no-links -o "/tmp/$name-graph.json" 2>&1 | tail -n 3 \
            | tee -a "$out/log.txt"
        timeout 200 autoplace plan --model "tests.helpers.hf_models:$name" "${opts[@]}" --cluster detect \
            --planner auto --budget "$budget" --profile-dir /tmp/prof \
            -o "$out/$name-plan.json" 2>&1 | tail -n 12 | tee -a "$out/log.txt"
        timeout 200 autoplace run "$out/$name-plan.json" --steps 20 --warmup 5 \
            --report "/tmp/$name-report.json" 2>&1 | tail -n 3 | tee -a "$out/log.txt"
        rc=$((rc || $?))
        echo "=== $name: $(( $(date +%s) - t0 )) s" | tee -a "$out/log.txt"
    done
    ;;
script)  # any Python script of the repo, after the set-up above: script OUT FILE ARGS...
    shift 2
    timeout 540 python3 "$@" 2>&1 | tee "$out/log.txt"
    rc=$?
    ;;
*)
    echo "unknown mode $mode: suite, flow, copies, gputests, traces, profiles, graphs or script"; exit 2 ;;
esac
exit "$rc"
