"""8-bit attention in float8 (``attention="fp8"``): Q, K, V and the probabilities P in ``float8_e4m3fn``, on cuDNN's
fused fp8 attention (Hopper and newer), with its rounding defined here and computed in float32 math on any device
(``attention="fp8-emulated"``).

The rounding, for ``q``, ``k``, ``v`` ``[B, S, H, D]``:

* K is smoothed: its mean over the keys (per sample, head and channel, summed in float64) is subtracted. Softmax does
  not change when every score of a query moves by the same amount, and the channel offset that real K carries no
  longer takes the fp8 range.
* Each tensor has one scale per sample, a power of two: ``2^ceil(log2(amax / 448))`` with ``amax`` over the sample's
  tokens, heads and channels, so its largest value lands in ``(224, 448]`` (e4m3's largest is 448) and the descale is
  exact. Under Ulysses and tp a rank holds every token of some heads, so the amax is reduced (MAX) over the ranks of
  both axes (:func:`sample_scales`' ``group``): every rank then takes one process's scales, whichever heads it holds. fp8 is a
  floating format, so one scale for every head costs little: values 2^14 below the largest still keep three
  mantissa bits.
* ``S = (q8 k8^T) * sq * sk * softmax_scale`` in float32; ``P = exp(S - rowmax)``, ``l = sum(P)`` in float32;
  ``P8 = fp8(P * 256)``; ``O = fp8((P8 v8) / 256 / l) * sv`` (cuDNN's fp8 attention writes fp8 on Hopper: O, a
  convex mix of V's rows, fits V's scale); the log-sum-exp ``rowmax + log(l)`` is returned beside ``O``.
  The kernel keeps a running maximum over blocks of keys (online softmax), so its P is rounded relative to the
  maximum so far rather than the final one: the emulation is the kernel's arithmetic up to that, and
  tests/gpu/test_attention_fp8_gpu.py holds the two within a bound.

Scales per sample (not per batch) keep a data-parallel or CFG-parallel rank's numbers equal to one process's. cuDNN
takes one descale per call, so a batch of several samples runs one call per sample.

Ring and USP merge partial attention over key chunks; each chunk's P would be rounded against its own maximum, so
they do not take this attention (``options.RunOptions.validate``). No mask: a call with one raises.
"""

from __future__ import annotations

import math

import torch


#: e4m3's largest finite value
FP8_MAX = 448.0
#: P (in [0, 1]) is multiplied by this before its rounding to fp8, and the product divided by it after
P_SCALE = 256.0
#: ``attention="fp8"`` attends exactly where the keys are fewer: on one H200 cuDNN's fp8 kernel with its quantization
#: took 0.536 ms against the exact kernel's 0.417 at FLUX 1024² (4,608 keys, 24 heads, CUDA graphs) and 29.9 against
#: 38.3 ms at Wan 480p (32,760 keys, 40 heads): docs/quantization.md. The emulation rounds at every length.
MIN_KEYS = 8192


def smooth_keys(k: torch.Tensor) -> torch.Tensor:
    """``k`` ``[B, S, H, D]`` minus its mean over the keys (per batch, head and channel), in float32: softmax does not
    change when every score of a query moves together, and a channel offset no longer takes the 8-bit range."""
    mean = k.double().mean(dim=1, keepdim=True).float()
    return k.float() - mean
#: head dims cuDNN's fp8 attention takes (multiples of 16 up to 256; 128 is its fast path)
MAX_HEAD_DIM = 256


def _check(q: torch.Tensor, mask) -> None:
    if mask is not None:
        raise NotImplementedError("attention=fp8 takes no attention mask, and this model's attention passes one; "
                                  "use the default attention for it")
    d = q.shape[-1]
    if d % 16 or d > MAX_HEAD_DIM:
        raise NotImplementedError(f"attention=fp8 takes head dims that are multiples of 16 up to {MAX_HEAD_DIM}, "
                                  f"and this model's are {d}; use the default attention for it")


def all_reduce_max(x: torch.Tensor, group) -> torch.Tensor:
    """``x`` reduced with MAX over ``group`` (None: as it is); a traceable functional collective, counted."""
    if group is None:
        return x
    from ..comm import all_reduce_max as reduce

    return reduce(x, group)


def sample_scales(tensors, group=None) -> torch.Tensor:
    """Power-of-two float32 scales ``[len(tensors), B]`` of each ``[B, ...]`` tensor: ``2^ceil(log2(amax / 448))``
    per sample, the amaxes reduced over ``group`` first, all in one all-reduce (module docstring)."""
    amax = torch.stack([t.detach().abs().flatten(1).amax(1).float() for t in tensors])
    amax = all_reduce_max(amax, group).clamp(min=torch.finfo(torch.float32).tiny * FP8_MAX)
    return torch.exp2(torch.ceil(torch.log2(amax / FP8_MAX)))


