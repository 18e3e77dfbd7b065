"""Tensor parallelism: Megatron-style sharded linears, driven by the adapter's :class:`TensorPlan`.

Implementation: plain sliced weights (gpt-fast style), not DTensor. A column-parallel linear keeps its
rows ``[rank * out / tp, (rank + 1) * out / tp)`` and its output stays sharded; a row-parallel linear keeps
the matching input columns, computes a partial product without bias, sums it over the tensor-parallel
group with ONE functional all-reduce and adds its (whole, replicated) bias once after the sum. The
module's parameter names do not change, so a rank can load its shard straight from a checkpoint
(:func:`load_sharded_transformer`). docs/tensor-parallel.md says why this and not
``torch.distributed.tensor.parallel``.

Cross-rank rules:
- every rank of a tensor-parallel group shards with the same plan and degree; rank ``r`` of the group
  holds chunk ``r`` of every sharded dimension (chunk sizes from global shapes only, nothing exchanged);
- every rank runs every row-parallel linear in the same order (one all-reduce each);
- the tensor-parallel rank is the innermost mesh coordinate, ``global_rank % tp`` (see ``AXIS_ORDER``),
  which is what lets a rank load its shard before the mesh exists.
"""

from __future__ import annotations

import contextlib
import functools
import json
import math
import os
import weakref
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ..comm import all_gather_uneven, all_reduce_sum, broadcast_tensors
from ..config import ConfigError, divisors
from ..hooks import Hook, add_hook, bind_kwargs
from ..mesh import ParallelMesh
from ..models.base import ModelAdapter, TensorPlan, adapter_for, name_pattern

#: Transformers whose weights hold one tensor-parallel shard -> ``(tp_rank, tp_size, sharded layers with their full
#: sizes)`` (kept here, not on the model)
_SHARDS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
#: Transformers loaded as a shard by :func:`load_sharded_transformer`: their whole weights never existed here
_LOADED_SHARDED: weakref.WeakSet = weakref.WeakSet()
#: Tensor-parallel transformers -> their sharded layers by module name (full sizes), set by :func:`apply`
_LAYERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def shard_of(model: torch.nn.Module) -> tuple[int, int] | None:
    """``(tp_rank, tp_size)`` when ``model`` holds one tensor-parallel shard, else None."""
    held = _SHARDS.get(model)
    return None if held is None else held[:2]


def sharded_layers(model: torch.nn.Module) -> dict[str, "LinearShard"]:
    """The layers :func:`apply` split on ``model``, by module name, with full sizes (empty unless tensor-parallel)."""
    return _LAYERS.get(model, {})


def loaded_sharded(model: torch.nn.Module) -> bool:
    """Whether ``model`` was loaded as a shard (its whole weights were never read, so they cannot come back)."""
    return model in _LOADED_SHARDED


@dataclass(frozen=True)
class LinearShard:
    """How one linear (or norm) is sharded: ``kind`` is colwise, rowwise, packed_rowwise or norm.

    ``norm``: an RMSNorm over the output of a column-parallel linear; its weight is split like that output.

    ``parts`` are the sizes of the sharded dimension's parts (one part unless packed: a column-parallel linear whose
    output is several tensors side by side, or ``packed_rowwise``); each part is split into ``tp`` equal contiguous
    chunks and a rank keeps chunk ``rank`` of every part.
    """

    kind: str
    parts: tuple[int, ...]

    @property
    def dim(self) -> int:
        """The weight dimension that is split: 0 (output rows) for colwise, 1 (input columns) otherwise."""
        return 0 if self.kind in ("colwise", "norm") else 1

    def ranges(self, rank: int, size: int) -> list[tuple[int, int]]:
        """``(start, length)`` of this rank's columns/rows in the full dimension, one range per part."""
        out, start = [], 0
        for part in self.parts:
            chunk = part // size
            out.append((start + rank * chunk, chunk))
            start += part
        return out


def _matching(model: torch.nn.Module, patterns) -> dict[str, list[tuple[str, torch.nn.Module]]]:
    # ``*`` stands for exactly one path segment, so "transformer_blocks.*.attn" never matches
    # "single_transformer_blocks.0.attn" or "transformer_blocks.0.x.attn" (models.base.name_pattern).
    modules = list(model.named_modules())
    found = {p: [(n, m) for n, m in modules if name_pattern(p).match(n)] for p in patterns}
    missing = [p for p, hits in found.items() if not hits and not p.endswith("?")]
    if missing:
        raise ValueError(f"tensor plan of {type(model).__name__} names modules that do not exist: {', '.join(missing)}")
    return found


