#!/usr/bin/env bash
# Issue 32's GPU rows in one call (4 GPUs of one host): `ditmesh generate` timed from outside with its timeline,
# FLUX.1-dev architecture (synthesized once into /tmp/flux-dev, shared by every row), 1024², 28 steps,
# --compile --cuda-graph: ulysses 4 cold; ulysses 4 warm, this tree against the baseline tree (.old/src); 1 GPU,
# displaced and pp 4 warm on this tree. Rows that would end after the deadline are skipped and listed.
#
# Before the call, once, in the checkout that travels (the baseline tree as an ignored folder):
#   bash scripts/gpu_issue32.sh --prepare 42e3be5
# The call (carry .old, and .whl where wheels are used):
#   bash scripts/gpu_issue32.sh
# Writes e2e.json and e2e.md into $OUT and prints the table.
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
# the rows, in order: cold first (it also warms ulysses 4), the warm-ups of the others at once, then each warm row
ROWS=${ROWS:-new:ulysses:cold,new:ulysses:warm,old:ulysses:warm,new:1gpu:warm,new:displaced:warm,new:pp:warm}
# serve rows (issue 32, part 3) join through scripts/e2e_bench.py's serve_rows
exec bash scripts/gpu.sh python3 scripts/e2e_bench.py --synth flux-dev --model /tmp/flux-dev --gpus 4 \
  --height 1024 --width 1024 --steps 28 --compile --cuda-graph --baseline-src .old/src --parallel-warmups \
  --deadline-s "${DEADLINE_S:-525}" --out "$OUT" --rows "$ROWS"
