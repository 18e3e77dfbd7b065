#!/usr/bin/env bash
# generate on 1 and 2 GPUs (flux-dev synthetic, 1024x1024, bf16, 28 steps) and compare final latents.
set -u
source scripts/gpu_env.sh
M=/tmp/flux-dev
[ -f $M/model_index.json ] || python3 -m ditmesh synth --arch flux-dev --out $M 2>&1 | tail -1
for n in 1 2; do
  deg=""; [ "$n" -gt 1 ] && deg="--ulysses $n"
  python3 -m ditmesh generate --model $M --nproc $n $deg --height 1024 --width 1024 --steps 28 \
    --out $OUT/gen$n.png --report $OUT/gen$n.json --save-latents $OUT/lat$n.safetensors 2>&1 | grep -v "it/s]" | tail -3
done
python3 - <<'PY'
import json, os
from safetensors.torch import load_file
out = os.environ["OUT"]
ref = load_file(f"{out}/lat1.safetensors")["latents"]
for n in (1, 2):
    r = json.load(open(f"{out}/gen{n}.json")); lat = load_file(f"{out}/lat{n}.safetensors")["latents"]
    s = sorted(r["step_latency_s"])
    print(f"| {n} | {r['total_latency_s']:.2f} | {s[len(s)//2]*1e3:.1f} | {max(r['peak_memory_bytes'])/2**30:.2f} | {float((lat-ref).norm()/ref.norm()):.2e} | {r['devices'][0]} |")
print(r["versions"])
PY