def resolve_plan(model: torch.nn.Module, plan: TensorPlan, size: int) -> dict[str, LinearShard]:
    """Module name -> :class:`LinearShard` for every linear the plan shards; checks divisibility by ``size``.

    Works on a meta-device model (only shapes are read).
    """
    shards: dict[str, LinearShard] = {}
    for pattern, hits in _matching(model, plan.colwise).items():
        shards.update({n: LinearShard("colwise", (base_layer(m).out_features,)) for n, m in hits})
    for pattern, hits in _matching(model, plan.rowwise).items():
        shards.update({n: LinearShard("rowwise", (base_layer(m).in_features,)) for n, m in hits})
    for kind, packed, side in (("colwise", plan.packed_colwise, "out_features"),
                               ("packed_rowwise", plan.packed_rowwise, "in_features")):
        for pattern, hits in _matching(model, packed).items():
            for name, linear in hits:
                parts = tuple(_part_size(model, name.rpartition(".")[0], p) for p in packed[pattern])
                if sum(parts) != getattr(base_layer(linear), side):
                    raise ValueError(f"{name}: packed parts {packed[pattern]} have {sum(parts)} features, "
                                     f"the linear's {side} are {getattr(base_layer(linear), side)}")
                shards[name] = LinearShard(kind, parts)
    for pattern, hits in _matching(model, plan.equal_parts_colwise).items():
        for name, linear in hits:
            part = _part_size(model, name.rpartition(".")[0], plan.equal_parts_colwise[pattern])
            count, rest = divmod(base_layer(linear).out_features, part)
            if rest:
                raise ValueError(f"{name}: {base_layer(linear).out_features} output features are not whole parts of "
                                 f"{part} ({plan.equal_parts_colwise[pattern]})")
            shards[name] = LinearShard("colwise", (part,) * count)
    for pattern, hits in _matching(model, plan.sharded_norms).items():
        for name, norm in hits:
            if type(norm).__name__ != "RMSNorm":
                raise ValueError(f"{name}: sharded_norms handles RMSNorm, not {type(norm).__name__}")
            shards[name] = LinearShard("norm", (_norm_width(norm),))
    # tp must divide every width it splits, not only the heads: each column-parallel output (attention heads x head
    # dim, the feed-forward's hidden width, each part of a packed projection), each row-parallel input, each sharded
    # norm's width. The error lists the degrees that divide them all.
    for name, shard in shards.items():
        if any(p % size for p in shard.parts):
            attrs = [getattr(module, attr) for pattern, hits in _matching(model, plan.per_rank_attrs).items()
                     for _, module in hits for attr in plan.per_rank_attrs[pattern]]
            common = math.gcd(*(p for s in shards.values() for p in s.parts), *attrs)
            raise ConfigError(f"tp={size} does not divide the {shard.kind} dimension {shard.parts} of {name} (tp must "
                              f"divide every width it splits: heads and feed-forward widths); valid here: "
                              f"{', '.join(str(d) for d in divisors(common) if d <= 64)}")
    return shards


def _part_size(model: torch.nn.Module, parent: str, path: str) -> int:
    """The features of one packed part named ``path`` from the linear's parent (the module at ``parent``): a linear
    (its output features) or an integer attribute (``inner_dim``, ``linear_out.in_features``); each leading ``../``
    starts one module higher (Mochi's SwiGLU ``ff.net.0.proj`` reads ``../2.in_features``: ``ff.net.2``'s input)."""
    while path.startswith("../"):
        parent, path = parent.rpartition(".")[0], path[3:]
    value = model.get_submodule(parent)
    for attr in path.split("."):
        value = getattr(value, attr)
    return value if isinstance(value, int) else base_layer(value).out_features


def _norm_width(norm: torch.nn.Module) -> int:
    """Normalized width of a torch (``normalized_shape``) or diffusers (``dim``) RMSNorm."""
    shape = norm.normalized_shape if hasattr(norm, "normalized_shape") else norm.dim
    if len(shape) != 1:
        raise ValueError(f"sharded_norms handles RMSNorm over one dimension, not {tuple(shape)}")
    return shape[0]


def shard_slices(shard: LinearShard, param: str, rank: int, size: int) -> tuple[int, list[tuple[int, int]]] | None:
    """(dim, ranges) of the parameter ``param`` ("weight"/"bias") a rank keeps; None when it stays whole.

    The bias of a row-parallel linear stays whole: it is added once, after the all-reduce.
    """
    if param == "weight":
        return shard.dim, shard.ranges(rank, size)
    if shard.kind == "colwise":
        return 0, shard.ranges(rank, size)
    return None  # row-parallel bias (a norm has no bias: RMSNorm)


