#!/usr/bin/env bash
# Issue 32's GPU rows in one call (GPUS=4 GPUs of one host by default), in order of priority, each part skipping what would end
# after its share of the call: (1) `ditmesh generate` timed from outside with its timeline, FLUX.1-dev architecture
# (synthesized once into /tmp/flux-dev, shared by every row), 1024², 28 steps, --compile --cuda-graph, warm compile
# caches (the warm-ups of every row at once first): ulysses 4 on the baseline tree (.old/src) and on this tree, then
# 1 GPU, pp 4 and displaced on this tree (ROWS=...:cold adds a cold row); (2) `ditmesh serve` at ulysses 4 under 1
# and 16 clients (one request each), this tree then the baseline tree, both on the compile caches the generate rows
# filled (serve's own cache folder); (3) what time is left: serve's 4 x 1 GPU
# under 16 clients without and with --max-batch 4.
#
# Before the call, once, in the checkout that travels (the baseline tree as an ignored folder):
#   bash scripts/gpu_issue32.sh --prepare 42e3be5
# The call (carry .old and .whl):
#   bash scripts/gpu_issue32.sh
# Writes e2e.json/e2e.md, serve-new.json, serve-old.json, serve-4x1.json and the servers' logs into $OUT.
set -u
if [ "${1:-}" = "--prepare" ]; then
  commit=${2:?give the baseline commit}
  rm -rf .old && mkdir -p .old && git archive "$commit" src | tar -x -C .old || exit 1
  exclude=$(git rev-parse --git-path info/exclude) && mkdir -p "$(dirname "$exclude")"
  grep -qx '/.old/' "$exclude" 2>/dev/null || echo '/.old/' >> "$exclude"
  echo "baseline $commit in .old/src ($(du -sh .old | cut -f1)); carry .old"
  exit 0
fi
[ -d .old/src/ditmesh ] || { echo "no .old/src/ditmesh: run 'bash scripts/gpu_issue32.sh --prepare COMMIT' and carry .old"; exit 2; }
OUT=${OUT:-/tmp/e2e-out}
mkdir -p "$OUT"
TOTAL_S=${TOTAL_S:-585}  # the whole call's share of the device's 600 s
G=${GPUS:-4}  # the GPUs of the machine: ulysses G, G one-GPU replicas
ROWS=${ROWS:-old:ulysses:warm,new:ulysses:warm,new:1gpu:warm,new:displaced:warm,new:pp:warm}
SERVE="--steps 28 --height 1024 --width 1024 --compile --cuda-graph --logs $OUT/serve-logs"
left() { echo $((TOTAL_S - SECONDS)); }
# (1) generate: about half of the call
bash scripts/gpu.sh python3 scripts/e2e_bench.py --synth flux-dev --model /tmp/flux-dev --gpus "$G" \
  --height 1024 --width 1024 --steps 28 --compile --cuda-graph --baseline-src .old/src --parallel-warmups \
  --shared-cache "${DITMESH_CACHE:-$HOME/.cache/ditmesh}/compile" \
  --deadline-s "${GENERATE_S:-400}" --out "$OUT" --rows "$ROWS"
# (2) serve at ulysses 4, this tree then the baseline's (the same bench script drives both: only the server differs)
if [ "$(left)" -gt 60 ]; then
  bash scripts/gpu.sh python3 scripts/serve_bench.py --model /tmp/flux-dev --layout "--nproc $G --ulysses $G" \
    --clients 1,16 --requests-per-client 1 --deadline $(( $(left) * 55 / 100 )) --json "$OUT/serve-new.json" $SERVE
fi
if [ "$(left)" -gt 60 ]; then
  OLD=1 bash scripts/gpu.sh python3 scripts/serve_bench.py --model /tmp/flux-dev --layout "--nproc $G --ulysses $G" \
    --clients 1,16 --requests-per-client 1 --deadline $(( $(left) - 15 )) --json "$OUT/serve-old.json" $SERVE
fi
# (3) four one-GPU replicas, without and with batching
if [ "$(left)" -gt 60 ]; then
  bash scripts/gpu.sh python3 scripts/serve_bench.py --model /tmp/flux-dev --layout "--nproc 1 --replicas $G" \
    --layout "--nproc 1 --replicas $G --max-batch 4" --clients 16 --deadline $(( $(left) - 10 )) \
    --json "$OUT/serve-4x1.json" $SERVE
fi
echo "call: ${SECONDS} s"
