"""8-bit linear layers in the transformer blocks (``quant``), after sharding and before compile and CUDA graphs.

Modes (:data:`MODES`):

- ``fp8``: weights in float8_e4m3fn with a float32 scale per output row, activations quantized the same way per
  token row (over the input features) at every call (dynamic scales), the product in fp8;
- ``fp8-weight``: the weights alone in fp8 (per output row), dequantized to the activations' dtype for the product;
- ``int8-weight``: the weights alone in int8, symmetric per output row (CPUs and GPUs without fp8 arithmetic).

Which linears: every ``nn.Linear`` inside the family's repeated blocks (``adapter.blocks``) whose both sizes are
multiples of 16 (what fp8 matrix products take); embeddings, norms, the final projection and the x/context embedders
sit outside the blocks and stay in the model's dtype. The AdaLN modulation linears (a path part starting with
``norm``, e.g. FLUX's ``norm1.linear``) are quantized unless ``modulation=False`` (docs/quantization.md measures
both). In ``fp8``, a text-stream linear of at least 8192 input features (FLUX's ``ff_context.net.2``: K = 12288, 128
rows a rank under ulysses 4) keeps fp8 weights with products in the activations' dtype: row-wise fp8 products of
that shape have failed on H100 (pytorch/ao#4582), and the text stream's few rows make its time negligible.

Where (``backend``, ``auto`` by default): on CUDA, ``fp8`` linears become :class:`QuantLinear` s whose products run
through ``torch._scaled_mm`` (compiled, the activation's rounding fuses into the kernel that produces it; torchao's
fp8 tensor subclass gives the same step but compiled cold for minutes), and torchao does the weight-only modes
(``torchao.quantization.quantize_`` with ``Float8WeightOnlyConfig``, ``Int8WeightOnlyConfig``; ``backend="torchao"``
also for fp8, with ``Float8DynamicActivationFloat8WeightConfig(granularity=PerRow())``), except for the row-parallel
linears of tensor parallelism. Those, and every layer on other devices, become a :class:`QuantLinear`: 8-bit weights
and scales held, the rounding of the activations done in float32 math (on CUDA the fp8 product by ``torch._scaled_mm``). The rounding is torchao's: scale = amax / 448
(fp8) or amax / 127.5 (int8), divided in the tensor's dtype (bf16 on GPUs), values divided by the scale in float32,
clamped and cast (int8: multiplied by the reciprocal, rounded to nearest even). tests/gpu/test_quant_gpu.py checks that torchao's 8-bit weights
and scales are these, bit for bit.

Tensor parallelism: a column-parallel shard keeps whole rows, so its per-row weight scales are one process's; a
row-parallel shard holds a slice of every row, so its weight row amax is reduced (max) over the tp group once, and
in ``fp8`` its input's per-token amax is reduced over the group at every call: every scale is the one a single
process takes, and each shard holds exactly one process's 8-bit values for its slice.

torchao is imported only when a CUDA run asks for a mode.
"""

from __future__ import annotations

import contextlib
import logging
import os
import weakref

import torch
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F

from ..config import ConfigError
from ..options import QUANT_BACKENDS, QUANT_MANIFEST, quant_layer_mode, resolved_quant_backend

log = logging.getLogger("ditmesh")

MODES = ("fp8", "fp8-weight", "int8-weight")
FP8 = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8).max)  # 448
#: the smallest amax a scale is taken from (an all-zero row would give 0 / 0)
TINY = 1e-12
#: fp8 products by ``torch._scaled_mm`` accumulate in the tensor cores' fast mode (as torchao's inference default);
#: ``DITMESH_FP8_FAST_ACCUM=0`` turns it off (what it buys: docs/quantization.md)
FAST_ACCUM = os.environ.get("DITMESH_FP8_FAST_ACCUM", "1") != "0"
#: inductor options for blocks holding fp8 linears with ``DITMESH_FP8_TUNE=1``: the kernels that round each
#: activation row (its amax, a reduction over the row, fused with the norm or GELU before it) tuned by coordinate
#: descent at compile time. Off by default: on one H200 it made FLUX.1-dev's cold compile pass 90 s (17 s without)
COMPILE_OPTIONS = {"coordinate_descent_tuning": True} if os.environ.get("DITMESH_FP8_TUNE", "0") == "1" else {}