def take(t: torch.Tensor, dim: int, ranges: list[tuple[int, int]]) -> torch.Tensor:
    """The given ranges of ``t`` along ``dim``, concatenated into a new tensor (never a view of ``t``)."""
    return torch.cat([t.narrow(dim, start, length) for start, length in ranges], dim=dim)


# -- peft's LoRA layers (as diffusers' load_lora_weights injects them) -----------------------------------------
# A LoRA layer takes the place of a linear and holds it as ``base_layer``, with one ``lora_A`` (rank x in) and one
# ``lora_B`` (out x rank) linear per adapter: out = base(x) + scale * B(A(x)). Recognised by that shape, so the
# core does not import peft. Under tensor parallelism the adapter is split like the layer it adapts: a
# column-parallel layer keeps its rows of B (and of B's bias), A whole; a row-parallel layer keeps its columns of
# A (per packed part), B whole, and A's product (rank wide) is summed over the group with its own all-reduce, so
# B and B's bias act on the full A(x) and everything after it is replicated. A fused (merged) adapter lives in
# the base weight and is split with it; peft's merge and unmerge then work on the shards.


def lora_layer(module: torch.nn.Module) -> bool:
    """Whether ``module`` is a peft LoRA layer: a ``base_layer`` and ``lora_A`` / ``lora_B`` per adapter."""
    return hasattr(module, "base_layer") and isinstance(getattr(module, "lora_A", None), torch.nn.ModuleDict)


def base_layer(module: torch.nn.Module) -> torch.nn.Module:
    """The layer a LoRA layer adapts (``module`` itself when it is not one)."""
    while lora_layer(module):
        module = module.base_layer
    return module


def _slot(model: torch.nn.Module, name: str) -> tuple[torch.nn.Module, str]:
    """(owner, attribute) that holds the base layer of module ``name``: its innermost LoRA layer, or its parent."""
    module = model.get_submodule(name)
    if not lora_layer(module):
        parent, _, attr = name.rpartition(".")
        return model.get_submodule(parent), attr
    while lora_layer(module.base_layer):
        module = module.base_layer
    return module, "base_layer"


def check_lora(name: str, module: torch.nn.Module) -> None:
    """Refuse LoRA variants whose arithmetic is not split like plain LoRA (DoRA's norm reads whole rows)."""
    if not lora_layer(module):
        return
    variants = set(getattr(module, "lora_variant", None) or ())
    variants |= {adapter for adapter, on in getattr(module, "use_dora", {}).items() if on}
    if variants:
        raise ConfigError(f"{name}: adapter {', '.join(sorted(variants))} is a LoRA variant (such as DoRA) that "
                          "cannot be split over tensor-parallel ranks; use plain LoRA, or tp=1 with sequence parallelism")


def lora_tensors(module: torch.nn.Module, shard: LinearShard) -> list[tuple[torch.nn.Module, str, int]]:
    """``(linear, parameter, dim)`` of every LoRA tensor of ``module`` split like its layer (none for norms)."""
    if not lora_layer(module) or shard.kind == "norm":
        return []
    if shard.kind == "colwise":
        return [(lin, p, 0) for lin in module.lora_B.values() for p in ("weight", "bias")
                if lin._parameters.get(p) is not None]
    return [(lin, "weight", 1) for lin in module.lora_A.values()]


def _sync_features(module: torch.nn.Module) -> None:
    # peft builds new adapters from the LoRA layer's in/out_features: keep them those of the (sharded) base
    if lora_layer(module):
        base = base_layer(module)
        module.in_features, module.out_features = base.in_features, base.out_features
        for lin in [*module.lora_A.values(), *module.lora_B.values()]:
            lin.out_features, lin.in_features = lin.weight.shape


def partition_bytes(model: torch.nn.Module, plan: TensorPlan, size: int) -> tuple[int, int]:
    """``(replicated, sharded)`` parameter bytes of the full model under ``plan``.

    Each tensor-parallel rank holds exactly ``replicated + sharded // size`` bytes of parameters.
    """
    shards = resolve_plan(model, plan, size)
    replicated = sharded = 0
    for name, p in model.named_parameters():
        module, _, param = name.rpartition(".")
        nbytes = p.numel() * p.element_size()
        if module in shards and shard_slices(shards[module], param, 0, size) is not None:
            sharded += nbytes
        else:
            replicated += nbytes
    return replicated, sharded


def parameter_bytes(model: torch.nn.Module) -> int:
    """Bytes of ``model``'s parameters on this rank."""
    return sum(p.numel() * p.element_size() for p in model.parameters())


def _set_param(module: torch.nn.Module, param: str, value: torch.Tensor) -> None:
    module._parameters[param] = torch.nn.Parameter(value, requires_grad=False)


