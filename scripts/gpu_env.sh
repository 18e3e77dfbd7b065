# Sourced by the scripts/gpu_*.sh calls on the device machine: NCCL settings the machines require, $OUT,
# the carried wheels of .whl/ (diffusers and the optional peers) on PYTHONPATH, and the card's name.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site:$PWD/src
else
  export PYTHONPATH=$PWD/src
fi
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | head -1
