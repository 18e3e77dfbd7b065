"""LoRA adapters loaded into a parallelized pipeline: ``pipe.load_lora_weights(...)`` as usual, after ``parallelize``.

LoRA is weights. Under sequence, CFG and data parallelism every rank holds the whole model, so an adapter
loads as it would on one process; the sequence split and gather points follow a linear that peft wraps (see
``parallel.sequence``). Under tensor parallelism the model's linears hold one shard, so a full-size adapter
cannot go into them as it is. The ``lora`` hooks cut it on its way in:

- around the pipeline's ``lora_state_dict`` (which ``load_lora_weights`` calls first, and which converts the
  other LoRA formats into peft's): the transformer's LoRA tensors come out already cut to this rank's part,
  so the shape checks that follow (FLUX's expansion of Control LoRA layers) see matching shapes;
- around each transformer's ``load_lora_adapter``: a state dict given there directly is cut the same way
  (a tensor already cut is left as it is), and after peft has made the new LoRA layers, the ``lora_A`` of each
  row-parallel one gets its all-reduce.

How each tensor is cut is ``parallel.tensor``'s ("peft's LoRA layers"): B's rows for a column-parallel layer,
A's columns for a row-parallel one. An adapter loaded *before* ``parallelize`` is split there, with the base
weights. Afterwards, ``fuse_lora``, ``unfuse_lora``, ``set_adapters``, ``disable_lora`` and
``unload_lora_weights`` are peft's own, on the shards.

Fused Q/K/V projections (``parallelize(fuse_qkv=True)``) compute Q, K and V without calling ``to_q``, so
an adapter loaded on them afterwards would be skipped: that load is refused (an adapter loaded before is fine:
adapted attention layers are not fused).

Cross-rank rule: every rank loads the same adapters in the same order (as every rank calls ``pipe(...)``
alike); ``remove()`` gathers the adapters' shards back with one all-gather per tensor.
"""

from __future__ import annotations

import re
from pathlib import Path

import torch

from ..config import ConfigError
from ..hooks import Hook, add_hook
from ..mesh import ParallelMesh
from .tensor import LinearShard, check_lora, reduce_lora_inputs, sharded_layers, take

#: a LoRA tensor's key: the adapted module, which factor (A / B; ``down`` / ``up`` in older diffusers files),
#: an optional adapter name, and the parameter
_KEY = re.compile(r"^(?P<module>.+)\.(?:lora_(?P<ab>[AB])(?:\.[^.]+)?|lora[._](?P<du>down|up))"
                  r"\.(?P<param>weight|bias)$")


def shard_state_dict(state_dict: dict, layers: dict[str, LinearShard], rank: int, size: int) -> dict:
    """``state_dict`` with the LoRA tensors of sharded layers cut to tensor-parallel rank ``rank`` of ``size``.

    Keys may carry one component prefix (``transformer.``). B (``up``) of a column-parallel layer keeps its
    rows, A (``down``) of a row-parallel layer its columns; a tensor that does not have the layer's full size
    on that dimension (already cut) and every other tensor are passed on as they are.
    """
    out = {}
    for key, value in state_dict.items():
        match = _KEY.match(key)
        if match is not None and isinstance(value, torch.Tensor):
            name = match["module"]
            if name not in layers and "." in name:
                name = name.split(".", 1)[1]
            shard = layers.get(name)
            factor = match["ab"] or ("A" if match["du"] == "down" else "B")
            dim = {("colwise", "B"): 0, ("rowwise", "A"): 1, ("packed_rowwise", "A"): 1}.get(
                (shard.kind, factor)) if shard is not None else None
            if dim is not None and dim < value.ndim and value.shape[dim] == sum(shard.parts):
                value = take(value, dim, shard.ranges(rank, size))
        out[key] = value
    return out


def _fused(model: torch.nn.Module) -> list[str]:
    return [name for name, module in model.named_modules() if getattr(module, "fused_projections", False) is True]