def _resize(module: torch.nn.Module, shard: LinearShard, factor_num: int, factor_den: int) -> None:
    if shard.kind == "norm":
        attr = "normalized_shape" if hasattr(module, "normalized_shape") else "dim"
        width = getattr(module, attr)[0] * factor_num // factor_den
        setattr(module, attr, (width,) if attr == "normalized_shape" else torch.Size((width,)))
        return
    attr = "out_features" if shard.kind == "colwise" else "in_features"
    setattr(module, attr, getattr(module, attr) * factor_num // factor_den)


def _divide_attrs(model: torch.nn.Module, plan: TensorPlan, size: int) -> None:
    for pattern, hits in _matching(model, plan.per_rank_attrs).items():
        for _, module in hits:
            for attr in plan.per_rank_attrs[pattern]:
                value = getattr(module, attr)
                if value % size:
                    raise ConfigError(f"tp={size} does not divide {attr}={value} of {type(module).__name__}")
                setattr(module, attr, value // size)


def shard_model(model: torch.nn.Module, plan: TensorPlan, rank: int, size: int, read=None) -> dict[str, LinearShard]:
    """Turn ``model`` (in place) into tensor-parallel rank ``rank`` of ``size``: slice weights, patch head counts.

    ``read(param_name, dim, ranges)`` supplies each sharded tensor (``ranges`` None: the whole tensor); by
    default the slice is taken from the model's own full parameter. Installs no collective: see :func:`apply`.
    """
    shards = resolve_plan(model, plan, size)
    for name in shards:
        check_lora(name, model.get_submodule(name))
    for name, shard in shards.items():
        wrapper = model.get_submodule(name)
        module = base_layer(wrapper)
        for param in ("weight", "bias"):
            if module._parameters.get(param) is None:
                continue
            where = shard_slices(shard, param, rank, size)
            if where is None:
                continue
            full_name = f"{name}.{param}"
            if read is not None:
                value = read(full_name, *where)
            else:
                value = take(module._parameters[param].detach(), *where)
            _set_param(module, param, value)
        _resize(module, shard, 1, size)
        for lin, param, dim in lora_tensors(wrapper, shard):
            _set_param(lin, param, take(lin._parameters[param].detach(), dim, shard.ranges(rank, size)))
        _sync_features(wrapper)
    _divide_attrs(model, plan, size)
    _SHARDS[model] = (rank, size, shards)
    return shards


#: torch's hook tables of a module: a swapped-in module shares those of the module it replaces
_HOOK_TABLES = ("_forward_pre_hooks", "_forward_pre_hooks_with_kwargs", "_forward_hooks", "_forward_hooks_with_kwargs",
                "_forward_hooks_always_called")


class _Swapped(torch.nn.Module):
    """A module put in the place of another (``replaced``), sharing its Parameters and its torch hooks.

    The hook tables are the replaced module's own dicts, so a hook registered on either (before or after the
    swap) runs on whichever is in place, and its handle removes it from both. ``replaced`` is kept outside the
    module tree (it is not a submodule), and :meth:`restore` gives it back with the current Parameters.
    """

    def _take_place_of(self, replaced: torch.nn.Module) -> None:
        object.__setattr__(self, "replaced", replaced)
        for table in _HOOK_TABLES:
            object.__setattr__(self, table, getattr(replaced, table))

    def restore(self) -> torch.nn.Module:
        """The replaced module, holding this module's Parameters (an adapter may have set new ones)."""
        for name, param in self._parameters.items():
            setattr(self.replaced, name, param)
        return self.replaced


class RowParallelLinear(_Swapped, torch.nn.Linear):
    """A row-parallel linear: this rank's input columns, ONE all-reduce of the partial product, the bias once.

    It takes the place of the sharded ``nn.Linear`` under the same attribute and shares its ``weight`` and
    ``bias`` Parameters, so parameter names stay those of the checkpoint; the bias is whole on every rank,
    so it goes in once, after the sum. It also takes the place of the ``lora_A`` linears of a row-parallel
    LoRA layer (see "peft's LoRA layers" above).
    """

    def __init__(self, linear: torch.nn.Linear, group):
        torch.nn.Module.__init__(self)
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight, self.bias = linear.weight, linear.bias
        # forward names the group (a string a compiled block's saved artifact keeps, where a group object is not)
        self.group, self.group_name = group, group.group_name
        self._take_place_of(linear)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = all_reduce_sum(F.linear(x, self.weight), self.group_name)
        return out if self.bias is None else out + self.bias


class ShardedRMSNorm(_Swapped):
    """RMSNorm over a feature dimension split across the tensor-parallel ranks (Wan's QK-norms under tp).

    This rank holds ``local`` of the ``full`` features (and the matching slice of the weight). The mean of
    squares is over all ``full`` features: the sum of local squares, ``[..., 1]``, is summed over the group
    with ONE all-reduce and divided by ``full``. Computed in float32 and cast back before the weight, as
    ``torch.nn.functional.rms_norm`` does. It takes the place of the ``RMSNorm`` module under the same
    attribute and shares its ``weight`` Parameter, so parameter names stay those of the checkpoint.
    """

    def __init__(self, norm: torch.nn.Module, full: int, group):
        super().__init__()
        self.weight = norm.weight  # None when not elementwise_affine
        self.eps, self.full, self.group, self.group_name = norm.eps, full, group, group.group_name
        self._take_place_of(norm)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        square_sum = all_reduce_sum(xf.pow(2).sum(-1, keepdim=True), self.group_name)
        eps = torch.finfo(x.dtype).eps if self.eps is None else self.eps
        out = (xf * torch.rsqrt(square_sum / self.full + eps)).type_as(x)
        return out if self.weight is None else out * self.weight


def apply(model: torch.nn.Module, mesh: ParallelMesh, adapter: ModelAdapter) -> list:
    """Make ``model`` tensor-parallel over the mesh's tp axis (shard it unless it is loaded sharded). Undo callables.

    Does nothing (and returns ``[]``) when tp is 1. Raises :class:`ConfigError` when the family has no
    tensor plan, or when the ulysses degree exceeds the heads left on a tensor-parallel rank.
    """
    size = mesh.size("tp")
    if size == 1:
        return []
    if adapter.tensor_plan is None:
        raise ConfigError(f"{type(model).__name__} has no tensor-parallel plan; use tp=1 and sequence parallelism")
    rank, group, plan = mesh.rank("tp"), mesh.group("tp"), adapter.tensor_plan
    loaded = shard_of(model)
    if loaded is not None and loaded != (rank, size):
        raise ConfigError(f"the transformer was loaded as tensor-parallel shard {loaded} (rank, degree) but this rank "
                          f"is ({rank}, {size}) on the mesh; load with tp_rank = global rank % tp")
    if loaded is None:
        shards = shard_model(model, plan, rank, size)
    else:
        shards = _SHARDS[model][2]  # already sliced by load_sharded_transformer, with the full sizes it resolved
    local_heads = adapter.num_heads(model) // size
    if mesh.size("ulysses") > local_heads:
        raise ConfigError(f"ulysses={mesh.size('ulysses')} exceeds the {local_heads} heads a tp={size} rank holds; "
                          f"use ulysses <= {local_heads} or a smaller tp")
    remove_all_reduces = install_all_reduces(model, shards, group)
    head_hooks = [module.register_forward_hook(functools.partial(_local_heads, dim=dim, rank=rank, size=size))
                  for pattern, hits in _matching(model, plan.head_outputs).items() for _, module in hits
                  for dim in (plan.head_outputs[pattern],)]
    head_hooks += [module.register_forward_pre_hook(_head_inputs_hook(module.forward, dims, rank, size),
                                                    with_kwargs=True)
                   for pattern, hits in _matching(model, plan.head_inputs).items() for _, module in hits
                   for dims in (plan.head_inputs[pattern],)]
    _LAYERS[model] = shards

    def undo():
        _LAYERS.pop(model, None)
        remove_all_reduces()
        for hook in head_hooks:
            hook.remove()
        if loaded_sharded(model):
            raise RuntimeError(f"{type(model).__name__} was loaded as tensor-parallel shard {rank} of {size} "
                               "(load_sharded_transformer), so its whole weights never existed on this rank and "
                               "cannot be restored; the collectives are removed, load the model again to run it whole")
        unshard_model(model, plan, shards, rank, size, group)

    return [undo]


def _local_heads(module, args, out, dim: int, rank: int, size: int):
    """A ``head_outputs`` module's output (a tensor, or a tuple of them) cut to this rank's heads along ``dim``."""
    return _heads_of(out, dim, rank, size)


def _heads_of(value, dim: int, rank: int, size: int):
    """``value`` (a tensor, or a tuple or dict of them; None as is) cut to this rank's heads along ``dim``: views, so a
    write into them lands in ``value``."""
    if isinstance(value, tuple):
        return tuple(_heads_of(t, dim, rank, size) for t in value)
    if isinstance(value, dict):
        return {key: _heads_of(t, dim, rank, size) for key, t in value.items()}
    if value is None:
        return None
    heads = value.shape[dim] // size
    return value.narrow(dim, rank * heads, heads)


def _head_inputs_hook(forward, dims: dict[str, int], rank: int, size: int):
    """A forward pre-hook giving a ``head_inputs`` module its inputs named in ``dims`` cut to this rank's heads."""

    def pre_hook(module, args, kwargs):
        named = bind_kwargs(forward, args, kwargs)
        if not any(named.get(name) is not None for name in dims):
            return None
        return (), {k: (_heads_of(v, dims[k], rank, size) if k in dims else v) for k, v in named.items()}

    return pre_hook


def install_all_reduces(model: torch.nn.Module, shards: dict[str, LinearShard], group):
    """Give every row-parallel linear of ``shards`` its all-reduce (bias added after it) and swap every sharded
    norm for a :class:`ShardedRMSNorm`; returns the undo callable.

    Both swaps put a module sharing the original's Parameters under the same attribute (the base layer's slot
    inside a LoRA layer), so parameter names stay those of the checkpoint. The ``lora_A`` linears of a
    row-parallel LoRA layer get their all-reduce too (:func:`reduce_lora_inputs`). ``shards`` holds full sizes.
    The undo looks at the model as it is then, so it also finds what an adapter loaded or unloaded since.
    """
    for name, shard in shards.items():
        owner, attr = _slot(model, name)
        if shard.kind in ("rowwise", "packed_rowwise"):
            setattr(owner, attr, RowParallelLinear(getattr(owner, attr), group))
            reduce_lora_inputs(model.get_submodule(name), group)
        elif shard.kind == "norm":
            setattr(owner, attr, ShardedRMSNorm(getattr(owner, attr), shard.parts[0], group))

    def undo():
        for name in shards:
            owner, attr = _slot(model, name)
            if isinstance(getattr(owner, attr), _Swapped):
                setattr(owner, attr, getattr(owner, attr).restore())
            module = model.get_submodule(name)
            if lora_layer(module):
                for key, lin in module.lora_A.items():
                    if isinstance(lin, _Swapped):
                        module.lora_A[key] = lin.restore()

    return undo


def reduce_lora_inputs(module: torch.nn.Module, group) -> None:
    """Sum the product of every ``lora_A`` of a row-parallel LoRA layer over the group (one all-reduce each)."""
    if lora_layer(module):
        for key, lin in module.lora_A.items():
            if not isinstance(lin, RowParallelLinear):
                module.lora_A[key] = RowParallelLinear(lin, group)


def _gather_shards(local: torch.Tensor, dim: int, shard: LinearShard, size: int, group) -> torch.Tensor:
    """The whole tensor from every rank's shard along ``dim`` (one all-gather), parts back in model order."""
    gathered = all_gather_uneven(local, dim, [local.size(dim)] * size, group)
    # gathered is rank-major [r0 part0, r0 part1, r1 part0, ...]; the model wants part-major.
    chunks = gathered.split([p // size for _ in range(size) for p in shard.parts], dim=dim)
    n = len(shard.parts)
    return torch.cat([chunks[r * n + i] for i in range(n) for r in range(size)], dim=dim)


def unshard_model(model, plan: TensorPlan, shards: dict[str, LinearShard], rank: int, size: int, group) -> None:
    """Gather the full weights back on every rank (the inverse of :func:`shard_model`; one all-gather per tensor)."""
    for name, shard in shards.items():
        wrapper = model.get_submodule(name)
        module = base_layer(wrapper)
        for param in ("weight", "bias"):
            where = shard_slices(shard, param, rank, size) if module._parameters.get(param) is not None else None
            if where is not None:
                local = module._parameters[param].detach()
                _set_param(module, param, _gather_shards(local, where[0], shard, size, group))
        _resize(module, shard, size, 1)
        for lin, param, dim in lora_tensors(wrapper, shard):
            _set_param(lin, param, _gather_shards(lin._parameters[param].detach(), dim, shard, size, group))
        _sync_features(wrapper)
    for pattern, hits in _matching(model, plan.per_rank_attrs).items():
        for _, module in hits:
            for attr in plan.per_rank_attrs[pattern]:
                setattr(module, attr, getattr(module, attr) * size)
    _SHARDS.pop(model, None)


# -- loading only this rank's shard ---------------------------------------------------------------------------


def _safetensors_files(folder: Path) -> dict[str, Path]:
    """Tensor name -> file, for a single-file or index-sharded diffusers model folder."""
    from safetensors import safe_open

    indexes = sorted(folder.glob("*.safetensors.index.json"))
    if indexes:
        weight_map = json.loads(indexes[0].read_text())["weight_map"]
        return {name: folder / file for name, file in weight_map.items()}
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{folder} has no .safetensors weights; sharded (tp) and stage (pp) loading read safetensors")
    out = {}
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            out.update({k: file for k in f.keys()})
    return out


@contextlib.contextmanager
def _parameters_on_meta():
    """Build modules with their parameters on the meta device and their buffers real (on the CPU).

    Non-persistent buffers (Wan's RoPE tables, SD3's position table) are not in the checkpoint, so the
    constructor must compute them; parameters are replaced by meta tensors as they are registered, so no
    weight is initialised or kept (like accelerate's ``init_empty_weights(include_buffers=False)``).
    """
    register = torch.nn.Module.register_parameter

    def register_on_meta(module, name, param):
        if param is not None and not param.is_meta:
            param = torch.nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
        register(module, name, param)

    torch.nn.Module.register_parameter = register_on_meta
    try:
        yield
    finally:
        torch.nn.Module.register_parameter = register


def _load_dtype(name: str, t: torch.Tensor, dtype: torch.dtype | None, keep_fp32: tuple[str, ...]) -> torch.dtype:
    """The dtype tensor ``name`` gets: ``dtype`` for floating tensors (float32 inside a keep-fp32 module)."""
    if dtype is None or not t.is_floating_point():
        return t.dtype
    return torch.float32 if any(m in name.split(".") for m in keep_fp32) else dtype


class MetaLoad:
    """A transformer built on the meta device from a pipeline folder, and what reads its tensors from safetensors.

    ``folder`` is a pipeline folder (with ``transformer/``, or the ``component`` folder such as ``transformer_2/``),
    the transformer folder itself, or a hub id (its transformer files only are fetched). :meth:`read` reads one
    tensor (or ranges of it along ``dim``, with ``safe_open(...).get_slice``) cast to ``dtype`` on ``device``;
    :meth:`finish` reads every parameter not set yet (except those in ``skip``), places the buffers, and returns the
    model in eval mode.
    """

    def __init__(self, folder, component: str, device, dtype: torch.dtype | None):
        import diffusers

        if not Path(folder).exists():  # a hub id: fetch the transformer's files only
            from huggingface_hub import snapshot_download

            folder = snapshot_download(str(folder), allow_patterns=[f"{component}/*"])
        folder = Path(folder)
        if (folder / component / "config.json").is_file():
            folder = folder / component
        config = json.loads((folder / "config.json").read_text())
        cls = getattr(diffusers, config["_class_name"])
        with _parameters_on_meta():
            self.model = cls.from_config(config)
        self.folder = folder  # the transformer's own folder
        self.files = _safetensors_files(folder)
        self.device, self.dtype = torch.device(device), dtype
        # As diffusers' from_pretrained: the modules in _keep_in_fp32_modules stay float32 under a lower dtype.
        self.keep_fp32 = tuple(getattr(cls, "_keep_in_fp32_modules", None) or ())
        self.handles: dict[Path, object] = {}

    def read(self, name: str, dim: int | None = None, ranges=None, keep_dtype: bool = False) -> torch.Tensor:
        """``keep_dtype``: the stored dtype (8-bit weights and their float32 scales), not the model's."""
        from safetensors import safe_open

        file = self.files[name]
        if file not in self.handles:
            self.handles[file] = safe_open(str(file), framework="pt", device="cpu")
        view = self.handles[file].get_slice(name)
        if ranges is None:
            t = view[:]
        else:
            index = (slice(None),) * dim
            t = torch.cat([view[index + (slice(s, s + n),)] for s, n in ranges], dim=dim)
        return t.to(device=self.device, dtype=t.dtype if keep_dtype else _load_dtype(name, t, self.dtype, self.keep_fp32))

    def finish(self, skip: set[str]) -> torch.nn.Module:
        model, device, dtype = self.model, self.device, self.dtype
        for name, param in list(model.named_parameters()):
            if name not in skip:
                module, _, attr = name.rpartition(".")
                _set_param(model.get_submodule(module), attr, self.read(name))
        for name, buf in list(model.named_buffers()):  # computed by the constructor (RoPE tables, position tables)
            module, _, attr = name.rpartition(".")
            owner = model.get_submodule(module)
            if buf.is_floating_point() and any(m in name.split(".") for m in self.keep_fp32):
                owner._buffers[attr] = buf.to(device)
            else:
                owner._buffers[attr] = buf.to(device=device, dtype=_load_dtype(name, buf, dtype, ()))
        self.handles.clear()
        return model.eval()


def load_sharded_transformer(folder, tp_rank: int, tp_size: int, device, dtype: torch.dtype | None = None,
                             component: str = "transformer"):
    """Load a pipeline's transformer so that this rank materialises only its tensor-parallel shard.

    The model is instantiated on the meta device; each parameter is then read from the safetensors files
    with ``safe_open(...).get_slice`` (only this rank's rows/columns of a sharded linear, the whole tensor
    otherwise), cast to ``dtype`` and placed on ``device``. Peak device memory stays at the shard size.
    ``folder``: see :class:`MetaLoad`. Pass the result to
    ``pipe`` and call :func:`ditmesh.parallelize`; it installs the all-reduces without slicing again.
    """
    load = MetaLoad(folder, component, device, dtype)
    model = load.model
    adapter = adapter_for(model)
    if adapter.tensor_plan is None:
        raise ConfigError(f"{type(model).__name__} has no tensor-parallel plan")
    shards = shard_model(model, adapter.tensor_plan, tp_rank, tp_size, read=load.read)
    _LOADED_SHARDED.add(model)
    sharded = {f"{n}.{p}" for n, s in shards.items() for p in ("weight", "bias")
               if shard_slices(s, p, tp_rank, tp_size) is not None}
    return load.finish(sharded)


# -- text encoders: encode once per tensor-parallel group, broadcast the embeddings ------------------------------

#: Environment override of the automatic text-encoder choice: ``broadcast`` or ``replicate``.
TEXT_ENCODERS_ENV = "DITMESH_TEXT_ENCODERS"
#: Auto choice: broadcast when the text encoders take more than this share of one device's memory.
BROADCAST_SHARE = 0.02


def text_encoder_modules(pipe) -> dict[str, torch.nn.Module]:
    """The pipeline's text encoders by component name (``text_encoder``, ``text_encoder_2``, ...)."""
    return {k: v for k, v in pipe.components.items() if k.startswith("text_encoder") and isinstance(v, torch.nn.Module)}


def device_memory_bytes(device: torch.device) -> int:
    """Total memory of ``device`` (host RAM for CPU)."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def choose_text_encoding(pipe, device: torch.device) -> str:
    """``broadcast`` (tp rank 0 encodes, the others drop their encoders) or ``replicate`` (every rank encodes).

    Decided from data every rank sees alike (parameter bytes and the device's total memory, identical
    cards assumed), so every rank of a group agrees without exchanging anything. ``$DITMESH_TEXT_ENCODERS``
    overrides it.
    """
    forced = os.environ.get(TEXT_ENCODERS_ENV)
    if forced:
        if forced not in ("broadcast", "replicate"):
            raise ConfigError(f"${TEXT_ENCODERS_ENV}={forced!r}: use broadcast or replicate")
        return forced
    encoder_bytes = sum(parameter_bytes(m) for m in text_encoder_modules(pipe).values())
    return "broadcast" if encoder_bytes > BROADCAST_SHARE * device_memory_bytes(device) else "replicate"


class EncodeOnce(Hook):
    """A pipeline's ``encode_once`` hook around ``encode_prompt``: tp rank 0 encodes, every rank gets its tensors."""

    name = "encode_once"

    def __init__(self, src: int, is_src: bool, group, device: torch.device):
        self.src, self.is_src, self.group, self.device = src, is_src, group, device

    def __call__(self, owner, call_next, args, kwargs):
        result = call_next(args, kwargs) if self.is_src else None
        return broadcast_tensors(result, self.src, self.group, self.device)


def encode_once(pipe, mesh: ParallelMesh) -> list:
    """Under tp > 1 with the ``broadcast`` choice, hook ``pipe.encode_prompt`` so that rank 0 of the tp group
    encodes and broadcasts every tensor it returns; the other ranks move their text encoders to the CPU (undo
    puts them back). Undo callables.

    Cross-rank rule: every rank of the tp group calls ``encode_prompt`` with the same arguments (the pipeline
    call does so), and the structure of the result (which entries are tensors, their shapes) comes from
    the source rank.
    """
    if mesh.size("tp") == 1 or not hasattr(pipe, "encode_prompt") or not text_encoder_modules(pipe):
        return []
    if choose_text_encoding(pipe, mesh.device) != "broadcast":
        return []
    group = mesh.group("tp")
    src = dist.get_global_rank(group, 0)
    is_src = mesh.rank("tp") == 0
    undo = [add_hook(pipe, EncodeOnce(src, is_src, group, mesh.device), method="encode_prompt")]
    if not is_src:
        # The embeddings come from the source rank. The encoders leave the pipeline (so nothing reads their
        # device as the pipeline's) and wait on the CPU until remove() puts them back where they were.
        kept = {name: (module, next(module.parameters()).device) for name, module in text_encoder_modules(pipe).items()}
        for name, (module, _) in kept.items():
            module.to("cpu")
            setattr(pipe, name, None)
        if mesh.device.type == "cuda":
            torch.cuda.empty_cache()

        def put_back():
            for name, (module, device) in kept.items():
                setattr(pipe, name, module.to(device))

        undo.append(put_back)
    return undo
