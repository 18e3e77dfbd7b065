#!/usr/bin/env bash
# Time to first image of `ditmesh generate` (FLUX.1-dev architecture, 1024^2, 28 steps, --compile --cuda-graph),
# cold (compile caches emptied) and warm (the same command again), on N and 1 GPUs, for the working tree and a
# baseline tree in .old/src (`git archive <commit> src/ditmesh ':(exclude)src/ditmesh/assets' | tar -x -C .old`),
# in one call on the device machine: bash scripts/gpu.sh bash scripts/gpu_ttfi.sh [N]   (TREES="new" skips old)
set -u
SITE=/tmp/site
N=${1:-4}
M=/tmp/flux-dev
[ -f $M/model_index.json ] || { t0=$(date +%s); python3 -m ditmesh synth --arch flux-dev --out $M >/dev/null || exit 1; echo "synth $(( $(date +%s) - t0 )) s"; }
clear_caches() { rm -rf /tmp/torchinductor_* ~/.triton ~/.cache/ditmesh/compile /tmp/triton*; }
one() {  # tree gpus cold|warm
  local tree=$1 n=$2 kind=$3 src=$PWD/src deg=""
  [ "$tree" = old ] && src=$PWD/.old/src
  [ "$n" -gt 1 ] && deg="--ulysses $n"
  [ "$kind" = cold ] && clear_caches
  local tag=$tree-$n-$kind t0 t1
  t0=$(date +%s.%N)
  PYTHONPATH=$SITE:$src timeout 200 python3 -m ditmesh generate --model $M --nproc $n $deg --height 1024 --width 1024 \
    --steps 28 --compile --cuda-graph --out /tmp/o/$tag.png --report $OUT/$tag.json >/dev/null 2>$OUT/$tag.err
  local rc=$?
  t1=$(date +%s.%N)
  python3 - "$OUT/$tag.json" "$tag" "$rc" "$t0" "$t1" <<'PY'
import json, sys, os
path, tag, rc = sys.argv[1], sys.argv[2], int(sys.argv[3])
wall = float(sys.argv[5]) - float(sys.argv[4])
if rc or not os.path.exists(path):
    print(f"| {tag} | rc {rc} | {open(path.replace('.json', '.err')).read()[-300:]!r} |"); sys.exit()
r = json.load(open(path)); s = r["step_latency_s"]; med = sorted(s)[len(s) // 2]
b = r.get("compile_breakdown_s") or {}
print(f"| {tag} | {wall:.1f} | {r['load_s']:.1f} | {s[0]:.2f} | {s[0] - med:.2f} | {med * 1e3:.1f} | {r['total_latency_s']:.2f} "
      f"| {' / '.join(str(b.get(k, '')) for k in ('dynamo', 'bytecode_tracing', 'backend', 'cuda_graph_capture'))} |", flush=True)
PY
}
echo "| run | wall s (command) | load s | first step s | first-step extra s | median step ms | denoise s | dynamo / tracing / backend / capture s (rank 0) |"
echo "|---|---|---|---|---|---|---|---|"
for n in $N 1; do for tree in ${TREES:-new old}; do one $tree $n cold; one $tree $n warm; done; done