class LoadAdapter(Hook):
    """A transformer's ``lora`` hook around ``load_lora_adapter`` (see the module's docstring)."""

    name = "lora"

    def __init__(self, rank: int, size: int, group):
        self.rank, self.size, self.group = rank, size, group

    def __call__(self, owner, call_next, args, kwargs):
        fused = _fused(owner)
        if fused:
            raise ConfigError(f"{type(owner).__name__} computes Q/K/V with fused projections ({fused[0]} and "
                              f"{len(fused) - 1} more), which would skip a LoRA loaded on to_q/to_k/to_v now; load the "
                              "LoRA before parallelize, or parallelize without fuse_qkv")
        layers = sharded_layers(owner)
        if layers:
            source = args[0] if args else kwargs.get("pretrained_model_name_or_path_or_dict")
            if not isinstance(source, dict):
                raise ConfigError(f"{type(owner).__name__} is tensor-parallel: load a LoRA file through the pipeline's "
                                  "load_lora_weights (or pass load_lora_adapter a state dict), so it is cut to this "
                                  "rank's shard")
            if any("lora_magnitude_vector" in key or "dora_scale" in key for key in source):
                raise ConfigError("a DoRA adapter (magnitude vectors) cannot be split over tensor-parallel ranks: its "
                                  "norm reads whole weight rows; use plain LoRA, or tp=1 with sequence parallelism")
            source = shard_state_dict(source, layers, self.rank, self.size)
            args, kwargs = ((source,) + tuple(args[1:]), kwargs) if args else \
                ((), {**kwargs, "pretrained_model_name_or_path_or_dict": source})
        result = call_next(args, kwargs)
        for name, shard in layers.items():
            module = owner.get_submodule(name)
            check_lora(name, module)
            if shard.kind in ("rowwise", "packed_rowwise"):
                reduce_lora_inputs(module, self.group)
        return result


class CutStateDict(Hook):
    """A pipeline's ``lora`` hook around ``lora_state_dict``: the transformer's LoRA tensors cut to this rank."""

    name = "lora"

    def __init__(self, transformer: torch.nn.Module, rank: int, size: int):
        self.transformer, self.rank, self.size = transformer, rank, size

    def __call__(self, owner, call_next, args, kwargs):
        result = call_next(args, kwargs)
        layers = sharded_layers(self.transformer)
        if isinstance(result, tuple):  # (state_dict, network_alphas?, metadata?)
            return (shard_state_dict(result[0], layers, self.rank, self.size),) + result[1:]
        return shard_state_dict(result, layers, self.rank, self.size)


def apply(pipe, models: dict[str, torch.nn.Module], mesh: ParallelMesh) -> list:
    """Install the ``lora`` hooks on the transformers that can load adapters, and under tp > 1 on the pipeline's
    ``lora_state_dict``. Undo callables."""
    rank, size = mesh.rank("tp"), mesh.size("tp")
    group = mesh.group("tp") if size > 1 else None
    undo = [add_hook(model, LoadAdapter(rank, size, group), method="load_lora_adapter")
            for model in models.values() if hasattr(model, "load_lora_adapter")]
    transformer = models.get(getattr(pipe, "transformer_name", "transformer"))
    if size > 1 and transformer is not None and hasattr(pipe, "lora_state_dict"):
        undo.append(add_hook(pipe, CutStateDict(transformer, rank, size), method="lora_state_dict"))
    return undo


def load(pipe, loras) -> list[str]:
    """Load each :class:`~ditmesh.options.LoraSpec` as an adapter (its name, else ``lora<i>``) and activate them all
    with their scales; returns the names.

    ``parallelize`` calls it last, on every rank alike, so under tensor parallelism each rank keeps its shard.
    """
    if not loras:
        return []
    if not hasattr(pipe, "load_lora_weights"):
        raise ConfigError(f"--lora: {type(pipe).__name__} cannot load LoRA weights (diffusers has no LoRA loader "
                          "for it)")
    names = [lora.name or f"lora{i}" for i, lora in enumerate(loras)]
    for name, lora in zip(names, loras):
        local = Path(lora.path).expanduser()
        pipe.load_lora_weights(str(local) if local.exists() else lora.path, adapter_name=name)
    pipe.set_adapters(names, [lora.scale for lora in loras])
    return names


