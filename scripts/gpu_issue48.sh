#!/usr/bin/env bash
# Issue 48's rows: 4 GPUs of one host (nvidia-h200-x4), each part beside the 1-GPU rows of the same mode in the same
# call, skipped when less than its share of the call is left (PARTS picks parts; default all, in this order):
#   flux   `ditmesh bench` FLUX.1-dev 1024², compile + CUDA graphs: 1 GPU and ulysses 4 x {default, fp8} attention x
#          {off, fp8} linears (ring 4 and USP 2x2 take no 8-bit attention: the options refuse them in one line, since
#          each key chunk's P would round against its own maximum; their bf16 and fp8-linear rows are in `ring`)
#   comm   ulysses 4 with fp8 payloads (--comm-dtype fp8) on fp8 linears with the fp8 attention
#   ring   ring 4 and USP 2x2 with {off, fp8} linears
#   wan    Wan2.1-14B 480x832x81, 1 GPU and ulysses 4 x {default, fp8} attention x {off, fp8} linears
#   serve  `ditmesh serve` FLUX.1-dev with 4 one-GPU replicas and with one ulysses-4 group, 16 clients, --max-batch 4
#          off and on, at 1024² and 512² (scripts/serve_bench.py)
# The planner's predictions for the bench rows: bench/results/2026-12-02_plan-h200x4 (ditmesh plan ... --attention
# fp8 --quant fp8 --json). On GPUs (carry .whl):  bash scripts/gpu_issue48.sh
# DRY=1: the same commands on 2 CPU processes with tiny architectures, the 8-bit attention emulated, no compile or
# graphs (what a CPU machine can run), to check the script end to end.
set -u
OUT=${OUT:-/tmp/issue48}
mkdir -p "$OUT"
TOTAL_S=${TOTAL_S:-570}
PARTS=${PARTS:-flux,comm,ring,wan,serve}
left() { echo $((TOTAL_S - SECONDS)); }
want() { [[ ",$PARTS," == *",$1,"* ]] && [ "$(left)" -gt "$2" ]; }
if [ "${DRY:-0}" = 1 ]; then
  PY=${PYTHON:-python3}; RUN=("$PY" -m ditmesh); SERVE_RUN=("$PY"); G=2; ATT=fp8-emulated; Q=fp8
  FLUX=(--model flux-tiny --height 64 --width 64 --compile off --no-cuda-graph --steps 2 --warmup 1)
  WAN=(--model wan-tiny --height 32 --width 32 --frames 5 --compile off --no-cuda-graph --steps 2 --warmup 1)
  SERVE_MODEL=flux-tiny; SIZES="64"; CLIENTS=4
else
  RUN=(bash scripts/gpu.sh python3 -m ditmesh); SERVE_RUN=(bash scripts/gpu.sh python3); G=4; ATT=fp8; Q=fp8
  FLUX=(--model flux-dev --height 1024 --width 1024 --compile on --steps 3 --warmup 1 --row-timeout 300)
  WAN=(--model wan2.1-14b --height 480 --width 832 --frames 81 --compile on --steps 2 --warmup 1 --row-timeout 300)
  SERVE_MODEL=flux-dev; SIZES="1024 512"; CLIENTS=16
fi
if want flux 120; then
  timeout $(( $(left) - 10 )) "${RUN[@]}" bench "${FLUX[@]}" --methods ulysses --gpus 1,$G \
    --attention default,$ATT --quant off,$Q --out "$OUT/flux.json"
fi
if want comm 60; then
  timeout $(( $(left) - 10 )) "${RUN[@]}" bench "${FLUX[@]}" --methods ulysses --gpus $G --no-single \
    --attention $ATT --quant $Q --comm-dtype fp8 --out "$OUT/flux-comm.json"
fi
if want ring 60; then
  timeout $(( $(left) - 10 )) "${RUN[@]}" bench "${FLUX[@]}" --methods ring,usp --gpus $G --no-single \
    --quant off,$Q --out "$OUT/flux-ring.json"
fi
if want wan 120; then
  timeout $(( $(left) - 10 )) "${RUN[@]}" bench "${WAN[@]}" --methods ulysses --gpus 1,$G \
    --attention default,$ATT --quant off,$Q --out "$OUT/wan.json"
fi
if want serve 120; then
  for size in $SIZES; do
    for batch in 1 4; do
      extra="--height $size --width $size --steps 8 --max-batch $batch"
      [ "${DRY:-0}" = 1 ] || extra="$extra --compile --cuda-graph"
      timeout $(( $(left) - 10 )) "${SERVE_RUN[@]}" scripts/serve_bench.py --model $SERVE_MODEL --clients $CLIENTS --deadline $(( $(left) / 2 )) \
        --layout "--nproc 1 --replicas $G $extra" --layout "--nproc $G --ulysses $G $extra" \
        --json "$OUT/serve-$size-batch$batch.json" --logs "$OUT/serve-logs-$size-$batch"
    done
  done
fi
echo "issue48: done at ${SECONDS}s"
