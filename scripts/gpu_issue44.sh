#!/usr/bin/env bash
# Issue 44's GPU rows on one GPU (H200), in parts chosen by PARTS (default: all, in this order), each skipped when
# less than its share of the call is left:
#   kernels  scripts/attention8_bench.py: the 8-bit attention candidates against cuDNN's exact kernel, FLUX's and
#            Wan's shapes, CUDA-graph and eager timing, TFLOP/s against the card's measured matmul peaks
#   flux     `ditmesh bench` FLUX.1-dev 1024², compile + CUDA graphs, one GPU: diffusers eager and compiled, the
#            torchao fp8 recipe on diffusers (peer row torchao-fp8), ditmesh with the default and the fp8 attention
#   old      the diffusers rows and ditmesh's bf16 row on the baseline tree (.old/src): the exact row unchanged?
#   quant    `ditmesh bench` as flux with fp8 linears (--quant fp8) x {default, fp8} attention (cold fp8 compiles),
#            without diffusers' rows (--no-diffusers: the flux part measured them)
#   wan      `ditmesh bench` Wan2.1-14B architecture 480x832x81, one GPU, compile + CUDA graphs, ditmesh's rows with the
#            default and the fp8 attention (--no-diffusers)
#   lin      `ditmesh bench` as flux with --quant off,fp8 through ditmesh's own fp8 layer (QUANT_BACKEND, default
#            scaled-mm) beside diffusers' rows and the torchao recipe (peer row torchao-fp8), every row profiled, each
#            row's first call (compile + capture) in its own column
#   fused    the fp8 row again with fused Q/K/V (--fuse-qkv), profiled
#   qtests   tests/gpu/test_quant_gpu.py (the 8-bit linears against their float32 emulation)
#   final    the issue's FLUX rows in one bench: diffusers eager and compiled, ditmesh bf16 and --quant fp8 (defaults)
#   wide     the fp8 row with DITMESH_FP8_WIDE_ROWS=16384 (the rounding kernels' rows reduced in one pass), profiled
#   ablate   the fp8 row with DITMESH_FP8_FAST_ACCUM=0, then with DITMESH_FP8_TUNE=0
#   wanq     Wan2.1-14B 480x832x81 exact, then --quant fp8 --attention fp8
#   peer     (last) the torchao fp8 recipe on diffusers, with the time left for its cold compile
#   tests    tests/gpu/test_attention_fp8_gpu.py (the kernel against its emulation,
#            compile and CUDA graphs)
# Before the call, once: bash scripts/gpu_issue32.sh --prepare COMMIT (the baseline tree in .old; carry .old, .whl).
# The call:  PARTS=kernels,flux,old,tests bash scripts/gpu_issue44.sh   (writes into $OUT)
set -u
OUT=${OUT:-/tmp/issue44}
mkdir -p "$OUT"
TOTAL_S=${TOTAL_S:-570}
PARTS=${PARTS:-kernels,flux,old,wan,quant,tests}
left() { echo $((TOTAL_S - SECONDS)); }
want() { [[ ",$PARTS," == *",$1,"* ]] && [ "$(left)" -gt "$2" ]; }
FLUX="--model flux-dev --height 1024 --width 1024 --gpus 1 --compile on --steps 3 --warmup 1"
if want kernels 100; then
  timeout $(( $(left) - 20 )) bash scripts/gpu.sh python3 scripts/attention8_bench.py --out "$OUT/attention8.json"
fi
if want flux 200; then
  timeout $(( $(left) - 10 )) bash scripts/gpu.sh python3 -m ditmesh bench $FLUX --methods torchao-fp8 --attention default,fp8 \
    --row-timeout 200 --out "$OUT/flux-attention.json"
fi
if want old 100 && [ -d .old/src/ditmesh ]; then
  OLD=1 timeout $(( $(left) - 10 )) bash scripts/gpu.sh python3 -m ditmesh bench $FLUX \
    --row-timeout 150 --out "$OUT/flux-old.json" 2>&1 | tail -15
fi
if want wan 200; then
  timeout $(( $(left) - 10 )) bash scripts/gpu.sh python3 -m ditmesh bench --model wan2.1-14b --height 480 --width 832 \
    --frames 81 --methods ulysses --gpus 1 --compile on --steps 2 --warmup 1 --attention default,fp8 --no-diffusers \
    --row-timeout 240 --out "$OUT/wan-attention.json"
