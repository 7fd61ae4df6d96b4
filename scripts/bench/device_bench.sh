#!/usr/bin/env bash
# What one call on a GPU machine runs, from the repository root after it is copied there.
#   scripts/bench/device_bench.sh suite OUT [GPUS] [DEADLINE_S] [SCENARIOS]
#                                          # bench_plans.py: its default scenarios, or the
#                                          # comma-separated SCENARIOS (hf-* ones train the
#                                          # models of $HF_MODULE, default tests.helpers.hf_models;
#                                          # $SUITE_ARGS: more bench_plans.py options)
#   scripts/bench/device_bench.sh gputests OUT [TESTS...] # every GPU test (-m gpu), or
#                                          # those of the pytest paths / node ids TESTS
#   scripts/bench/device_bench.sh profiles OUT [SCENARIOS] # the scenarios' per-op profiles alone
#   scripts/bench/device_bench.sh models OUT [SPECS] [BUDGET]
#                                          # $HF_MODULE's models on the devices present:
#                                          # profile, auto, run (SPECS: "name:k=v,k=v
#                                          # name:..."), the demo with "demo"
#   scripts/bench/device_bench.sh script OUT FILE [ARGS...] # python3 FILE ARGS, logged
# Installs gymnasium from wheels in .whl/ when the machine lacks it (the device machines
# have torch, torch-geometric and networkx but no gymnasium), then autoplace itself
# (editable, no dependencies). Keeps NCCL's NVLink multicast off. Writes the results (a
# run folder's files: move OUT to bench/results/<date>-<card>x<n>-<tag>/), the log, the
# GPUs' names and the profile cache (with auto's calibration) under OUT.
set -u -o pipefail
mode=${1:?usage: scripts/bench/device_bench.sh suite|gputests|profiles|models|script OUT [GPUS] [DEADLINE_S] [SCENARIOS]}
out=${2:?usage: scripts/bench/device_bench.sh suite|gputests|profiles|models|script OUT [GPUS] [DEADLINE_S] [SCENARIOS]}
gpus=${3:-}
[ "$mode" = suite ] || gpus=""  # other modes: $3 is something else
deadline=${4:-470}
scenarios=${5:-}
cd "$(dirname "$0")/../.."
HF_MODULE=${HF_MODULE:-tests.helpers.hf_models}  # found with the repository root on PYTHONPATH
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
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
    timeout $((deadline + 100)) python3 scripts/bench/bench_plans.py --out "$out" \
        --hf-module "$HF_MODULE" --deadline-s "$deadline" ${scenarios:+--scenarios "$scenarios"} ${SUITE_ARGS:-} 2>&1 \
        | tee "$out/log.txt"
    rc=$?
    tar czf "$out/cache.tgz" -C /tmp autoplace-profile 2>/dev/null
    ;;
gputests)  # every GPU test (more than 540 s on 2x H200), or those of $3...
    shift 2
    [ $# -gt 0 ] || set -- tests
    timeout 540 python3 -m pytest -q -m gpu --durations=15 "$@" 2>&1 \
        | tee "$out/gpu-tests.txt"
    rc=$?
    ;;
profiles)  # the suite's per-op profiles alone (for replay_suite.py)
    PYTHONPATH=scripts/bench:$PYTHONPATH timeout 300 python3 - "$out" "$HF_MODULE" \
        "${3:-gpt1b,gnmt4-capped,branchy-mlp,inception}" <<'PY' 2>&1 \
        | tee "$out/log.txt"
import sys, time
import bench_plans as bp
from autoplace import workloads
from autoplace.costs.profile import profile
for name in sys.argv[3].split(","):
    sc = bp.scenario(name, sys.argv[2])
    t0 = time.perf_counter()
    g = profile(workloads.get(sc["model"], **sc["options"]), ["cuda:0"], repeats=3,
                cache_dir=sys.argv[1] + "/profiles")
    cal = g.profile_info[next(iter(g.profile_info))]["calibration"]
    print(name, f"{time.perf_counter() - t0:.1f} s", {k: round(v, 5) for k, v in cal.items()},
          flush=True)
PY
    rc=$?
    ;;
models)  # Hugging Face models as a user brings them: profile, plan --planner auto, run
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
        timeout 200 autoplace profile --model "$HF_MODULE:$name" "${opts[@]}" --repeats 3 \
            --cache-dir /tmp/prof --no-links -o "/tmp/$name-graph.json" 2>&1 | tail -n 3 \
            | tee -a "$out/log.txt"
        timeout 200 autoplace plan --model "$HF_MODULE:$name" "${opts[@]}" --cluster detect \
            --planner auto --budget "$budget" --profile-dir /tmp/prof \
            -o "$out/$name-plan.json" 2>&1 | tail -n 12 | tee -a "$out/log.txt"
        timeout 200 autoplace run "$out/$name-plan.json" --model "$HF_MODULE:$name" \
            --steps 20 --warmup 5 --report "/tmp/$name-report.json" 2>&1 | tail -n 3 | tee -a "$out/log.txt"
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
    echo "unknown mode $mode: suite, gputests, profiles, models or script"; exit 2 ;;
esac
exit "$rc"