def fuse(pipe) -> None:
    """Fuse the active adapters, with the weights ``set_adapters`` gave them, into the weights of every component
    that holds one, then take peft's LoRA layers out, so the model is plain modules again and runs as the base model
    does (one GEMM per linear, no wrapper for a compiled block to guard on or trace through).

    Under tensor parallelism peft's merge computes ``B @ A`` from the shards, which is this rank's shard of the whole
    delta (``ditmesh.parallel.lora``), and taking the wrappers out puts back the sharded base layers with their
    collectives. Each diffusers model is unloaded by its own ``unload_lora`` rather than the pipeline's
    ``unload_lora_weights``, which for FLUX would also put back the normalization weights a LoRA replaced.
    """
    from diffusers.models.modeling_utils import ModelMixin
    from diffusers.utils import recurse_remove_peft_layers
    from peft.tuners.tuners_utils import BaseTunerLayer

    components = [name for name in pipe._lora_loadable_modules if isinstance(getattr(pipe, name, None), torch.nn.Module)
                  and any(isinstance(m, BaseTunerLayer) for m in getattr(pipe, name).modules())]
    pipe.fuse_lora(components=components)
    for name in components:
        model = getattr(pipe, name)
        if isinstance(model, ModelMixin):
            model.unload_lora()
        else:  # a transformers text encoder: what diffusers' unload does for it
            recurse_remove_peft_layers(model)
            if getattr(model, "peft_config", None) is not None:
                del model.peft_config
                model._hf_peft_config_loaded = None


class Switch:
    """Adapters loaded together, one (or none) of them chosen per pipeline call without touching the compiled or
    captured code: every adapter stays active in peft, and each LoRA layer multiplies an adapter's output by a
    0-dim tensor on the layer's device instead of peft's Python float. Choosing an adapter writes those tensors in
    place (its scale, 0 for the others), so a compiled block sees the same graph inputs (no guard fails, nothing
    recompiles) and a CUDA graph reads the values at replay (nothing is captured again).

    ``fixed`` adapters are on in every call, at their scale; the others are on only when chosen. A layer adds
    ``0 * B(A(x))`` for an adapter that is off, which leaves its output exactly as without that adapter (the
    adapters' outputs are finite), so a call equals one with only the chosen (and fixed) adapters loaded.

    Cross-rank rule: every rank chooses the same adapter before the same call.
    """

    def __init__(self, pipe, names: list[str], scales: list[float], fixed: set[str]):
        from peft.tuners.lora import LoraLayer

        self.scales = dict(zip(names, scales))
        self.fixed = set(fixed)
        self.choices = [n for n in names if n not in self.fixed]
        pipe.set_adapters(names, [1.0] * len(names))  # each layer's scaling is now its unit: alpha / r
        #: (adapter, unit scaling, device) -> the 0-dim tensor its layers multiply by
        self.slots: dict[tuple, torch.Tensor] = {}
        for component in pipe.components.values():
            if not isinstance(component, torch.nn.Module):
                continue
            for module in component.modules():
                if not isinstance(module, LoraLayer):
                    continue
                for name in names:
                    if name in module.scaling and name in module.lora_A:
                        key = (name, float(module.scaling[name]), module.lora_A[name].weight.device)
                        if key not in self.slots:
                            self.slots[key] = torch.zeros((), dtype=torch.float32, device=key[2])
                        module.scaling[name] = self.slots[key]
        self.chosen: str | None = None
        self.select(None)

    def select(self, name: str | None) -> None:
        """Turn ``name`` on (None: only the fixed adapters) and every other chosen-per-call adapter off."""
        if name is not None and name not in self.choices:
            raise ValueError(f"no adapter {name!r}; the adapters are: {', '.join(self.choices)}")
        for (adapter, unit, _), value in self.slots.items():
            on = adapter in self.fixed or adapter == name
            value.fill_(unit * self.scales[adapter] if on else 0.0)
        self.chosen = name