fi
if want quant 200; then
  timeout $(( $(left) - 10 )) bash scripts/gpu.sh python3 -m ditmesh bench $FLUX --quant fp8 --attention default,fp8 \
    --methods ulysses --no-diffusers --row-timeout 280 --out "$OUT/flux-quant.json"
fi
if want lin 250; then  # fp8 linears by ditmesh's own layer beside bf16, diffusers and the torchao recipe, profiled
  timeout $(( $(left) - 10 )) bash scripts/gpu.sh python3 -m ditmesh bench $FLUX --methods torchao-fp8 --quant off,fp8 \
    --quant-backend ${QUANT_BACKEND:-scaled-mm} --profile --row-timeout 200 --out "$OUT/flux-fp8-linears.json"
fi
if want fused 90; then  # the same fp8 row with fused Q/K/V (one activation rounding, one wider product)
  timeout $(( $(left) - 10 )) bash scripts/gpu.sh python3 -m ditmesh bench $FLUX --quant fp8 --fuse-qkv --no-diffusers \
    --methods ulysses --quant-backend ${QUANT_BACKEND:-scaled-mm} --profile --row-timeout 150 \
    --out "$OUT/flux-fp8-fused.json"
fi
if want qtests 40; then
  timeout $(( $(left) - 5 )) bash scripts/gpu.sh python3 -m pytest -q -p no:cacheprovider tests/gpu/test_quant_gpu.py 2>&1 | tail -8
fi
if want final 150; then  # the issue's FLUX table: diffusers eager (the error reference) and compiled, ditmesh bf16 and fp8
  timeout $(( $(left) - 10 )) bash scripts/gpu.sh python3 -m ditmesh bench $FLUX --quant off,fp8 --profile \
    --row-timeout 150 --out "$OUT/flux-final.json"
fi
if want wide 80; then  # the fp8 row with each activation row reduced in one pass (DITMESH_FP8_WIDE_ROWS), profiled
  DITMESH_FP8_WIDE_ROWS=16384 timeout $(( $(left) - 10 )) bash scripts/gpu.sh python3 -m ditmesh bench $FLUX --quant fp8 \
    --no-diffusers --methods ulysses --profile --row-timeout 120 --out "$OUT/flux-fp8-wide-rows.json" | tail -4
fi
if want ablate 70; then  # what the fp8 layer's fast accumulation and the rounding kernels' tuning each give
  for knob in DITMESH_FP8_FAST_ACCUM DITMESH_FP8_TUNE; do
    [ "$(left)" -gt 40 ] && env $knob=0 timeout $(( $(left) - 10 )) bash scripts/gpu.sh python3 -m ditmesh bench $FLUX \
      --quant fp8 --no-diffusers --methods ulysses --row-timeout 90 --out "$OUT/flux-fp8-$knob-off.json" | tail -4
  done
fi
if want fix 100; then  # ditmesh's bf16 and fp8 rows again (after a fix), no diffusers rows
  timeout $(( $(left) - 10 )) bash scripts/gpu.sh python3 -m ditmesh bench $FLUX --quant off,fp8 --no-diffusers \
    --methods ulysses --row-timeout 100 --out "$OUT/flux-fp8-fixed.json" | tail -5
fi
WAN="--model wan2.1-14b --height 480 --width 832 --frames 81 --methods ulysses --gpus 1 --compile on --steps 2 --warmup 1"
if want wanq 220; then  # Wan2.1-14B: exact, then the fp8 attention with fp8 linears
  timeout $(( $(left) - 10 )) bash scripts/gpu.sh python3 -m ditmesh bench $WAN --no-diffusers --row-timeout 150 \
    --out "$OUT/wan-bf16.json" | tail -4
  timeout $(( $(left) - 10 )) bash scripts/gpu.sh python3 -m ditmesh bench $WAN --no-diffusers --quant fp8 \
    --attention fp8 --row-timeout 200 --out "$OUT/wan-fp8.json" | tail -4
fi
if want tests 60; then
  timeout $(( $(left) - 5 )) bash scripts/gpu.sh python3 -m pytest -q -p no:cacheprovider -x \
    tests/gpu/test_attention_fp8_gpu.py 2>&1 | tail -25
fi
if want peer 60; then  # the torchao recipe on diffusers (its cold compile: whatever time is left)
  timeout $(( $(left) - 5 )) bash scripts/gpu.sh python3 -m ditmesh bench $FLUX --methods torchao-fp8 --no-diffusers \
    --no-cuda-graph --row-timeout $(( $(left) - 25 )) --out "$OUT/flux-torchao.json" | tail -4
fi
echo "issue44: done at ${SECONDS}s"