def to_fp8(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``x`` ``[B, ...]`` divided by its per-sample ``scale`` ``[B]`` and rounded to ``float8_e4m3fn``."""
    view = scale.view(-1, *([1] * (x.dim() - 1)))
    return (x.float() / view).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)


def quantize(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group=None):
    """``(q8, k8, v8, scales)``: the fp8 tensors ``[B, S, H, D]`` and their scales ``[3, B]`` (Q, smoothed K, V)."""
    ks = smooth_keys(k)
    scales = sample_scales((q, ks, v), group)
    return to_fp8(q, scales[0]), to_fp8(ks, scales[1]), to_fp8(v, scales[2]), scales


def attend_emulated(q8, k8, v8, scales: torch.Tensor, scale: float, dtype: torch.dtype):
    """The arithmetic after the rounding, in float32, on quantized ``q8``, ``k8``, ``v8`` ``[B, S, H, D]`` and their
    ``scales`` ``[3, B]``: ``(out [B, S_q, H, D] in dtype, lse [B, H, S_q] float32)``."""
    sq, sk, sv = (s.view(-1, 1, 1, 1) for s in scales)
    qf, kf, vf = (t.float().transpose(1, 2) for t in (q8, k8, v8))  # [B, H, S, D]
    scores = torch.matmul(qf, kf.transpose(-1, -2)) * (sq * sk * scale)
    rowmax = scores.amax(-1, keepdim=True)
    probs = torch.exp(scores - rowmax)
    total = probs.sum(-1, keepdim=True)
    p8 = (probs * P_SCALE).to(torch.float8_e4m3fn).float()
    out = (torch.matmul(p8, vf) / P_SCALE / total).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).float() * sv
    lse = (rowmax + torch.log(total)).squeeze(-1)
    return out.transpose(1, 2).to(dtype), lse


def attend_cudnn(q8, k8, v8, scales: torch.Tensor, scale: float, dtype: torch.dtype):
    """:func:`attend_emulated`'s arithmetic on cuDNN's fused fp8 attention (CUDA, compute capability 9.0+,
    ``ditmesh[fp8]``)."""
    from .fp8_cudnn import attention as kernel

    return kernel(q8, k8, v8, scales, scale, dtype)


def attention_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None = None, mask=None,
                  group=None, emulated: bool = True, pieces=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of ``q``, ``k``, ``v`` ``[B, S, H, D]`` with the fp8 rounding (module docstring):
    ``(out [B, S_q, H, D] in q's dtype, lse [B, H, S_q] float32)``, in float32 math (``emulated``) or on cuDNN's
    kernel. The inputs are quantized once (one all-reduce over ``group``), then ``pieces``
    (``attention.local.QueryChunks``, or None) cuts the attention of the quantized queries.

    The log-sum-exp is that of the scores against the *smoothed* keys: the true one differs by ``scale * q . mean(k)``
    per query, the same for every key chunk; a merge of partial results over key chunks must smooth them with one
    mean (none does today: ring and USP are refused)."""
    from .local import in_query_chunks

    _check(q, mask)
    scale = scale if scale is not None else 1.0 / math.sqrt(q.shape[-1])
    q8, k8, v8, scales = quantize(q, k, v, group)
    attend = attend_emulated if emulated else attend_cudnn
    return in_query_chunks(lambda qp, kp, vp, m: attend(qp, kp, vp, scales, scale, q.dtype), q8, k8, v8, None, pieces)


def emulated_attention_lse(q, k, v, scale: float | None = None, mask=None, group=None):
    """The fp8 rounding in float32 math: :func:`attention_lse` with ``emulated=True``."""
    return attention_lse(q, k, v, scale, mask, group, emulated=True)


def emulated_attention(q, k, v, scale: float | None = None, mask=None, group=None, pieces=None) -> torch.Tensor:
    """:func:`emulated_attention_lse`'s output alone."""
    return attention_lse(q, k, v, scale, mask, group, emulated=True, pieces=pieces)[0]


def fp8_attention_lse(q, k, v, scale: float | None = None, mask=None, group=None):
    """The same rounding on cuDNN's fused fp8 attention: :func:`attention_lse` with ``emulated=False``."""
    return attention_lse(q, k, v, scale, mask, group, emulated=False)


def fp8_attention(q, k, v, scale: float | None = None, mask=None, group=None, pieces=None) -> torch.Tensor:
    """:func:`fp8_attention_lse`'s output alone."""
    return attention_lse(q, k, v, scale, mask, group, emulated=False, pieces=pieces)[0]
