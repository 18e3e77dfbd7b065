#!/usr/bin/env bash
# Issue 45's GPU rows on one GPU (H200) in one call, parts in this order, each skipped when less than its share of
# the call is left (TOTAL_S, default 380):
#   e2e      scripts/e2e_bench.py: `ditmesh generate` from outside, FLUX.1-dev architecture 1024², 28 steps, compiled
#            with CUDA graphs, warm caches (a warm-up run first), beside "one import" timed in the same call; its
#            first step's breakdown and the imports' accounts (item 3)
#   serve1k  scripts/serve_bench.py at 1024², 28 steps, compiled with CUDA graphs: one replica without and with
#            --max-batch 4 (the start-up measurement decides), 1 and 4 clients: the lone request's phase table
#            against 28 x step + 0.15 s (item 2), throughput, p99 and the first picture after launch (item 1)
#   serve512 the same at 512², 4 and 16 clients (item 1)
# The synthetic checkpoint is written once to /tmp/flux-dev (random weights, the real architecture).
# The call:  bash scripts/gpu.sh bash scripts/gpu_issue45.sh      (writes into $OUT)
# CPU dry run (flux-tiny, 64², 2 steps, no compile):  DRY=1 bash scripts/gpu_issue45.sh
set -u
OUT=${OUT:-/tmp/issue45}
mkdir -p "$OUT"
TOTAL_S=${TOTAL_S:-380}
PARTS=${PARTS:-e2e,serve1k,serve512}
left() { echo $((TOTAL_S - SECONDS)); }
want() { [[ ",$PARTS," == *",$1,"* ]] && [ "$(left)" -gt "$2" ]; }
PY=${PY:-python3}
if [ "${DRY:-0}" = 1 ]; then
  ARCH=flux-tiny MODEL=$OUT/flux-tiny FAST="" BIG="--height 64 --width 64 --steps 2" SMALL="--height 32 --width 32 --steps 2"
  E2E="--cpu-dry-run"
else
  ARCH=flux-dev MODEL=/tmp/flux-dev FAST="--compile --cuda-graph" BIG="--height 1024 --width 1024 --steps 28"
  SMALL="--height 512 --width 512 --steps 28" E2E="--synth flux-dev --model $MODEL --gpus 1 --height 1024 --width 1024 --steps 28 --compile --cuda-graph"
fi
[ -f "$MODEL/model_index.json" ] || $PY -m ditmesh synth --arch "$ARCH" --out "$MODEL" >/dev/null || exit 1
echo "issue45: checkpoint ready at ${SECONDS}s"
if want e2e 120; then
  # shellcheck disable=SC2086
  timeout $(( $(left) - 10 )) $PY scripts/e2e_bench.py $E2E --rows new:1gpu:warm --deadline-s $(( $(left) - 20 )) \
    --out "$OUT/e2e" 2>&1 | tail -30
fi
serve() {  # serve() NAME SHAPE CLIENTS: one replica without, then with --max-batch 4
  # shellcheck disable=SC2086
  timeout $(( $(left) - 5 )) $PY scripts/serve_bench.py --model "$MODEL" --layout "--nproc 1" \
    --layout "--nproc 1 --max-batch 4" --clients "$3" --deadline $(( $(left) - 15 )) --json "$OUT/$1.json" \
    --logs "$OUT/$1-logs" $FAST $2 2>&1 | grep -v "^ditmesh serve-bench:" | tail -30
  grep -ho "batching[^(]*([^)]*)" "$OUT/$1-logs"/*.log
}
want serve1k 150 && serve serve-1024 "$BIG" 1,4
want serve512 100 && serve serve-512 "$SMALL" 4,16
echo "issue45: done at ${SECONDS}s"
