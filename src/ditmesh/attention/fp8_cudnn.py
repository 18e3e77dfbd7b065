"""cuDNN's fused fp8 attention for ``attention="fp8"`` (:mod:`ditmesh.attention.fp8` says what it computes).

Through cuDNN's frontend (the ``nvidia-cudnn-frontend`` wheel, ``pip install 'ditmesh[fp8]'``): one graph per shape,
built on first use and kept, with Q, K, V in ``float8_e4m3fn`` read in place in ditmesh's ``[B, S, H, D]`` layout,
P scaled by :data:`~ditmesh.attention.fp8.P_SCALE` before its rounding, the output written in fp8 against V's scale
(cuDNN 9.19 builds no bf16 output for fp8 inputs on Hopper) and multiplied back into the model's dtype, and the
softmax statistics (log-sum-exp) beside it. cuDNN takes one descale per tensor and call, so each sample of a batch
is one call with its own scales (read from the device: no host sync). Blackwell's fp8 kernels take head dims up to
128 only; a larger one fails when the graph is built, with cuDNN's message.

The call is a torch custom op (``ditmesh::fp8_sdpa``) with a shape-only fake, so ``torch.compile`` keeps it whole
in the graph, and it runs on the current stream, so a CUDA graph captures it (its graph is built in the normal call
that precedes every capture). Imported only when the fp8 attention runs.
"""

from __future__ import annotations

import torch

from .fp8 import P_SCALE

_Q, _K, _V, _O, _STATS, _DQ, _DK, _DV, _DS, _SS, _SO, _AMAX_S, _AMAX_O = range(1, 14)

_HANDLES: dict = {}
_GRAPHS: dict = {}


def _cudnn():
    try:
        import cudnn
    except ImportError as err:
        raise RuntimeError("attention=fp8 runs cuDNN's fp8 attention through its frontend, which is not installed "
                           "here; pip install 'ditmesh[fp8]' (nvidia-cudnn-frontend), or use the default "
                           f"attention ({err})") from None
    return cudnn


def _handle(device: torch.device):
    cudnn = _cudnn()
    index = device.index if device.index is not None else torch.cuda.current_device()
    handle = _HANDLES.get(index)
    if handle is None:
        with torch.cuda.device(index):
            handle = _HANDLES[index] = cudnn.create_handle()
    return handle


def _dims(t: torch.Tensor) -> tuple[tuple, tuple]:
    """``t`` ``[1, S, H, D]`` as cuDNN's ``(b, h, s, d)`` dims and strides."""
    b, s, h, d = t.shape
    return (b, h, s, d), (t.stride(0), t.stride(2), t.stride(1), t.stride(3))


def _graph(q8, k8, v8, scale: float):
    """The built graph of one sample's call and its workspace size."""
    key = (q8.shape, k8.shape, q8.stride(), k8.stride(), v8.stride(), float(scale), q8.device)
    hit = _GRAPHS.get(key)
    if hit is not None:
        return hit
    cudnn = _cudnn()
    handle = _handle(q8.device)
    graph = cudnn.pygraph(io_data_type=cudnn.data_type.FP8_E4M3, intermediate_data_type=cudnn.data_type.FLOAT,
                          compute_data_type=cudnn.data_type.FLOAT, handle=handle)
    tensors = {}
    for uid, t in ((_Q, q8), (_K, k8), (_V, v8)):
        dim, stride = _dims(t)
        tensors[uid] = graph.tensor(uid=uid, dim=dim, stride=stride, data_type=cudnn.data_type.FP8_E4M3)
    scalar = dict(dim=(1, 1, 1, 1), stride=(1, 1, 1, 1), data_type=cudnn.data_type.FLOAT)
    for uid in (_DQ, _DK, _DV, _DS, _SS, _SO):
        tensors[uid] = graph.tensor(uid=uid, **scalar)
    o, stats, amax_s, amax_o = graph.sdpa_fp8(
        q=tensors[_Q], k=tensors[_K], v=tensors[_V], descale_q=tensors[_DQ], descale_k=tensors[_DK],
        descale_v=tensors[_DV], descale_s=tensors[_DS], scale_s=tensors[_SS], scale_o=tensors[_SO],
        generate_stats=True, attn_scale=float(scale), use_causal_mask=False)
    dim, _ = _dims(q8)
    b, h, s, d = dim
    o.set_uid(_O).set_output(True).set_dim(dim).set_stride((s * h * d, d, h * d, 1)).set_data_type(
        cudnn.data_type.FP8_E4M3)
    stats.set_uid(_STATS).set_output(True).set_dim((b, h, s, 1)).set_stride((h * s, s, 1, 1)).set_data_type(
        cudnn.data_type.FLOAT)
    for t, uid in ((amax_s, _AMAX_S), (amax_o, _AMAX_O)):
        t.set_uid(uid).set_output(True).set_dim((1, 1, 1, 1)).set_stride((1, 1, 1, 1)).set_data_type(
            cudnn.data_type.FLOAT)
    try:
        graph.validate()
        graph.build_operation_graph()
        graph.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
        graph.check_support()
        graph.build_plans()
    except Exception as err:  # cuDNN says why in its own words
        raise RuntimeError(f"cuDNN built no fp8 attention for q {tuple(q8.shape)}, k {tuple(k8.shape)}: {err}") from None
    hit = _GRAPHS[key] = (graph, graph.get_workspace_size())
    return hit


