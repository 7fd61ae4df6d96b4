#!/usr/bin/env bash
# Trace hand-written plans on the GPUs present (torch.profiler, one Chrome trace per
# rank) and summarise where each step went: autoplace trace-summary per plan.
#   scripts/bench/trace_plans.sh OUT_DIR [cluster preset]
# Plans: gpt-1b DDP / ZeRO-2 / FSDP2 (and FSDP2 under a 16 GB cap), branchy-mlp DDP /
# FSDP2, inception-v3 single and annealed placement.
set -u
out=${1:?usage: scripts/bench/trace_plans.sh OUT_DIR [cluster]}
cluster=${2:-h200x2}
mkdir -p "$out"
plan() {  # name model planner [extra plan args]
    local name=$1 model=$2 planner=$3; shift 3
    autoplace plan --cluster "$cluster" --model "$model" --planner "$planner" -o "$out/$name.json" "$@" \
        2>&1 | tail -1
}
trace() {  # name [run args]
    local name=$1; shift
    echo "== $name"
    timeout 170 autoplace run "$out/$name.json" --steps 8 --warmup 3 --no-reference \
        --trace "$out/tr-$name" "$@" 2>&1 | grep -v "Warning\|warn(" | tail -3
    autoplace trace-summary "$out/tr-$name"/trace-rank*.json --top 10 \
        > "$out/sum-$name.txt" 2>&1
    head -c 3000 "$out/sum-$name.txt"
}
plan gpt-ddp gpt-1b ddp
plan gpt-zero2 gpt-1b zero2
plan gpt-fsdp gpt-1b fsdp
plan mlp-ddp branchy-mlp ddp --option in_dim=1024 --option hidden=2048 --option branches=8 \
    --option depth=4 --option num_classes=1000 --batch-size 1024
plan mlp-fsdp branchy-mlp fsdp --option in_dim=1024 --option hidden=2048 --option branches=8 \
    --option depth=4 --option num_classes=1000 --batch-size 1024
INC="--option image_size=299 --option width=1.0 --option num_classes=1000 --batch-size 32"
plan inc-single inception-v3 single $INC
plan inc-anneal inception-v3 anneal $INC
trace gpt-fsdp
trace gpt-ddp
trace gpt-zero2
trace gpt-fsdp --memory-cap 16GB
trace mlp-ddp
trace mlp-fsdp
echo "== inception, per step"
timeout 120 autoplace run "$out/inc-single.json" --steps 6 --warmup 2 --no-reference 2>&1 | grep "step\|error" | tail -8
timeout 120 autoplace run "$out/inc-anneal.json" --steps 6 --warmup 2 --no-reference 2>&1 | grep "step\|error" | tail -8
