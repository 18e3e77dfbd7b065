"""The 8-bit attention candidates, kernel by kernel, on one GPU: speed (median ms and TFLOP/s against the card's
measured matmul peaks) and error against float32 attention on the same inputs.

Rows, at FLUX.1-dev 1024² (24 heads x 4,608 tokens x 128), Wan2.1-14B 480x832x81 on one GPU (40 x 32,760 x 128)
and one ulysses-4 rank of it (10 heads):

* ``exact (cuDNN bf16)``: torch's SDPA with its cuDNN backend, what the default attention runs;
* ``fp8 cuDNN``: ``attention="fp8"`` (``ditmesh.attention.fp8``), the kernel alone on quantized inputs, and with its
  quantization (compiled, as a compiled model runs it);
* ``fp8 Triton (candidate)``: a Triton kernel written here, Q and K in fp8 per token and head, P and V in fp8 (V per
  channel, stored transposed), to see whether a kernel of our own beats cuDNN's; kept out of the library unless it
  wins;
* ``int8 (ours)``: the retired ``attention="int8"`` (Q, K int8 per token, P V in bf16; its rows in the results came
  from the commits before it was retired, 1.6-3.2x slower than the exact kernel);
* ``SageAttention 1.0.6``: the PyPI wheel's Triton kernel (a peer), when installed.

Inputs: q, v ~ N(0, 1), k ~ N(0, 1) plus a per-channel offset ~ N(0, 2) (real K carries one), bf16. The error is
``||out - ref|| / ||ref||`` against float32 SDPA on the same bf16 values. FLOPs: ``4 B H S_q S_k D``.

    bash scripts/gpu.sh python3 scripts/attention8_bench.py --out "$OUT/attention8.json"
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

SHAPES = {
    "flux-1024": (1, 4608, 24, 128),
    "wan-480p-1gpu": (1, 32760, 40, 128),
    "wan-480p-ulysses4-rank": (1, 32760, 10, 128),
}


def bench(fn, warmup: int = 3, reps: int = 10, graph: bool = False) -> float:
    """Median ms of ``fn()`` over ``reps`` calls after ``warmup``, timed with CUDA events; ``graph``: ``fn`` captured
    once in a CUDA graph and the replays timed (no host launch cost, as a model under ``--cuda-graph`` runs it)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    call = fn
    if graph:
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            fn()
        torch.cuda.synchronize()
        call = g.replay
        call()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        call()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b))
    times.sort()
    return times[len(times) // 2]


def matmul_peaks() -> dict:
    """The card's measured TFLOP/s: an 8192³ bf16 matmul and an 8192³ fp8 ``_scaled_mm`` (row-wise scales)."""
    n = 8192
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    out = {"bf16": 2 * n ** 3 / bench(lambda: a @ b) / 1e9}
    a8, b8 = a.to(torch.float8_e4m3fn), b.t().contiguous().to(torch.float8_e4m3fn).t()
    one = torch.ones((), device="cuda")
    try:
        out["fp8"] = 2 * n ** 3 / bench(lambda: torch._scaled_mm(a8, b8, one, one, out_dtype=torch.bfloat16)) / 1e9
    except Exception as err:  # noqa: BLE001
        out["fp8_error"] = str(err)[:200]
    return out


# ---- the Triton fp8 candidate -------------------------------------------------------------------------------------

def triton_candidate():
    import triton
    import triton.language as tl

    configs = [triton.Config({"BLOCK_M": bm, "BLOCK_N": bn}, num_warps=w, num_stages=s)
               for bm, bn, w, s in ((128, 128, 8, 3), (128, 64, 4, 3), (128, 128, 8, 4), (64, 128, 4, 3),
                                    (128, 64, 8, 4))]

    @triton.autotune(configs=configs, key=["SQ", "SK", "D"])
    @triton.jit
    def kernel(Q, QS, K, KS, VT, VS, O, H, SQ, SK, SKP, sm_scale_log2,
               D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
        start_m = tl.program_id(0)
        bh = tl.program_id(1)
        rows = start_m * BLOCK_M + tl.arange(0, BLOCK_M)
        dims = tl.arange(0, D)
        cols0 = tl.arange(0, BLOCK_N)
        row_ok = rows < SQ
        q = tl.load(Q + bh * SQ * D + rows[:, None] * D + dims[None, :], mask=row_ok[:, None], other=0.0)
        qs = tl.load(QS + bh * SQ + rows, mask=row_ok, other=0.0) * sm_scale_log2
        m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, D], dtype=tl.float32)
        for start_n in range(0, SK, BLOCK_N):
            cols = start_n + cols0
            col_ok = cols < SK
            k = tl.load(K + bh * SK * D + cols[:, None] * D + dims[None, :], mask=col_ok[:, None], other=0.0)
            ks = tl.load(KS + bh * SK + cols, mask=col_ok, other=0.0)
            s = tl.dot(q, tl.trans(k)) * qs[:, None] * ks[None, :]
            s = tl.where(col_ok[None, :], s, -1.0e30)
            m_new = tl.maximum(m_i, tl.max(s, 1))
            p = tl.math.exp2(s - m_new[:, None])
            alpha = tl.math.exp2(m_i - m_new)
            l_i = l_i * alpha + tl.sum(p, 1)
            vt = tl.load(VT + bh * D * SKP + dims[:, None] * SKP + cols[None, :], mask=col_ok[None, :], other=0.0)
            acc = acc * alpha[:, None] + tl.dot((p * 256.0).to(tl.float8e4nv), tl.trans(vt))
            m_i = m_new
        vs = tl.load(VS + bh * D + dims)
        acc = acc * vs[None, :] / (256.0 * l_i[:, None])
        tl.store(O + bh * SQ * D + rows[:, None] * D + dims[None, :], acc.to(O.dtype.element_ty),
                 mask=row_ok[:, None])

    def quantize(q, k, v):
        """[B, S, H, D] -> per-token Q, K (K smoothed), per-channel V stored [B, H, D, S]; all [B*H, ...]."""
        b, s, h, d = q.shape
        qh, kh, vh = (t.transpose(1, 2).float() for t in (q, k, v))  # [B, H, S, D]
        kh = kh - kh.mean(2, keepdim=True)
        qs = qh.abs().amax(-1).clamp(min=1e-12) / 448
        ks = kh.abs().amax(-1).clamp(min=1e-12) / 448
        vs = vh.abs().amax(2).clamp(min=1e-12) / 448  # [B, H, D]
        q8 = (qh / qs[..., None]).to(torch.float8_e4m3fn).contiguous()
        k8 = (kh / ks[..., None]).to(torch.float8_e4m3fn).contiguous()
        pad = -s % 128  # V^T's rows start 128-byte aligned (32,760 keys would misalign every row's loads)
        vt8 = F.pad((vh / vs[:, :, None, :]).transpose(2, 3), (0, pad)).to(torch.float8_e4m3fn).contiguous()
        return q8, qs.contiguous(), k8, ks.contiguous(), vt8, vs.contiguous()

    def run(q8, qs, k8, ks, vt8, vs, out_shape, scale):
        b, h, s_q, d = q8.shape
        out = torch.empty(b, h, s_q, d, dtype=torch.bfloat16, device=q8.device)
        grid = lambda meta: (triton.cdiv(s_q, meta["BLOCK_M"]), b * h)  # noqa: E731
        kernel[grid](q8, qs, k8, ks, vt8, vs, out, h, s_q, k8.shape[2], vt8.shape[-1], scale * math.log2(math.e), D=d)
        return out.transpose(1, 2)

    return quantize, run


