#!/usr/bin/env bash
# One GPU call: synthesize flux-dev, run `generate` on 1/2/4 GPUs at 1024x1024 bf16, then `bench` at
# 1024 and 2048. Usage on the device machine: bash scripts/gpu_verify.sh  (writes under $OUT).
set -u
source scripts/gpu_env.sh
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch, diffusers; print('torch', torch.__version__, 'diffusers', diffusers.__version__, 'gpus', torch.cuda.device_count())"
NG=$(python3 -c "import torch; print(torch.cuda.device_count())")
M=/tmp/flux-dev
t0=$(date +%s); python3 -m ditmesh synth --arch flux-dev --out $M || exit 1; echo "synth: $(( $(date +%s) - t0 )) s"
for n in 1 2 4; do
  [ "$n" -le "$NG" ] || continue
  deg=""; [ "$n" -gt 1 ] && deg="--ulysses $n"
  timeout 240 python3 -m ditmesh generate --model $M --nproc $n $deg --height 1024 --width 1024 --steps 28 \
    --out $OUT/gen$n.png --report $OUT/gen$n.json --save-latents /tmp/lat$n.safetensors 2>&1 | grep -v "it/s]" | tail -3
done
python3 - <<'PY'
import json, os, torch
from safetensors.torch import load_file
out = os.environ.get("OUT", "/tmp/out")
ref = load_file("/tmp/lat1.safetensors")["latents"]
print("| gpus | config | total s (28 steps) | median step s | peak GiB per GPU | rel err vs 1 GPU |")
print("|---|---|---|---|---|---|")
for n in (1, 2, 4):
    p = f"{out}/gen{n}.json"
    if not os.path.exists(p): continue
    r = json.load(open(p)); lat = load_file(f"/tmp/lat{n}.safetensors")["latents"]
    steps = sorted(r["step_latency_s"]); med = steps[len(steps)//2]
    print(f"| {n} | ulysses{n} | {r['total_latency_s']:.2f} | {med:.4f} | {max(r['peak_memory_bytes'])/2**30:.2f} | {float((lat-ref).norm()/ref.norm()):.2e} |")
print(json.load(open(f"{out}/gen1.json"))["devices"][0], json.load(open(f"{out}/gen1.json"))["versions"])
PY
G=$(python3 -c "print(','.join(str(g) for g in (1,2,4) if g <= $NG))")
timeout 200 python3 -m ditmesh bench --model flux-dev --gpus $G --methods ulysses --height 1024 --width 1024 --out $OUT/bench1024.json 2>&1 | grep "^|"
timeout 200 python3 -m ditmesh bench --model flux-dev --gpus $G --methods ulysses --height 2048 --width 2048 --out $OUT/bench2048.json 2>&1 | grep "^|"
