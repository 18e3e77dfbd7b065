#!/usr/bin/env bash
# Issue 45's GPU rows on one GPU (H200) in one call, parts in this order, each skipped when less than its share of
# the call is left (TOTAL_S, default 320):
#   e2e       scripts/e2e_bench.py: `ditmesh generate` from outside, FLUX.1-dev architecture 1024², 28 steps, compiled
#             with CUDA graphs, warm caches (a warm-up run first), beside "one import" timed in the same call; its
#             first step's breakdown and the imports' accounts (item 3)
#   lone      scripts/serve_bench.py at 1024², 28 steps, compiled with CUDA graphs, one replica, one client, 2 requests
#             a row: the lone request's phase table against 28 x step + 0.15 s (item 2), in three servers: the VAE as
#             before, --vae-tune cudnn,channels-last, and that with compile; on each, the pictures as JSON (the old
#             way, the default answer) and as the PNG file (Accept: image/png). After it, each server's first picture
#             (the same request everywhere) against the first server's, and its file against its JSON answer (the
#             same bytes?). The cuts without a switch (the pixels' hand-off, the PNG's pieces, no synchronization
#             inside the call) against the tree before them: where .old/src holds it (bash scripts/gpu_issue32.sh
#             --prepare 82ac395, carried), its server runs first (serve-lone-1024-old.json); else against the
#             2026-12-02 row of docs/timeline.md (serve-lone-h200x1: postprocess 18 ms, hand-off 15, PNG 34).
#             The phases are on the GPU's clock (CUDA events, no synchronization inside the call); step_max: the
#             slowest step, to tell where the steps' extra beyond 28 median steps goes
#   serve512  one replica without, with --max-batch 4 (measured once the service is idle after the first picture;
#             serve_bench waits for it: batching_measured_s), without and with again, at 512², 4 and 16 clients of
#             one request each: throughput, p99, the first picture after launch (item 1); the first server compiles
#             cold, the others read its compile cache, so the first pictures of the last three are the ones compared;
#             each server starts on a quiet host (serve_bench --settle)
#   batch1k   the same at 1024², with a lone client first (1,4,16; BATCH1K_CLIENTS) (item 1: the measurement should
#             leave batching off there, one picture already fills the GPU, and the first picture should come as early
#             as without --max-batch; the lone row re-checks item 2 on the default server)
#   first512  (not in the default PARTS) the first picture after launch alone at 512², five servers taking turns
#             (unbatched, batched, unbatched, batched, unbatched; one client of one request): the servers' start-up
#             varies by up to a quarter between identical servers, so item 1's first-picture bar is read over several pairs
# The model is the synthetic architecture by name (random weights built in each process: no checkpoint written).
# The call:  bash scripts/gpu.sh bash scripts/gpu_issue45.sh      (writes into $OUT)
# CPU dry run (flux-tiny, 64² and 32², 2 steps, no compile; no VAE compile):  DRY=1 bash scripts/gpu_issue45.sh
# Item 2 alone:  PARTS=lone TOTAL_S=420 bash scripts/gpu.sh bash scripts/gpu_issue45.sh   (about 5-6 minutes with the
# tree before the cuts carried in .old: four servers, the first compiling the transformer cold unless the compile
# cache is warm, the last the VAE decoder); LONE_VAE="WAYS ..." picks the --vae-tune servers (space-separated; ""
# none; default "cudnn,channels-last cudnn,channels-last,compile")
set -u
OUT=${OUT:-/tmp/issue45}
mkdir -p "$OUT"
TOTAL_S=${TOTAL_S:-320}
PARTS=${PARTS:-e2e,lone,serve512,batch1k}
left() { echo $((TOTAL_S - SECONDS)); }
want() { [[ ",$PARTS," == *",$1,"* ]] && [ "$(left)" -gt "$2" ]; }
PY=${PY:-python3}
if [ "${DRY:-0}" = 1 ]; then
  MODEL=flux-tiny FAST="" BIG="--height 64 --width 64 --steps 2" SMALL="--height 32 --width 32 --steps 2"
  E2E="--cpu-dry-run"
  VAE_WAYS=${LONE_VAE-cudnn,channels-last}
  SETTLE=${SETTLE:-0}
