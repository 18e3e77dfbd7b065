#!/usr/bin/env bash
# A/B step times of two source trees in one GPU call, on the same card: the baseline tree in .old/src (carry it:
# `git archive <commit> src/ditmesh ':(exclude)src/ditmesh/assets' | tar -x -C .old`) and the working tree.
# Usage on the device machine: bash scripts/gpu_ab_bench.sh [bench options]  (rows under $OUT/{old,new}.json)
set -u
source scripts/gpu_env.sh
python3 -c "import torch, diffusers; print('torch', torch.__version__, 'diffusers', diffusers.__version__, 'gpus', torch.cuda.device_count())"
SITE=${PYTHONPATH%%:*}
for tree in old new; do
  src=$PWD/src; [ "$tree" = old ] && src=$PWD/.old/src
  echo "== $tree ($src)"
  PYTHONPATH=$SITE:$src timeout "${AB_TIMEOUT:-280}" python3 -m ditmesh bench "$@" --out "$OUT/$tree.json" 2>&1 \
    | grep -E "^\||wrote|Error|error"
done
