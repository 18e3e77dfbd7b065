"""Model statistics measured from the model itself, on the meta device.

The transformer is built from its diffusers class and config under ``torch.device("meta")`` (no memory,
no weights) and run forward once at the requested resolution with three observers:

* ``FlopCounterMode`` counts the FLOPs of every GEMM, attributed to the module that ran it;
* a ``TorchFunctionMode`` catches ``scaled_dot_product_attention`` (recording batch, heads, query and key
  lengths) and answers with an empty tensor, as a fused flash kernel would, instead of materialising the
  score matrix;
* a ``TorchDispatchMode`` records the bytes every other (memory-bound) op reads and writes and the peak
  of live activation bytes.

Nothing here is specific to one model: the family's adapter says how a resolution becomes the transformer's
inputs (``layout``, ``example_inputs``), how many text tokens its pipelines use, and which linears tensor
parallelism shards (``tensor_plan``).
"""

from __future__ import annotations

import functools
import json
import os
import weakref
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import FlopCounterMode

from ..models import adapter_for_class
from ..models.base import Layout
from ..parallel.tensor import resolve_plan


class PlannerError(ValueError):
    """Input the planner cannot plan for; the message names the value and what would work."""


def adapter_of(class_name: str):
    """The model adapter of a diffusers transformer class; PlannerError naming the supported ones otherwise."""
    try:
        return adapter_for_class(class_name)
    except NotImplementedError as exc:
        raise PlannerError(str(exc)) from None


def family_inputs(spec: "ModelSpec", model: torch.nn.Module, height: int, width: int, frames: int, batch: int,
                  dtype: torch.dtype) -> tuple[Layout, dict]:
    """Token counts and one denoising step's inputs (on the meta device) of ``model`` at one resolution."""
    adapter = adapter_of(spec.transformer_class)
    try:
        layout = adapter.layout(spec.config, height, width, frames, spec.text_tokens)
    except ValueError as exc:
        raise PlannerError(str(exc)) from None
    inputs = adapter.example_inputs(model, height=height, width=width, batch=batch, text_len=spec.text_tokens,
                                    generator=torch.Generator().manual_seed(0), device="meta", dtype=dtype,
                                    frames=frames if adapter.frame_step else None)
    return layout, {k: v for k, v in inputs.items() if k != "return_dict"}


# ---------------------------------------------------------------------------------------------------
# model specs: a synth architecture name or a checkpoint folder
# ---------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ModelSpec:
    """What the planner needs to build a model on the meta device."""

    name: str
    transformer_class: str
    config_json: str  # the transformer config, as sorted JSON (hashable)
    text_tokens: int
    dtype: str = "bfloat16"

    @property
    def config(self) -> dict:
        return json.loads(self.config_json)


def resolve_model(model: str, dtype: str | None = None) -> ModelSpec:
    """A :class:`ModelSpec` for what ``generate --model`` takes: a ``ditmesh synth`` architecture name, a diffusers
    checkpoint folder, or a hub id (its configurations read through the Hugging Face cache, no weights)."""
    from ..shared import hub_config_folder, model_source
    from ..models.registry import ARCHS

    if model in ARCHS:
        arch = ARCHS[model]
        adapter_of(arch.transformer_class)
        return ModelSpec(model, arch.transformer_class, json.dumps(arch.transformer, sort_keys=True),
                         arch.max_sequence_length, dtype or "bfloat16")
    folder = Path(model).expanduser()
    if not folder.is_dir():
        try:
            model_source(model, lambda: ARCHS)  # a file or a misspelt path: one line; else a hub id
            folder = Path(hub_config_folder(model, ("model_index.json", "vae/config.json", "transformer/config.json")))
        except ValueError as exc:
            raise PlannerError(str(exc)) from None
    config_path = folder / "transformer" / "config.json"
    if not config_path.is_file():
        raise PlannerError(f"model {model!r} is neither a ditmesh synth architecture ({', '.join(sorted(ARCHS))}) "
                           f"nor a folder with transformer/config.json")
    config = json.loads(config_path.read_text())
    class_name = config.get("_class_name")
    if not class_name:
        raise PlannerError(f"{config_path} has no _class_name; cannot tell which diffusers model it is")
    adapter = adapter_of(class_name)
    text_tokens = adapter.text_tokens
    synth_meta = folder / "ditmesh_synth.json"
    if synth_meta.is_file():
        text_tokens = json.loads(synth_meta.read_text()).get("max_sequence_length", text_tokens)
    index = folder / "model_index.json"
    if adapter.checkpoint_text_tokens is not None and index.is_file():
        text_tokens = adapter.checkpoint_text_tokens(json.loads(index.read_text())) or text_tokens
    config = {k: v for k, v in config.items() if not k.startswith("_")}
    return ModelSpec(str(folder), class_name, json.dumps(config, sort_keys=True), text_tokens, dtype or "bfloat16")


