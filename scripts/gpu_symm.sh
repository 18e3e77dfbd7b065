#!/usr/bin/env bash
# GPU call (fourth session): the copy-engine Ulysses transport (ditmesh.symm) on 2 GPUs.
# 1. tests/gpu: symm equals the NCCL path, eager and compiled.
# 2. scripts/overlap_bench.py: FLUX.1-dev 1024^2, one-GPU rows, then ulysses x2 with NCCL and with copy engines.
# VARIANTS overrides the variant list; rows land in $OUT/overlap.jsonl.
set -u
source scripts/gpu_env.sh
N=$(nvidia-smi -L | wc -l)
timeout 240 python3 -m pytest -q -s -x tests/gpu 2>&1 | grep -E "^\{|passed|failed|Error" | cut -c1-400
V=${VARIANTS:-c1-eager-nofuse-symm,c1-graph-nofuse,c1-graph-nofuse-symm,c2-graph-nofuse-symm,c2-graph-nofuse}
timeout ${LIMIT:-420} torchrun --nproc_per_node $N scripts/overlap_bench.py --single ${SINGLE:-eager} --variants "$V" --steps 8 2>&1 \
  | grep -E '^\{|Error|error' | cut -c1-700
