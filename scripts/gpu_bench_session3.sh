#!/usr/bin/env bash
# GPU calls of 2026-11-26 (third session). PART=1: NCCL p2p-channel experiment (overlap_bench with
# NCCL_MIN_P2P_NCHANNELS=32), then the FLUX 1024^2 command at 1, 2 and 4 GPUs with both peers.
# PART=2: FLUX 2048^2 at 1 and 4 GPUs with both peers, then Wan2.1-14B video compiled at 1 and 4 GPUs.
set -u
source scripts/gpu_env.sh
# --ulysses-chunks 2: the head groups these rows ran with (the default then; one group is the default when compiled now)
B="python3 -m ditmesh bench --steps 5 --warmup 2 --profile --ulysses-chunks 2"
rows() { grep -E '^\||^\{|bench row|wrote|Error|error' | cut -c1-700; }
if [ "${PART:-1}" = 1 ]; then
  echo "== NCCL_MIN_P2P_NCHANNELS=32"
  NCCL_MIN_P2P_NCHANNELS=32 timeout 170 torchrun --nproc_per_node 4 scripts/overlap_bench.py --single eager \
      --variants c2-graph-nofuse,c1-graph-nofuse --steps 6 2>&1 | rows
  echo "== bench 1024"
  timeout 380 $B --model flux-dev --height 1024 --width 1024 --gpus 1,2,4 --out $OUT/flux1024_gpus124.json 2>&1 | rows
else
  echo "== bench 2048"
  timeout 250 $B --model flux-dev --height 2048 --width 2048 --gpus 1,4 --steps 3 --warmup 1 \
      --out $OUT/flux2048_graph.json 2>&1 | rows
  echo "== bench wan compiled"
  timeout 300 $B --model wan2.1-14b --height 480 --width 832 --frames 81 --gpus 1,4 --steps 2 --warmup 1 \
      --methods ulysses,diffusers-ulysses --no-cuda-graph --out $OUT/wan_video_compiled.json 2>&1 | rows
fi