#: ``DITMESH_FP8_WIDE_ROWS=N``: inductor reduces a row of up to N elements in one pass, held in registers (a
#: persistent reduction; its own limit is 1,024), where it otherwise loops over the row for the amax and again for the
#: cast (and for a norm's statistics before them). Only in blocks with fp8 products. Off (0) by default: on one H200
#: (FLUX.1-dev, 16384) the 3,072-wide norm + rounding kernels took 0.8 ms less a step and the 15,360-wide GELU + concat
#: + rounding ones 1.6 ms more, no step gained beyond noise (docs/quantization.md)
WIDE_ROWS = int(os.environ.get("DITMESH_FP8_WIDE_ROWS", "0") or "0")


def _fp8_products(block: torch.nn.Module) -> bool:
    return any(isinstance(m, QuantLinear) and m.mode == "fp8" and m.scaled_mm for m in block.modules())


def compile_options(block: torch.nn.Module) -> dict:
    """:data:`COMPILE_OPTIONS` when ``block`` holds an fp8 :class:`QuantLinear` running ``torch._scaled_mm``."""
    return dict(COMPILE_OPTIONS) if COMPILE_OPTIONS and _fp8_products(block) else {}


def install_compile_heuristics(blocks) -> bool:
    """With :data:`WIDE_ROWS` and fp8 products in ``blocks``: :class:`ditmesh.parallel.wide_rows.WideRows` becomes
    inductor's heuristics (its documented extension point: in every thread through ``inductor_choices_class``, which
    also keys inductor's caches, and in this one). Returns whether."""
    if not WIDE_ROWS or not any(map(_fp8_products, blocks)):
        return False
    from torch._inductor import config
    from torch._inductor.virtualized import V

    from .wide_rows import WideRows

    WideRows.limit = WIDE_ROWS
    if hasattr(config, "inductor_choices_class"):
        config.inductor_choices_class = WideRows
    V.set_choices_handler(WideRows())
    return True


# ---- the rounding (torchao's formulas, on any device) ---------------------------------------------------------

def fp8_scale(amax: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Per-row float32 scale of an fp8 tensor of ``dtype`` from its row amax, divided in ``dtype`` as torchao does."""
    return (amax.to(dtype).clamp(min=TINY) / FP8_MAX).float()


def fp8_quantize(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``x / scale`` clamped to the fp8 range and cast to float8_e4m3fn (round to nearest even)."""
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8)