else
  SETTLE=${SETTLE:-30}  # each server starts on a quiet host (serve_bench --settle): the last one's processes gone
  MODEL=flux-dev FAST="--compile --cuda-graph" BIG="--height 1024 --width 1024 --steps 28"
  SMALL="--height 512 --width 512 --steps 28"
  E2E="--model flux-dev --gpus 1 --height 1024 --width 1024 --steps 28 --compile --cuda-graph"
  VAE_WAYS=${LONE_VAE-cudnn,channels-last cudnn,channels-last,compile}
fi
if want e2e 100; then
  # shellcheck disable=SC2086
  timeout $(( $(left) - 10 )) $PY scripts/e2e_bench.py $E2E --rows new:1gpu:warm --deadline-s $(( $(left) - 20 )) \
    --out "$OUT/e2e" 2>&1 | tail -40
fi
serve() {  # serve NAME "SHAPE" CLIENTS REQUESTS LAYOUT...
  local name=$1 shape=$2 clients=$3 requests=$4
  shift 4
  local layouts=()
  for l in "$@"; do layouts+=(--layout "$l"); done
  # shellcheck disable=SC2086
  timeout $(( $(left) - 5 )) $PY scripts/serve_bench.py --model "$MODEL" "${layouts[@]}" --clients "$clients" \
    --requests-per-client "$requests" --settle "$SETTLE" --deadline $(( $(left) - 15 )) --json "$OUT/$name.json" --logs "$OUT/$name-logs" \
    $FAST $shape ${EXTRA:-} 2>&1 | grep -v "^\[serve_bench" | tail -30
  grep -ho "batching[^(]*([^)]*)" "$OUT/$name-logs"/*.log
}
if want lone 150; then
  if [ -d .old/src/ditmesh ]; then  # the tree before the cuts, where given (scripts/gpu_issue32.sh --prepare COMMIT;
    # carry .old): its server, the JSON answer only (the same machine, the same call)
    PYTHONPATH=${PYTHONPATH//$PWD\/src/$PWD\/.old\/src} EXTRA="" serve serve-lone-1024-old "$BIG" 1 2 "--nproc 1"
  fi
  lone=("--nproc 1")
  for ways in $VAE_WAYS; do lone+=("--nproc 1 --vae-tune $ways"); done
  EXTRA="--answer json,png" serve serve-lone-1024 "$BIG" 1 2 "${lone[@]}"
  $PY - "$OUT/serve-lone-1024.json" "$OUT/serve-lone-1024-old.json" <<'PYEOF'
import json, os, sys
layouts = json.load(open(sys.argv[1]))["layouts"]
first = layouts[0].get("first_sha256")
if os.path.exists(sys.argv[2]):  # the tree before the cuts: the same request's picture, byte for byte?
    old = json.load(open(sys.argv[2]))["layouts"][0].get("first_sha256")
    print(f"lone: the tree before the cuts drew {'the same' if old == first else 'a DIFFERENT'} first picture")
for lay in layouts:
    print(f"lone [{lay['layout']}]: first picture {'the same' if lay.get('first_sha256') == first else 'DIFFERENT'} as "
          f"[{layouts[0]['layout']}]'s; its file as its JSON answer's: {lay.get('first_png_same_as_json')}; "
          f"error: {lay.get('error')}")
PYEOF
fi
# unbatched (it compiles cold), batched, unbatched again (and at 512² batched again): the first pictures of the
# servers after the first are compared (they read the compile cache the first filled)
want serve512 100 && serve serve-512 "$SMALL" 4,16 1 "--nproc 1" "--nproc 1 --max-batch 4" "--nproc 1" \
  "--nproc 1 --max-batch 4"
want batch1k 150 && serve serve-batch-1024 "$BIG" ${BATCH1K_CLIENTS:-1,4,16} 1 "--nproc 1" "--nproc 1 --max-batch 4" \
  "--nproc 1"
# the first picture alone, servers taking turns (one client, one request each): unbatched, batched, ... at 512²
want first512 90 && serve serve-first-512 "$SMALL" 1 1 "--nproc 1" "--nproc 1 --max-batch 4" "--nproc 1" \
  "--nproc 1 --max-batch 4" "--nproc 1"
echo "issue45: done at ${SECONDS}s"
