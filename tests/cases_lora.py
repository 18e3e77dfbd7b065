"""LoRA cases run on every rank of a gloo worker pool (module-level so workers can import them), and the maker of
the tiny LoRA files they load."""

from __future__ import annotations

import torch

#: FLUX modules a test LoRA adapts: column-parallel (to_q, add_k_proj, ff.net.0.proj, proj_mlp), row-parallel
#: (to_out.0, ff.net.2), packed row-parallel (the single blocks' proj_out), replicated (norm1.linear) and the
#: model's proj_out, where sequence parallelism gathers
FLUX_TARGETS = ["to_q", "to_k", "to_v", "add_k_proj", "to_out.0", "ff.net.0.proj", "ff.net.2", "proj_mlp",
                "single_transformer_blocks.0.proj_out", "single_transformer_blocks.1.proj_out", "norm1.linear",
                "^proj_out$"]
#: SD3 / Wan: the attention projections and the FFN (column- and row-parallel under tp)
ATTENTION_FFN_TARGETS = ["to_q", "to_k", "to_v", "to_out.0", "ff.net.0.proj", "ff.net.2", "ffn.net.0.proj",
                         "ffn.net.2"]


def make_lora(model: str, path: str, seed: int, rank: int = 4, targets=None, lora_bias: bool = False,
              use_dora: bool = False) -> str:
    """Write a LoRA for the pipeline in folder ``model`` as its pipeline class saves one (peft's format, with the
    adapter's metadata), with random, non-zero A and B; returns the file path."""
    import re

    from peft import LoraConfig
    from peft.utils import get_peft_model_state_dict

    cls = _pipeline_class(model)
    transformer = _transformer_class(model).from_pretrained(model, subfolder="transformer")
    targets = targets or FLUX_TARGETS
    names = [n for n, m in transformer.named_modules() if isinstance(m, torch.nn.Linear)
             and any(re.search(t if t.startswith("^") else rf"(^|\.){re.escape(t)}$", n) for t in targets)]
    config = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=names, lora_bias=lora_bias, use_dora=use_dora)
    transformer.add_adapter(config)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in transformer.named_parameters():
            if "lora_" in name:  # peft starts B at zero: a LoRA that changes nothing could not fail a test
                p.copy_(torch.randn(p.shape, generator=g) * 0.2)
    state = get_peft_model_state_dict(transformer)
    cls.save_lora_weights(path, transformer_lora_layers=state, transformer_lora_adapter_metadata=config.to_dict(),
                          weight_name="lora.safetensors")
    return f"{path}/lora.safetensors"


def _model_index(model: str) -> dict:
    import json
    from pathlib import Path

    return json.loads((Path(model) / "model_index.json").read_text())


def _pipeline_class(model: str):
    import diffusers

    return getattr(diffusers, _model_index(model)["_class_name"])


def _transformer_class(model: str):
    import diffusers

    return getattr(diffusers, _model_index(model)["transformer"][1])


def _run(pipe, call: dict, steps: int):
    from cases_models import call_kwargs

    final = {}
    kwargs = {"prompt": "a red circle", **call_kwargs(final, steps, 64, 64, None, 32, 3.5), **call}
    pipe(**kwargs)
    return final["latents"]


