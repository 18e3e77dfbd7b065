#!/usr/bin/env bash
# Runs one command on the GPU device machine with what its GPUs need:
# - NVLink multicast off for NCCL, torch's symmetric memory and NVSHMEM (the lent machines require it: their GPUs
#   are shared, and multicast can put them out of service);
# - the wheels carried in .whl/ (the optional peers: xfuser, yunchang, distvae) installed to /tmp/site and put on
#   PYTHONPATH ahead of src/, so the command runs this checkout's ditmesh;
# - the card's name, driver and GPU count printed first;
# - OLD=1: the baseline tree in .old/src instead of this checkout's src.
# Usage (in the checkout's root): bash scripts/gpu.sh python3 -m ditmesh bench --out "$OUT/run.json" ...
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
SRC=$PWD/src
[ "${OLD:-0}" = 1 ] && SRC=$PWD/.old/src  # OLD=1: the baseline tree (scripts/gpu_issue32.sh --prepare)
if [ -d .whl ]; then
  [ -d /tmp/site/diffusers ] || python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site:$SRC
else
  export PYTHONPATH=$SRC
fi
echo "$(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | head -1), $(nvidia-smi -L | wc -l) GPUs"
exec "$@"
