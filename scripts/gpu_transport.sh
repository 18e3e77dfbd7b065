# scripts/transport_bench.py on every GPU of the machine: FLUX 1024^2 Q/K/V and K/V per layer at x2 (2304
# tokens per rank) and x4 (1152). Each torchrun is bounded so a hang cannot eat the call.
source scripts/gpu_env.sh
N=$(nvidia-smi -L | wc -l)
for args in "--tokens 2304" "--tokens 2304 --tensors 2" "--tokens 1152"; do
  timeout 100 torchrun --nproc_per_node $N scripts/transport_bench.py $args --iters 30 2>&1 | grep --line-buffered '^{\|^\[transport\|Error'
done