# ---- rows ---------------------------------------------------------------------------------------------------------

def inputs(shape, seed=0):
    b, s, h, d = shape
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(b, s, h, d, device="cuda", generator=g).to(torch.bfloat16)
    k = (torch.randn(b, s, h, d, device="cuda", generator=g)
         + 2 * torch.randn(1, 1, h, d, device="cuda", generator=g)).to(torch.bfloat16)
    v = torch.randn(b, s, h, d, device="cuda", generator=g).to(torch.bfloat16)
    return q, k, v


def sdpa(q, k, v, backend=None):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    args = [t.transpose(1, 2) for t in (q, k, v)]
    if backend is None:
        return F.scaled_dot_product_attention(*args).transpose(1, 2)
    with sdpa_kernel([getattr(SDPBackend, backend)]):
        return F.scaled_dot_product_attention(*args).transpose(1, 2)


def reference(q, k, v):
    """float32 SDPA, a few heads at a time."""
    out = torch.empty(q.shape, dtype=torch.float32, device=q.device)
    step = 4
    for h in range(0, q.shape[2], step):
        sl = slice(h, h + step)
        out[:, :, sl] = sdpa(q[:, :, sl].float(), k[:, :, sl].float(), v[:, :, sl].float())
    return out


def rel(out, ref):
    return float((out.float() - ref).norm() / ref.norm())