# ---------------------------------------------------------------------------------------------------
# statistics
# ---------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class LinearStat:
    name: str
    rows: int  # tokens (x batch) the linear ran on
    in_features: int
    out_features: int
    flops: int
    tp_sharded: bool
    row_parallel: bool
    tokenwise: bool


@dataclass(frozen=True)
class AttentionStat:
    name: str
    batch: int
    heads: int
    q_len: int
    kv_len: int
    head_dim: int
    flops: int
    self_attention: bool  # keys come from the split sequence (needs sequence-parallel exchange)


@dataclass
class ModelStats:
    """Everything the cost model needs, measured at one resolution and batch size."""

    spec: ModelSpec
    height: int
    width: int
    frames: int
    batch: int
    layout: Layout
    hidden_dim: int
    num_heads: int
    head_dim: int
    num_blocks: int
    block_prefixes: tuple[str, ...]
    params_total: int
    params_tp_sharded: int
    params_in_blocks: int
    bytes_per_element: int
    linears: list[LinearStat]
    attentions: list[AttentionStat]
    total_flops: int  # FlopCounterMode total (GEMMs) + attention
    mem_bytes_sharded: int  # memory-bound traffic in tensors split by tensor parallelism
    mem_bytes_replicated: int  # ... in token-wise tensors TP leaves whole
    mem_bytes_fixed: int  # ... in tensors without a sequence dimension
    op_count: int
    act_peak_bytes: int
    act_peak_sharded_bytes: int
    tp_divisible: tuple[int, ...] = field(default=())  # sizes tensor parallelism must divide
    #: every block of the adapter's block lists in forward order: (module path, parameters, traced ops); the
    #: parameters are what PipeFusion's stage split weighs (``parallel.pipefusion.block_costs``)
    blocks: tuple[tuple[str, int, int], ...] = field(default=())
    trace_seconds: float = 0.0

    @property
    def gemm_flops(self) -> int:
        return sum(lin.flops for lin in self.linears)

    @property
    def attention_flops(self) -> int:
        return sum(a.flops for a in self.attentions)

    @property
    def weight_bytes(self) -> int:
        return self.params_total * self.bytes_per_element

    def summary(self) -> dict:
        return {
            "model": self.spec.name, "class": self.spec.transformer_class, "params": self.params_total,
            "params_tp_sharded": self.params_tp_sharded, "weight_gib": round(self.weight_bytes / 2**30, 2),
            "hidden_dim": self.hidden_dim, "heads": self.num_heads, "blocks": self.num_blocks,
            "image_tokens": self.layout.image_tokens, "text_tokens": self.layout.text_tokens,
            "split_tokens": self.layout.split_tokens, "tflop_per_step": round(self.total_flops / 1e12, 2),
            "attention_tflop": round(self.attention_flops / 1e12, 2),
            "activation_peak_gib": round(self.act_peak_bytes / 2**30, 3),
        }


class _AttentionCatcher(TorchFunctionMode):
    """Records every SDPA call and answers with an empty output, as a fused kernel would."""

    def __init__(self, stack: list[str], out: list):
        super().__init__()
        self.stack, self.out = stack, out

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.nn.functional.scaled_dot_product_attention:
            q, k, v = (list(args[:3]) + [kwargs.get(n) for n in ("query", "key", "value")[len(args[:3]):]])
            *lead, q_len, dim = q.shape
            kv_len, dim_v = k.shape[-2], v.shape[-1]
            batch = lead[0] if lead else 1
            heads = 1
            for n in lead[1:]:
                heads *= n
            self.out.append((self.stack[-1] if self.stack else "", batch, heads, q_len, kv_len, dim, dim_v))
            return torch.empty(*lead, q_len, dim_v, dtype=q.dtype, device=q.device)
        return func(*args, **kwargs)