_CONSTS: dict = {}


def _consts(device: torch.device) -> torch.Tensor:
    """``[P_SCALE, 1 / P_SCALE, 1]`` on ``device``, made once (in the normal call before any graph capture: a
    host-to-device copy cannot be captured)."""
    consts = _CONSTS.get(device)
    if consts is None:
        consts = _CONSTS[device] = torch.tensor([P_SCALE, 1.0 / P_SCALE, 1.0], dtype=torch.float32, device=device)
    return consts


def _run(q8, k8, v8, scales, scale: float, out_dtype: torch.dtype):
    b, s_q, h, d = q8.shape
    out = torch.empty(b, s_q, h, d, dtype=out_dtype, device=q8.device)
    lse = torch.empty(b, h, s_q, dtype=torch.float32, device=q8.device)
    cudnn = _cudnn()
    handle = _handle(q8.device)
    cudnn.set_stream(handle=handle, stream=torch.cuda.current_stream(q8.device).cuda_stream)
    consts = _consts(q8.device)
    for i in range(b):
        q, k, v = q8[i:i + 1], k8[i:i + 1], v8[i:i + 1]
        graph, workspace_size = _graph(q, k, v, scale)
        # fp8 output: O <= max|V| = 448 * sv, so O / sv fits e4m3, and is multiplied back below
        o = torch.empty(1, s_q, h, d, dtype=torch.float8_e4m3fn, device=q8.device)
        scale_o = 1.0 / scales[2, i:i + 1]
        stats = lse[i:i + 1].unsqueeze(-1)
        workspace = torch.empty(max(workspace_size, 1), dtype=torch.uint8, device=q8.device)
        amax = torch.empty(2, dtype=torch.float32, device=q8.device)
        graph.execute({_Q: q, _K: k, _V: v, _O: o, _STATS: stats, _DQ: scales[0, i:i + 1], _DK: scales[1, i:i + 1],
                       _DV: scales[2, i:i + 1], _SS: consts[0:1], _DS: consts[1:2], _SO: scale_o,
                       _AMAX_S: amax[0:1], _AMAX_O: amax[1:2]}, workspace, handle=handle)
        out[i:i + 1] = (o.float() * scales[2, i]).to(out_dtype)
    return out, lse


@torch.library.custom_op("ditmesh::fp8_sdpa", mutates_args=())
def fp8_sdpa(q8: torch.Tensor, k8: torch.Tensor, v8: torch.Tensor, scales: torch.Tensor, scale: float,
             out_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cuDNN's fp8 attention on ``q8``, ``k8``, ``v8`` ``[B, S, H, D]`` (``float8_e4m3fn``) with descales ``scales``
    ``[3, B]`` (Q, K, V): ``(out [B, S_q, H, D] in out_dtype, lse [B, H, S_q] float32)``."""
    return _run(q8, k8, v8, scales, scale, out_dtype)


@fp8_sdpa.register_fake
def _(q8, k8, v8, scales, scale, out_dtype):
    b, s_q, h, d = q8.shape
    return q8.new_empty((b, s_q, h, d), dtype=out_dtype), q8.new_empty((b, h, s_q), dtype=torch.float32)


def attention(q8, k8, v8, scales, scale: float, out_dtype: torch.dtype):
    """:func:`fp8_sdpa` on contiguous fp8 tensors."""
    q8, k8, v8 = (t if t.stride(-1) == 1 else t.contiguous() for t in (q8, k8, v8))
    return fp8_sdpa(q8, k8, v8, scales.contiguous(), float(scale), out_dtype)