def rows_for(name, shape, peaks, results):
    b, s, h, d = shape
    flops = 4 * b * h * s * s * d
    q, k, v = inputs(shape)
    ref = reference(q, k, v)
    torch.cuda.empty_cache()

    def add(row, fn, part="kernel+quantize", err_of=None):
        try:
            eager_ms = bench(fn)
            ms = bench(fn, graph=True)
            out = (err_of or fn)()
            out = out[0] if isinstance(out, tuple) else out
            err = rel(out, ref)
            tf = flops / ms / 1e9
            results.append({"shape": name, "row": row, "part": part, "ms": round(ms, 4), "eager_ms": round(eager_ms, 4),
                            "tflops": round(tf, 1),
                            "of_bf16_peak": round(tf / peaks["bf16"], 3),
                            "of_fp8_peak": round(tf / peaks["fp8"], 3) if "fp8" in peaks else None,
                            "rel_err": round(err, 5)})
            print(f"{name:24s} {row:28s} {part:16s} {ms:8.3f} ms (eager {eager_ms:7.3f}) {tf:7.1f} TFLOP/s  "
                  f"err {err:.4f}", flush=True)
        except Exception as err:  # noqa: BLE001
            results.append({"shape": name, "row": row, "part": part, "error": f"{type(err).__name__}: {err}"[:400]})
            print(f"{name:24s} {row:28s} {part:16s} FAILED {type(err).__name__}: {str(err)[:300]}", flush=True)
        torch.cuda.empty_cache()

    add("exact (cuDNN bf16)", lambda: sdpa(q, k, v, "CUDNN_ATTENTION"), "kernel")
    add("exact (flash bf16)", lambda: sdpa(q, k, v, "FLASH_ATTENTION"), "kernel")

    from ditmesh.attention import fp8 as fp8mod
    scale = 1 / math.sqrt(d)
    try:
        from ditmesh.attention.fp8_cudnn import fp8_sdpa
        q8, k8, v8, sc = fp8mod.quantize(q, k, v)
        add("fp8 cuDNN (ours)", lambda: fp8_sdpa(q8, k8, v8, sc, scale, torch.bfloat16), "kernel")
        quant = torch.compile(fp8mod.quantize)
        add("fp8 cuDNN (ours)", lambda: fp8_sdpa(*quant(q, k, v), scale, torch.bfloat16), "kernel+quantize")
        if s <= 8192:
            emu = fp8mod.emulated_attention(q, k, v)
            cud = fp8_sdpa(q8, k8, v8, sc, scale, torch.bfloat16)[0]
            results.append({"shape": name, "row": "fp8 cuDNN vs its emulation", "rel_err": round(rel(cud, emu.float()), 5)})
            print(f"{name:24s} fp8 cuDNN vs emulation: {rel(cud, emu.float()):.5f}", flush=True)
    except Exception as err:  # noqa: BLE001
        results.append({"shape": name, "row": "fp8 cuDNN (ours)", "error": f"{type(err).__name__}: {err}"[:600]})
        print(f"{name} fp8 cuDNN FAILED: {type(err).__name__}: {str(err)[:600]}", flush=True)
    try:
        tq, trun = triton_candidate()
        packed = tq(q, k, v)
        add("fp8 Triton (candidate)", lambda: trun(*packed, q.shape, scale), "kernel")
        tqc = torch.compile(tq)
        add("fp8 Triton (candidate)", lambda: trun(*tqc(q, k, v), q.shape, scale), "kernel+quantize")
    except Exception as err:  # noqa: BLE001
        results.append({"shape": name, "row": "fp8 Triton (candidate)", "error": f"{type(err).__name__}: {err}"[:600]})
        print(f"{name} fp8 Triton FAILED: {type(err).__name__}: {str(err)[:600]}", flush=True)
    try:
        from sageattention import sageattn
        add("SageAttention 1.0.6 (peer)", lambda: sageattn(q, k, v, tensor_layout="NHD", is_causal=False),
            "kernel+quantize")
    except Exception as err:  # noqa: BLE001
        results.append({"shape": name, "row": "SageAttention 1.0.6 (peer)", "error": f"{type(err).__name__}: {err}"[:300]})
        print(f"{name} sage FAILED: {type(err).__name__}: {str(err)[:300]}", flush=True)


def graph_check(results):
    """``attention="fp8"``'s path compiled and captured in a CUDA graph gives the eager numbers."""
    from ditmesh.attention.fp8 import fp8_attention

    q, k, v = inputs((2, 1000, 6, 128), seed=1)
    eager = fp8_attention(q, k, v)
    compiled = torch.compile(fp8_attention, fullgraph=True)
    first = compiled(q, k, v)
    static = [t.clone() for t in (q, k, v)]
    graph = torch.cuda.CUDAGraph()
    compiled(*static)
    torch.cuda.synchronize()
    with torch.cuda.graph(graph):
        out = compiled(*static)
    q2, k2, v2 = inputs((2, 1000, 6, 128), seed=2)
    for s, t in zip(static, (q2, k2, v2)):
        s.copy_(t)
    graph.replay()
    torch.cuda.synchronize()
    ref2 = fp8_attention(q2, k2, v2)
    row = {"row": "fp8 under compile and CUDA graph", "compiled_vs_eager": rel(first, eager.float()),
           "graph_replay_vs_eager": rel(out, ref2.float())}
    results.append(row)
    print(row, flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--shapes", default=",".join(SHAPES))
    args = parser.parse_args()
    t0 = time.time()
    peaks = matmul_peaks()
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, peaks {peaks}", flush=True)
    results: list = []
    try:
        import cudnn
        backend = cudnn.backend_version_string()
    except Exception as err:  # noqa: BLE001
        backend = f"unavailable: {err}"
    meta = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "cudnn_backend": backend,
            "peaks_tflops": peaks, "command": " ".join(sys.argv)}
    print(meta, flush=True)
    try:
        graph_check(results)
    except Exception as err:  # noqa: BLE001
        results.append({"row": "fp8 under compile and CUDA graph", "error": f"{type(err).__name__}: {err}"[:600]})
        print(f"graph check FAILED: {type(err).__name__}: {str(err)[:600]}", flush=True)
    for name in args.shapes.split(","):
        rows_for(name, SHAPES[name], peaks, results)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"meta": meta, "rows": results}, indent=1))
    print(f"done in {time.time() - t0:.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
