#!/usr/bin/env bash
# Issue 32's service rows (part 3) in one call on 4 GPUs: scripts/serve_bench.py --preset gpu-serve on FLUX.1-dev's
# architecture (random weights), 1024², 28 steps, --compile --cuda-graph: one Ulysses 4 group at 1 and 16 clients,
# four one-GPU replicas under 16 clients without and with --max-batch 4, and the Ulysses 4 group switching two named
# adapters (requests take turns with a, b and none). Prints the latency and phase tables; writes $OUT/serve.json
# and each server's log to $OUT/serve-logs. Rows that would end after DEADLINE_S (default 540) are reported skipped.
#
#   bash scripts/gpu.sh bash scripts/gpu_serve.sh                 # on the GPU machine (MODEL shared with other rows)
#   FULL_TEXT=1 bash scripts/gpu.sh bash scripts/gpu_serve.sh     # first give MODEL full-size text encoders
#   CPU_DRY_RUN=1 bash scripts/gpu_serve.sh                       # the same flow on CPU: flux-tiny-tp, 64², 2 steps
set -u
OUT=${OUT:-/tmp/serve-out}
mkdir -p "$OUT"
export PYTHONPATH=${PYTHONPATH:-$PWD/src}
if [ "${CPU_DRY_RUN:-0}" = 1 ]; then
  # flux-tiny-tp: 4 heads, which Ulysses 4 divides
  MODEL=${MODEL:-$OUT/flux-tiny-tp} ARCH=flux-tiny-tp RANK=4 SHAPE="--steps 2 --height 64 --width 64" FAST=""
  LAYERS="--layers 2"
else
  MODEL=${MODEL:-/tmp/flux-dev} ARCH=flux-dev RANK=64 SHAPE="--steps 28 --height 1024 --width 1024"
  FAST="--compile --cuda-graph" LAYERS=""
fi
[ -f "$MODEL/model_index.json" ] || python3 -m ditmesh synth --arch "$ARCH" --out "$MODEL" || exit 1
if [ "${FULL_TEXT:-0}" = 1 ]; then
  # shellcheck disable=SC2086
  python3 scripts/full_text_encoders.py "$MODEL" $LAYERS || exit 1
fi
[ -f "$MODEL-lora/lora.safetensors" ] || python3 -m ditmesh synth --lora "$RANK" --model "$MODEL" --out "$MODEL-lora" \
  || exit 1
# shellcheck disable=SC2086  # SHAPE and FAST are lists of options
exec python3 scripts/serve_bench.py --model "$MODEL" --preset gpu-serve --lora-file "$MODEL-lora/lora.safetensors" \
  --deadline "${DEADLINE_S:-540}" --json "$OUT/serve.json" --logs "$OUT/serve-logs" $FAST $SHAPE