def int8_scale(amax: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Per-row float32 scale of a symmetric int8 tensor of ``dtype`` from its row amax (range [-128, 127], step
    amax / 127.5, divided in ``dtype`` as torchao does)."""
    return (amax.to(dtype) / 127.5).clamp(min=torch.finfo(torch.float32).eps).float()


def int8_quantize(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return torch.round(x.float() * (1.0 / scale)).clamp(-128, 127).to(torch.int8)


def row_amax(x: torch.Tensor, group=None) -> torch.Tensor:
    """``|x|``'s max over the last dim, ``[..., 1]`` in float32; reduced (max) over ``group`` when given."""
    amax = x.detach().abs().amax(-1, keepdim=True).float()
    if group is not None:  # the functional collective: traceable inside a compiled block
        from ..comm import _count, _waited

        _count("all_reduce")
        amax = _waited(funcol.all_reduce(amax, "max", group))
    return amax


# ---- recording the activation scales (tests) ------------------------------------------------------------------

_RECORD: list | None = None


@contextlib.contextmanager
def record_scales():
    """Collect ``(layer name, activation scales [rows, 1])`` of every ``fp8`` :class:`QuantLinear` call inside."""
    global _RECORD
    outer, _RECORD = _RECORD, []
    try:
        yield _RECORD
    finally:
        _RECORD = outer


# ---- the layer ------------------------------------------------------------------------------------------------

class QuantLinear(torch.nn.Module):
    """A linear with 8-bit weights (``qweight``: float8_e4m3fn or int8, ``[out, in]``) and a float32 scale per output
    row (``scale``: ``[out, 1]``), built from ``linear`` (whose weight it replaces). ``group``: the tp group of a
    row-parallel shard (scales reduced over it, the product summed over it, the bias added once after the sum).
    ``scaled_mm``: the fp8 product by ``torch._scaled_mm`` (CUDA) rather than in the activations' dtype."""

    def __init__(self, linear: torch.nn.Linear, mode: str, name: str = "", group=None, scaled_mm: bool = False,
                 quantized: tuple | None = None):
        """``quantized``: ``(qweight, scale, dtype)`` read from a quantized checkpoint (``linear`` then holds no
        weight of its own), instead of quantizing ``linear.weight``."""
        super().__init__()
        self.mode, self.name, self.group, self.scaled_mm = mode, name, group, scaled_mm
        self.group_name = group.group_name if group is not None else None  # what forward reads (see RowParallelLinear)
        self.in_features, self.out_features = linear.in_features, linear.out_features
        if quantized is not None:
            qweight, scale, self.dtype = quantized
        else:
            weight = linear.weight.detach()
            amax = row_amax(weight, group)
            scale = (int8_scale if mode == "int8-weight" else fp8_scale)(amax, weight.dtype)
            qweight = (int8_quantize if mode == "int8-weight" else fp8_quantize)(weight, scale)
            self.dtype = weight.dtype
        self.register_buffer("qweight", qweight)
        self.register_buffer("scale", scale)
        self.bias = linear.bias

    def dequantized(self, dtype: torch.dtype) -> torch.Tensor:
        return (self.qweight.float() * self.scale).to(dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.mode == "fp8":
            xs = fp8_scale(row_amax(x, self.group_name), x.dtype)
            xq = fp8_quantize(x, xs)
            if _RECORD is not None and not torch.compiler.is_compiling():
                _RECORD.append((self.name, xs.detach().reshape(-1, 1).clone()))
            if self.scaled_mm:
                out = torch._scaled_mm(xq.reshape(-1, self.in_features), self.qweight.t(),
                                       scale_a=xs.reshape(-1, 1), scale_b=self.scale.reshape(1, -1),
                                       out_dtype=x.dtype, use_fast_accum=FAST_ACCUM,
                                       ).reshape(*x.shape[:-1], self.out_features)
            else:
                out = F.linear((xq.float() * xs).to(x.dtype), self.dequantized(x.dtype))
        else:
            out = F.linear(x, self.dequantized(x.dtype))
        if self.group_name is not None:
            from ..comm import all_reduce_sum

            out = all_reduce_sum(out, self.group_name)
        return out if self.bias is None else out + self.bias

    def extra_repr(self) -> str:
        return f"{self.in_features}, {self.out_features}, mode={self.mode}, tp={'yes' if self.group else 'no'}"


# ---- choosing and replacing the layers ------------------------------------------------------------------------

def targets(model: torch.nn.Module, adapter, mode: str, quantize_modulation: bool = True) -> dict:
    """``{module name: (linear, its mode)}`` of the block linears ``mode`` quantizes (see the module docstring)."""
    if not adapter.blocks:
        raise ConfigError(f"quant={mode} quantizes the linears of the transformer blocks, and {adapter.name} declares "
                          "no block lists; use quant=off")
    from .tensor import lora_layer

    from ..fusion import fused_parts

    blocks = {id(b) for b in adapter.block_modules(model)}
    out = {}
    for block_name, block in model.named_modules():
        if id(block) not in blocks:
            continue
        # fused Q/K/V (``fuse_qkv``): the fused linear is quantized, its separate views are not called
        views = {id(lin) for module in block.modules() for lin in fused_parts(module)}
        for name, module in block.named_modules():
            if id(module) in views:
                continue
            full = f"{block_name}.{name}"
            if lora_layer(module):
                raise ConfigError(f"quant={mode}: {full} carries an unfused LoRA adapter; fuse it (fuse_lora) so the "
                                  "fused weights are quantized")
            # (a PipeFusion stage holds no weights of the other stages' blocks)
            if (type(module).__name__ in ("Linear", "RowParallelLinear") and isinstance(module, torch.nn.Linear)
                    and module.weight.numel()):
                chosen = quant_layer_mode(name, module.in_features, module.out_features, mode, quantize_modulation)
                if chosen is not None:
                    out[full] = (module, chosen)
    return out


def _drop_fused_views(model: torch.nn.Module, adapter) -> int:
    """Under fused Q/K/V the separate projections are views of the fused weight's rows: once that weight is
    quantized they would keep its model-dtype storage alive, so their weights become empty (the fused path never
    calls them). Returns how many were dropped."""
    from ..fusion import fused_parts

    count = 0
    for block in adapter.block_modules(model):
        for module in block.modules():
            for linear in fused_parts(module):
                linear.weight = torch.nn.Parameter(linear.weight.new_empty(0), requires_grad=False)
                linear.bias = None if linear.bias is None else torch.nn.Parameter(linear.bias.new_empty(0),
                                                                                  requires_grad=False)
                count += 1
    return count


def _set(model: torch.nn.Module, name: str, module: torch.nn.Module) -> None:
    parent, _, attr = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, attr, module)


def _torchao_config(mode: str):
    from torchao.quantization import (Float8DynamicActivationFloat8WeightConfig, Float8WeightOnlyConfig,
                                      Int8WeightOnlyConfig, PerRow)

    if mode == "fp8":
        return Float8DynamicActivationFloat8WeightConfig(granularity=PerRow())
    return Float8WeightOnlyConfig() if mode == "fp8-weight" else Int8WeightOnlyConfig()


def apply(model: torch.nn.Module, adapter, mode: str, tp_group=None, device=None, quantize_modulation: bool = True,
          backend: str = "auto") -> list:
    """Quantize ``model``'s block linears in ``mode`` in place (after tensor parallelism: ``tp_group`` is the tp
    group where tp > 1). ``backend`` (``options.QUANT_BACKENDS``, the run's ``quant_backend``): ``auto`` (torchao on
    CUDA, else :class:`QuantLinear`), ``torchao``, ``scaled-mm`` (:class:`QuantLinear` everywhere, its fp8 products by ``torch._scaled_mm`` on CUDA) or
    ``emulated`` (:class:`QuantLinear` everywhere, products in the activations' dtype). Returns undo callables.

    Quantized weights replace the originals (that is the memory saved), so the undo puts back linears holding the
    dequantized weights and raises RuntimeError saying so."""
    if mode == "off":
        return []
    device = torch.device(device if device is not None else next(model.parameters()).device)
    if backend not in QUANT_BACKENDS:
        raise ConfigError(f"quant backend {backend!r} is not one of {', '.join(QUANT_BACKENDS)}")
    if model in _PREQUANTIZED:
        return _adopt(model, mode, device)
    # auto: torchao's tensors for the weight-only modes on CUDA; fp8 by ditmesh's own layer (torch._scaled_mm on
    # plain tensors): the same step and a cold compile of 17 s instead of more than 200 s (docs/quantization.md)
    torchao = resolved_quant_backend(backend, mode, device.type) == "torchao"
    scaled_mm = backend != "emulated" and device.type == "cuda"  # fp8 products on the tensor cores
    chosen = targets(model, adapter, mode, quantize_modulation)
    replaced: dict[str, torch.nn.Module] = {}
    by_mode: dict[str, set] = {}
    for name, (linear, layer) in chosen.items():
        group = getattr(linear, "group", None) if type(linear).__name__ == "RowParallelLinear" else None
        if group is None and torchao:
            by_mode.setdefault(layer, set()).add(id(linear))
            continue
        q = QuantLinear(linear, layer, name, group, scaled_mm=scaled_mm and layer == "fp8")
        linear.weight = torch.nn.Parameter(linear.weight.new_empty(0), requires_grad=False)  # drop the original
        _set(model, name, q)
        replaced[name] = linear
    if by_mode:
        from torchao.quantization import quantize_

        for layer, ids in by_mode.items():
            quantize_(model, _torchao_config(layer), filter_fn=lambda m, fqn, ids=ids: id(m) in ids)
    dropped = _drop_fused_views(model, adapter)
    counts = {}
    for _, layer in chosen.values():
        counts[layer] = counts.get(layer, 0) + 1
    log.info("ditmesh: quant=%s on %s: %s%s", mode, type(model).__name__,
             ", ".join(f"{n} linears {m}" for m, n in sorted(counts.items())) or "no linear",
             f" ({dropped} fused Q/K/V views emptied)" if dropped else "")
    torchao_names = [name for name, (linear, layer) in chosen.items() if name not in replaced]

    def undo():
        for name, linear in replaced.items():
            q = model.get_submodule(name)
            linear.weight = torch.nn.Parameter(q.dequantized(q.dtype), requires_grad=False)
            _set(model, name, linear)
        for name in torchao_names:
            linear = model.get_submodule(name)
            linear.weight = torch.nn.Parameter(linear.weight.dequantize(), requires_grad=False)
        raise RuntimeError(f"quant={mode}: the original weights of {len(chosen)} linears were replaced by their "
                           "8-bit values; the linears hold the dequantized weights (load the model again for the "
                           "originals)")

    return [undo]


# ---- quantized checkpoints (``ditmesh quantize``) -------------------------------------------------------------
# A transformer folder written by :func:`save_quantized` holds, for each quantized linear, ``NAME.qweight`` (8-bit)
# and ``NAME.scale`` (float32, one per output row) in place of ``NAME.weight``, and ``MANIFEST`` names the mode and
# each linear's own mode. :func:`load_quantized_transformer` builds the model on the meta device and reads the 8-bit
# tensors as they are (a tensor-parallel rank its slice only: a column-parallel shard's rows of both, a row-parallel
# shard's columns of the weight and every row's scale), so no rank ever holds the weights in the model's dtype;
# ``apply`` then makes each of those linears a :class:`QuantLinear` from what was read. The values are those of
# quantizing the same model on the fly with :class:`QuantLinear` (tests/test_quantize_checkpoint.py); on CUDA its
# fp8 products run through ``torch._scaled_mm`` rather than torchao's tensors.

MANIFEST = QUANT_MANIFEST  # the file that names the mode (``runtime.models.read_quant_manifest`` reads it)

#: transformers loaded from a quantized checkpoint -> {linear name: (checkpoint mode, layer mode, scale, dtype)}
_PREQUANTIZED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def save_quantized(model: torch.nn.Module, adapter, folder, mode: str, quantize_modulation: bool = True) -> dict:
    """Quantize ``model`` (on one process, in its dtype) and write it to the transformer folder ``folder`` (config,
    weights, :data:`MANIFEST`). Returns the manifest."""
    import json
    from pathlib import Path

    from safetensors.torch import save_file

    dtype = next(model.parameters()).dtype
    apply(model, adapter, mode, device="cpu", quantize_modulation=quantize_modulation, backend="emulated")
    layers = {name: m.mode for name, m in model.named_modules() if isinstance(m, QuantLinear)}
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    model.save_config(folder)
    seen: dict[int, str] = {}
    tensors = {}
    for name, t in model.state_dict().items():
        if t.numel() == 0:  # the emptied weight of a replaced linear
            continue
        # a storage saved once (tied tensors would make safetensors refuse the file)
        tensors[name] = t.detach().clone() if t.data_ptr() in seen else t.detach().contiguous()
        seen[t.data_ptr()] = name
    save_file(tensors, str(folder / "diffusion_pytorch_model.safetensors"), metadata={"format": "pt"})
    manifest = {"mode": mode, "quant_modulation": quantize_modulation, "dtype": str(dtype).removeprefix("torch."),
                "layers": layers}
    (folder / MANIFEST).write_text(json.dumps(manifest, indent=1))
    return manifest


def load_quantized_transformer(folder, component: str, device, dtype: torch.dtype | None = None, tp_rank: int = 0,
                               tp_size: int = 1) -> torch.nn.Module:
    """The transformer ``component`` of the quantized pipeline ``folder`` on ``device``: its 8-bit linears read as
    stored (this tensor-parallel rank's slices under ``tp_size`` > 1, as ``tensor.load_sharded_transformer``
    loads), every other tensor cast to ``dtype``. Pass it to the pipeline and call ``parallelize`` with the
    checkpoint's quant mode."""
    import json

    from ..models.base import adapter_for
    from .tensor import _LOADED_SHARDED, MetaLoad, _set_param, shard_model, shard_slices

    load = MetaLoad(folder, component, device, dtype)
    manifest = json.loads((load.folder / MANIFEST).read_text())
    layers: dict = manifest["layers"]
    model = load.model

    def read(name: str, dim: int | None = None, ranges=None) -> torch.Tensor:
        layer, _, param = name.rpartition(".")
        if layer in layers and param == "weight":
            return load.read(f"{layer}.qweight", dim, ranges, keep_dtype=True)
        return load.read(name, dim, ranges)

    shards, read_already = {}, set()
    if tp_size > 1:
        adapter = adapter_for(model)
        if adapter.tensor_plan is None:
            raise ConfigError(f"{type(model).__name__} has no tensor-parallel plan")
        shards = shard_model(model, adapter.tensor_plan, tp_rank, tp_size, read=read)
        _LOADED_SHARDED.add(model)
        read_already = {f"{n}.{p}" for n, sh in shards.items() for p in ("weight", "bias")
                        if shard_slices(sh, p, tp_rank, tp_size) is not None}
    dtype = dtype or getattr(torch, manifest["dtype"])
    found = {}
    for layer, layer_mode in layers.items():
        module = model.get_submodule(layer)
        where = shard_slices(shards[layer], "weight", tp_rank, tp_size) if layer in shards else None
        if where is None:
            qweight = read(f"{layer}.weight")
        else:
            qweight = module.weight
        _set_param(module, "weight", torch.empty(0, device=device, dtype=dtype))  # QuantLinear holds qweight
        scale = (load.read(f"{layer}.scale", 0, where[1], keep_dtype=True) if where is not None and where[0] == 0
                 else load.read(f"{layer}.scale", keep_dtype=True))
        found[layer] = (manifest["mode"], layer_mode, qweight.detach(), scale, dtype)
        read_already.add(f"{layer}.weight")
    model = load.finish(read_already)
    _PREQUANTIZED[model] = found
    return model


def _adopt(model: torch.nn.Module, mode: str, device: torch.device) -> list:
    """``apply`` on a transformer of a quantized checkpoint: each stored linear becomes a :class:`QuantLinear`
    holding what was read (a row-parallel shard summing over its tp group)."""
    found = _PREQUANTIZED[model]
    stored = next(iter(found.values()))[0] if found else mode
    if stored != mode:
        raise ConfigError(f"quant={mode}, but this checkpoint was written by `ditmesh quantize` in {stored}; use "
                          f"quant={stored}")
    for name, (_, layer, qweight, scale, dtype) in found.items():
        linear = model.get_submodule(name)
        group = getattr(linear, "group", None) if type(linear).__name__ == "RowParallelLinear" else None
        out_features, in_features = qweight.shape
        linear.in_features, linear.out_features = in_features, out_features
        scaled_mm = device.type == "cuda" and layer == "fp8" and in_features % 16 == 0 and out_features % 16 == 0
        _set(model, name, QuantLinear(linear, layer, name, group, scaled_mm, quantized=(qweight, scale, dtype)))
    log.info("ditmesh: quant=%s on %s: %d linears read quantized from the checkpoint", mode, type(model).__name__,
             len(found))
    del _PREQUANTIZED[model]  # adopted once: its tensors now live in the QuantLinears

    def undo():
        raise RuntimeError(f"quant={mode}: the transformer was loaded quantized (ditmesh quantize); load the "
                           "original checkpoint for its weights in the model's dtype")

    return [undo]

