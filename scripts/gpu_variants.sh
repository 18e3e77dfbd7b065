#!/usr/bin/env bash
# GPU call: the Ulysses variant study (scripts/overlap_bench.py) at 4 and then 2 GPUs, FLUX.1-dev 1024^2.
# VARIANTS4 / VARIANTS2 override the variant lists; rows land in $OUT/overlap.jsonl.
set -u
source scripts/gpu_env.sh
V4=${VARIANTS4:-c1-graph-nofuse,c1-graph-nofuse-symm,c2-graph-nofuse-symm,c2-graph-nofuse}
V2=${VARIANTS2:-c1-graph-nofuse,c1-graph-nofuse-symm,c2-graph-nofuse}
timeout 400 torchrun --nproc_per_node 4 scripts/overlap_bench.py --variants "$V4" --steps 6 2>&1 \
  | grep -E '^\{|Error|error' | cut -c1-600
timeout 170 torchrun --nproc_per_node 2 scripts/overlap_bench.py --single eager --variants "$V2" --steps 6 2>&1 \
  | grep -E '^\{|Error|error' | cut -c1-600