class _TrafficCounter(TorchDispatchMode):
    """Bytes moved by memory-bound ops and the peak of live activation bytes; ``conv_workspace``: each convolution
    also holds, while it runs, a workspace of its input's and output's size (cuDNN's layout copies: what the
    measured split VAE decodes on H100s held beyond their live tensors, docs/planner.md)."""

    GEMMS = {"mm", "addmm", "bmm", "baddbmm", "convolution", "_convolution", "linear"}

    def __init__(self, classify, conv_workspace: bool = False):
        super().__init__()
        self.classify = classify  # tensor -> "sharded" | "replicated" | "fixed"
        self.conv_workspace = conv_workspace
        self.bytes = {"sharded": 0, "replicated": 0, "fixed": 0}
        self.ops = 0
        self.live = {"sharded": 0, "replicated": 0, "fixed": 0}
        self.peak = 0
        self.peak_sharded = 0

    def _alloc(self, t: torch.Tensor, kind: str):
        n = t.numel() * t.element_size()
        self.live[kind] += n
        weakref.finalize(t, self._free, kind, n)
        total = sum(self.live.values())
        if total > self.peak:
            self.peak, self.peak_sharded = total, self.live["sharded"]

    def _free(self, kind: str, n: int):
        self.live[kind] -= n

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.ops += 1
        name = func.overloadpacket.__name__
        is_view = func.is_view or name.endswith("_")  # views and in-place ops allocate nothing
        outs = [o for o in (out if isinstance(out, (tuple, list)) else [out]) if isinstance(o, torch.Tensor)]
        if name not in self.GEMMS and name not in ("empty", "zeros", "ones", "full", "empty_strided", "detach"):
            if not func.is_view:
                ins = [a for a in torch.utils._pytree.tree_leaves((args, kwargs)) if isinstance(a, torch.Tensor)]
                moved = sum(t.numel() * t.element_size() for t in ins + outs)
                kind = self.classify(outs[0]) if outs else "fixed"
                self.bytes[kind] += moved
        if not is_view and outs:
            # an output that shares an input's storage (a collective's wait, an ``out=`` op) allocates nothing
            held = {a.untyped_storage()._cdata for a in torch.utils._pytree.tree_leaves((args, kwargs))
                    if isinstance(a, torch.Tensor)}
            for o in outs:
                if o.untyped_storage()._cdata not in held:
                    self._alloc(o, self.classify(o))
        if self.conv_workspace and name == "convolution":
            workspace = sum(t.numel() * t.element_size() for t in (args[0], out))
            self.peak = max(self.peak, sum(self.live.values()) + workspace)
        return out


def _heads(model: torch.nn.Module, config: dict) -> tuple[int, int]:
    heads = config.get("num_attention_heads") or config.get("num_heads")
    head_dim = config.get("attention_head_dim") or config.get("head_dim")
    if isinstance(head_dim, (list, tuple)):
        head_dim = head_dim[0]
    if not heads or not head_dim:
        for module in model.modules():
            if hasattr(module, "heads") and hasattr(module, "inner_dim"):
                return int(module.heads), int(module.inner_dim // module.heads)
            if isinstance(getattr(module, "heads", None), int) and isinstance(getattr(module, "head_dim", None), int):
                return module.heads, module.head_dim  # JoyImage-Edit's attention
            query = getattr(module, "to_q", None)
            if isinstance(getattr(module, "heads", None), int) and isinstance(query, torch.nn.Linear):
                return module.heads, query.out_features // module.heads  # Bria FIBO 2's attention
        for module in model.modules():  # an attention layer counting ``num_heads``, its first linear the query's width
            query = next((c for c in module.children() if isinstance(c, torch.nn.Linear)), None)
            if isinstance(getattr(module, "num_heads", None), int) and query is not None:
                return module.num_heads, query.out_features // module.num_heads
        raise PlannerError("cannot find the attention head count in the model config")
    return int(heads), int(head_dim)


def _cache_path(spec: ModelSpec, height: int, width: int, frames: int, batch: int, chunk: int | None = None
                ) -> Path | None:
    """Where traced statistics are kept between runs (``DITMESH_PLAN_CACHE``; ``off`` disables)."""
    import hashlib
    import os

    import diffusers

    root = os.environ.get("DITMESH_PLAN_CACHE", str(Path.home() / ".cache" / "ditmesh" / "plan"))
    if root == "off":
        return None
    from ..aot import source_hash  # ditmesh's source: a changed adapter or processor traces again

    key = json.dumps([spec.transformer_class, spec.config_json, spec.text_tokens, spec.dtype, height, width, frames,
                      batch, torch.__version__, diffusers.__version__, _STATS_VERSION, source_hash()]
                     + ([chunk] if chunk else []))
    return Path(root) / (hashlib.sha256(key.encode()).hexdigest()[:24] + ".json")


_STATS_VERSION = 3


@functools.lru_cache(maxsize=16)
def model_stats(spec: ModelSpec, height: int, width: int, frames: int = 1, batch: int = 1,
                chunk: int | None = None) -> ModelStats:
    """Statistics of ``spec`` at one resolution (``chunk``: with feed-forwards and attention in pieces of that many
    tokens, ``parallel.chunk``): from the on-disk cache, else traced (:func:`trace_stats`)."""
    from dataclasses import asdict

    path = _cache_path(spec, height, width, frames, batch, chunk)
    if path is not None and path.is_file():
        try:
            d = json.loads(path.read_text())
            d["spec"] = ModelSpec(**d["spec"])
            d["layout"] = Layout(**{**d["layout"], "latent_shape": tuple(d["layout"]["latent_shape"])})
            d["linears"] = [LinearStat(**x) for x in d["linears"]]
            d["attentions"] = [AttentionStat(**x) for x in d["attentions"]]
            d["block_prefixes"] = tuple(d["block_prefixes"])
            d["tp_divisible"] = tuple(d["tp_divisible"])
            d["blocks"] = tuple(tuple(b) for b in d["blocks"])
            return ModelStats(**d)
        except (ValueError, TypeError, KeyError):
            pass  # stale or damaged: trace again
    stats = trace_stats(spec, height, width, frames, batch, chunk)
    if path is not None:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps(asdict(stats)))
            tmp.replace(path)
        except OSError:
            pass  # a read-only home is fine: we just trace every time
    return stats


