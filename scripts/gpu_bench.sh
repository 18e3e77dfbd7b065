#!/usr/bin/env bash
# GPU benchmark calls (one `run` each). PART=1: FLUX.1-dev 1024^2, every method eager + the key ones compiled.
# PART=2: 2048^2, tensor-parallel memory via generate (sharded loading), SD3.5-Large batched CFG.
set -u
source scripts/gpu_env.sh
B="python3 -m ditmesh bench --steps 5 --warmup 2"
run() { echo "== $*"; timeout "$1" "${@:2}" 2>&1 | grep -E "^\||wrote|Error|error" ; }
if [ "${PART:-1}" = 1 ]; then
  run 330 $B --model flux-dev --height 1024 --width 1024 --gpus 1,2,4 \
      --methods ulysses,ring,usp,tp,tp-ulysses,diffusers-ulysses,diffusers-ring --out $OUT/flux1024_eager.json
  run 240 $B --model flux-dev --height 1024 --width 1024 --gpus 1,4 --compile on \
      --methods ulysses,diffusers-ulysses --out $OUT/flux1024_compiled.json
else
  M=/tmp/flux-dev; python3 -m ditmesh synth --arch flux-dev --out $M 2>&1 | tail -1
  for cfg in "1" "2 --tp 2" "4 --tp 4" "4 --tp 2 --ulysses 2"; do
    tag=$(echo "$cfg" | tr -d ' -')
    timeout 120 python3 -m ditmesh generate --model $M --nproc $cfg --height 1024 --width 1024 --steps 28 \
      --out $OUT/tp_$tag.png --report $OUT/tp_$tag.json 2>&1 | grep -E "wrote|error"
  done
  python3 - <<'PY'
import glob, json, os
for p in sorted(glob.glob(os.environ["OUT"] + "/tp_*.json")):
    r = json.load(open(p)); s = sorted(r["step_latency_s"])
    print(f"| {r['config']} | {s[len(s)//2]*1e3:.1f} ms | peak {[round(m/2**30,2) for m in r['peak_memory_bytes']]} | load peak {[round(m/2**30,2) for m in r.get('load_peak_memory_bytes', [])]} |")
PY
  rm -rf $M
  run 130 $B --model sd3.5-large --height 1024 --width 1024 --batch 2 --gpus 1,2,4 --methods cfg,ulysses \
      --out $OUT/sd35_cfg.json
  run 110 $B --model flux-dev --height 2048 --width 2048 --gpus 1,4 --methods ulysses,usp,tp,diffusers-ulysses \
      --out $OUT/flux2048_eager.json
  run 100 $B --model wan2.1-14b --height 480 --width 832 --frames 81 --gpus 1,4 --steps 3 --warmup 1 \
      --methods ulysses,diffusers-ulysses --out $OUT/wan_video.json
fi