def lora_case(model: str, config: dict, loras: list, plan: list, before: bool = False, prefuse: float | None = None,
              fuse_qkv: bool = False, call: dict | None = None, steps: int = 2, count: bool = False,
              load: dict | None = None) -> dict:
    """Load ``loras`` ([(file, adapter name)]) into the pipeline in ``model``, before or after ``parallelize(config)``
    (``prefuse``: then ``fuse_lora(lora_scale=prefuse)``, before parallelize when ``before``), and run one pipeline
    call after each entry of ``plan``. Returns ``latents`` (one per entry), ``counts`` (collectives of each call when
    ``count``), the transformer's ``state`` after the last entry, and how many attention layers have ``fused``
    Q/K/V projections.

    ``load``: more arguments of ``load_lora_weights`` (Wan 2.2's ``load_into_transformer_2``). ``plan`` entries: ``("run",)``, ``("adapters", names, weights)`` (set_adapters), ``("fuse", scale)``
    (fuse_lora), ``("unfuse",)``, ``("disable",)``, ``("enable",)``, ``("unload",)``, ``("fuse_unload",)`` (generate's
    ``--fuse-lora``: fused, then peft's layers taken out), ``("remove",)`` (ditmesh.remove). ``lora_layers``: peft's
    LoRA layers left in the transformer after the last entry.
    """
    from ditmesh import ParallelConfig, parallelize
    from ditmesh.comm import count_collectives
    from ditmesh.parallel.tensor import lora_layer
    from ditmesh.parallel.lora import fuse as fuse_loras

    torch.manual_seed(0)
    pipe = _pipeline_class(model).from_pretrained(model, dtype=torch.float32)
    pipe.set_progress_bar_config(disable=True)

    def load_all():
        for file, name in loras:
            pipe.load_lora_weights(file, adapter_name=name, **(load or {}))
        if prefuse is not None:
            pipe.fuse_lora(lora_scale=prefuse)

    if before:
        load_all()
    runtime = parallelize(pipe, ParallelConfig(**config), fuse_qkv=fuse_qkv)
    if not before:
        load_all()
    actions = {"adapters": lambda names, weights: pipe.set_adapters(names, weights),
               "fuse": lambda scale: pipe.fuse_lora(lora_scale=scale), "unfuse": pipe.unfuse_lora,
               "disable": pipe.disable_lora, "enable": pipe.enable_lora, "unload": pipe.unload_lora_weights,
               "fuse_unload": lambda: fuse_loras(pipe), "remove": runtime.remove, "run": lambda: None}
    latents, counts = [], []
    for kind, *args in plan:
        actions[kind](*args)
        with count_collectives() as counted:
            latents.append(_run(pipe, call or {}, steps))
        counts.append(dict(counted))
    return dict(latents=latents, counts=counts if count else None,
                state={k: v.clone() for k, v in pipe.transformer.state_dict().items()},
                fused=sum(getattr(m, "fused_projections", False) is True for m in pipe.transformer.modules()),
                lora_layers=sum(lora_layer(m) for m in pipe.transformer.modules()))


def hook_on_row_parallel_case(model: str) -> dict:
    """A forward hook put on a linear that tensor parallelism swaps (row-parallel ``to_out.0``) before
    ``parallelize``: does it still run, on the whole (all-reduced) output, and is it there after ``remove``?"""
    from ditmesh import ParallelConfig, parallelize

    pipe = _pipeline_class(model).from_pretrained(model, dtype=torch.float32)
    pipe.set_progress_bar_config(disable=True)
    linear = pipe.transformer.transformer_blocks[0].attn.to_out[0]
    seen = []
    handle = linear.register_forward_hook(lambda m, args, out: seen.append(out.shape[-1]))
    runtime = parallelize(pipe, ParallelConfig(tp=2))
    _run(pipe, {}, 1)
    during = list(seen)
    runtime.remove()
    seen.clear()
    _run(pipe, {}, 1)
    after = list(seen)
    handle.remove()
    seen.clear()
    _run(pipe, {}, 1)
    return dict(during=during, after=after, removed=seen, width=linear.out_features)


def switch_case(model: str, config: dict, loras: list, choices: list, call: dict | None = None, steps: int = 2,
                compile_blocks: bool = False) -> dict:
    """``serve``'s per-request adapters: ``loras`` ([(file, name, scale)]) loaded by ``parallelize`` as named
    LoraSpecs, a :class:`~ditmesh.parallel.lora.Switch` over them, and one call per entry of ``choices`` (an
    adapter's name, or None) after selecting it. ``compile_blocks``: every transformer block compiled first (dynamo
    with the eager backend); ``graphs`` counts the graphs dynamo made after the first call and after the last.
    Returns ``latents`` (one per choice) and ``switch_s`` (seconds of each selection)."""
    import time

    from ditmesh import ParallelConfig, RunOptions, parallelize
    from ditmesh.options import LoraSpec
    from ditmesh.parallel.lora import Switch

    torch.manual_seed(0)
    pipe = _pipeline_class(model).from_pretrained(model, dtype=torch.float32)
    pipe.set_progress_bar_config(disable=True)
    specs = [LoraSpec(file, scale, name) for file, name, scale in loras]
    parallelize(pipe, RunOptions.create(ParallelConfig(**config), loras=specs))
    switch = Switch(pipe, [s.name for s in specs], [s.scale for s in specs], set())
    counters = None
    if compile_blocks:
        from torch._dynamo.utils import counters

        torch._dynamo.reset()
        for blocks in (pipe.transformer.transformer_blocks, pipe.transformer.single_transformer_blocks):
            for block in blocks:
                block.compile(backend="eager")
    latents, switch_s, graphs = [], [], []
    for choice in choices:
        start = time.perf_counter()
        switch.select(choice)
        switch_s.append(time.perf_counter() - start)
        latents.append(_run(pipe, call or {}, steps))
        if counters is not None:
            graphs.append(counters["stats"]["unique_graphs"])
    return dict(latents=latents, switch_s=switch_s, graphs=graphs)