def trace_stats(spec: ModelSpec, height: int, width: int, frames: int = 1, batch: int = 1,
                chunk: int | None = None) -> ModelStats:
    """Trace ``spec``'s transformer on the meta device at one resolution and return its statistics (``chunk``: with
    the ``chunk`` hooks and query pieces of ``parallel.chunk`` installed, as ``parallelize(chunk_tokens=...)`` runs
    it: the activation peak is the chunked one)."""
    import time

    import diffusers

    start = time.perf_counter()
    adapter = adapter_of(spec.transformer_class)
    cls = getattr(diffusers, spec.transformer_class, None)
    if cls is None:
        raise PlannerError(f"diffusers {diffusers.__version__} has no class {spec.transformer_class}")
    dtype = getattr(torch, spec.dtype)
    config = spec.config
    with torch.device("meta"):
        model = cls(**config).eval()
        # nn.Module._apply, not ModelMixin.to: same cast on meta tensors, without diffusers' fp32-module warning
        model._apply(lambda t: t.to(dtype) if t.is_floating_point() else t)
    # undone after the trace: a family's trace may patch a function of diffusers' module, for every model of the
    # process (Sana-WM's camera geometry answered with empty tensors: a later real model read garbage)
    undo_trace = adapter.meta_trace(model) if adapter.meta_trace is not None else None
    handles = []
    try:  # what runs before the trace too: a failure there undoes it
        if chunk:
            from ..attention.local import QueryChunks
            from ..parallel import chunk as chunking

            chunking.apply(model, adapter, chunk, torch.device("meta"), QueryChunks(tokens=chunk))
        layout, inputs = family_inputs(spec, model, height, width, frames, batch, dtype)
        heads, head_dim = _heads(model, config)
        hidden = heads * head_dim

        blocks = [(spec.path, model.get_submodule(spec.path)) for spec in adapter.blocks]
        prefixes = tuple(name + "." for name, _ in blocks)
        names = {m: n for n, m in model.named_modules()}
        token_sizes = {layout.image_tokens, layout.text_tokens, layout.split_tokens, layout.image_tokens + layout.text_tokens}
        token_sizes.discard(0)

        def tokenwise(shape) -> bool:
            return any(s in token_sizes for s in shape[:-1]) if len(shape) > 1 else False

        def classify(t: torch.Tensor) -> str:
            if not tokenwise(t.shape):
                return "fixed"
            return "replicated" if t.shape[-1] == hidden or t.dim() < 3 else "sharded"

        # which linears tensor parallelism shards, and which of them are row-parallel (an all-reduce each)
        shards = resolve_plan(model, adapter.tensor_plan, 1) if adapter.tensor_plan is not None else {}

        def is_sharded_linear(name: str) -> bool:
            return name in shards and shards[name].kind != "norm"

        stack: list[str] = []
        linear_shapes: dict[str, list] = {}
        traffic = _TrafficCounter(classify)
        block_ops: dict[str, int] = {}  # ops traced inside each block (its forward, every call)
        for path, block_list in blocks:
            for i, block in enumerate(block_list):
                key = f"{path}.{i}"
                handles.append(block.register_forward_pre_hook(
                    lambda m, a, k=key: block_ops.__setitem__(k, block_ops.get(k, 0) - traffic.ops)))
                handles.append(block.register_forward_hook(
                    lambda m, a, o, k=key: block_ops.__setitem__(k, block_ops[k] + traffic.ops)))
        for module, name in names.items():
            handles.append(module.register_forward_pre_hook(lambda m, a, n=name: stack.append(n) and None))
            handles.append(module.register_forward_hook(lambda m, a, o: stack.pop() and None))
            if isinstance(module, torch.nn.Linear):
                handles.append(module.register_forward_hook(
                    lambda m, a, o, n=name: linear_shapes.setdefault(n, []).append(tuple(a[0].shape)) and None))
        attention_calls: list = []
        flop_counter = FlopCounterMode(display=False)
        with torch.no_grad(), flop_counter, _AttentionCatcher(stack, attention_calls), traffic:
            model(**inputs, return_dict=False)
    finally:
        for h in handles:
            h.remove()
        if callable(undo_trace):
            undo_trace()

    root = type(model).__name__
    counts = flop_counter.get_flop_counts()
    linears = []
    for name, shapes in linear_shapes.items():
        module = model.get_submodule(name)
        module_flops = sum(counts.get(f"{root}.{name}", {}).values())
        per_call = module_flops // max(1, len(shapes))
        sharded = is_sharded_linear(name)
        for shape in shapes:
            rows = 1
            for s in shape[:-1]:
                rows *= s
            linears.append(LinearStat(name, rows, module.in_features, module.out_features, per_call, sharded,
                                      sharded and shards[name].kind != "colwise", tokenwise(shape)))
    gemm_total = sum(sum(v.values()) for k, v in counts.items() if k == "Global")
    conv_flops = gemm_total - sum(lin.flops for lin in linears)
    if conv_flops > 0:  # patch-embedding convolutions and any other non-Linear GEMM: token-wise, replicated
        linears.append(LinearStat("<other gemms>", layout.image_tokens * batch, 0, 0, conv_flops, False, False, True))
    attentions = []
    for name, b, h, q_len, kv_len, d, dv in attention_calls:
        attentions.append(AttentionStat(name, b, h, q_len, kv_len, d, 2 * b * h * q_len * kv_len * (d + dv),
                                        self_attention=(q_len == kv_len == layout.split_tokens)))

    params = dict(model.named_parameters())
    sharded_params = sum(p.numel() for n, p in params.items()
                         if is_sharded_linear(n.rsplit(".", 1)[0]) and isinstance(model.get_submodule(n.rsplit(".", 1)[0]), torch.nn.Linear))
    divisible = {heads}
    for lin in linears:
        if lin.tp_sharded:
            divisible.add(lin.in_features if lin.row_parallel else lin.out_features)
    return ModelStats(
        spec=spec, height=height, width=width, frames=frames, batch=batch, layout=layout,
        hidden_dim=hidden, num_heads=heads, head_dim=head_dim,
        num_blocks=sum(len(b) for _, b in blocks), block_prefixes=prefixes,
        params_total=sum(p.numel() for p in params.values()), params_tp_sharded=sharded_params,
        params_in_blocks=sum(p.numel() for n, p in params.items() if n.startswith(prefixes)),
        bytes_per_element=torch.empty(0, dtype=dtype).element_size(),
        linears=linears, attentions=attentions,
        total_flops=gemm_total + sum(a.flops for a in attentions),
        mem_bytes_sharded=traffic.bytes["sharded"], mem_bytes_replicated=traffic.bytes["replicated"],
        mem_bytes_fixed=traffic.bytes["fixed"], op_count=traffic.ops,
        act_peak_bytes=traffic.peak, act_peak_sharded_bytes=traffic.peak_sharded,
        tp_divisible=tuple(sorted(divisible)),
        blocks=tuple((f"{path}.{i}", sum(p.numel() for p in block.parameters()), block_ops.get(f"{path}.{i}", 0))
                     for path, block_list in blocks for i, block in enumerate(block_list)),
        trace_seconds=time.perf_counter() - start,
    )
