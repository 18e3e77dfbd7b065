"""Functions run on every rank of a gloo pool for the Qwen-Image 2.1 tests: the transformer's calls of a pipeline run,
with the prefix K/V cache carried from the first step to the next, as QwenImage21Pipeline makes them."""

from __future__ import annotations

import torch

ARCH = "qwenimage21-tiny"


def layout_inputs(text_before: int, cond: tuple[int, int], text_between: int, target: tuple[int, int], batch: int = 2,
                  padded: int = 2, seed: int = 1) -> dict:
    """One call's inputs: ``text_before`` encoder positions of text, a condition image of ``cond`` latent tokens (its
    ``2 x 2`` slots), ``text_between`` more text, then the target image of ``target`` tokens; sample 0's last ``padded``
    text positions are padding (``encoder_hidden_states_mask``)."""
    g = torch.Generator().manual_seed(seed)
    cond_slots, target_slots = cond[0] * cond[1] // 4, target[0] * target[1] // 4
    vlm = [False] * text_before + [True] * cond_slots + [False] * text_between
    img_mask = torch.tensor([vlm + [True] * target_slots] * batch)
    text_mask = torch.ones(batch, len(vlm), dtype=torch.bool)
    text_mask[0, len(vlm) - padded:] = False
    latents = (cond_slots + target_slots) * 4
    return dict(hidden_states=torch.randn(batch, latents, 16, generator=g),
                encoder_hidden_states=torch.randn(batch, len(vlm), 32, generator=g),
                encoder_hidden_states_mask=text_mask, timestep=torch.tensor([0.9] * batch),
                img_shapes=[[(1, *cond), (1, *target)]] * batch, img_mask=img_mask, return_dict=False)


def steps(config: dict, inputs: dict, timesteps=(0.9, 0.6), cache: bool = True, branches: int = 1):
    """The transformer's calls of a ``len(timesteps)``-step run (``branches`` calls a step, each branch with its own
    cache, as true CFG makes them) under ``config`` on this rank (``{}``: one process). Returns (every call's output,
    the collectives of all of them)."""
    from diffusers.models.transformers.transformer_qwenimage21 import QwenImage21KVCache

    from ditmesh import ParallelConfig, parallelize
    from ditmesh.comm import count_collectives
    from ditmesh.synth import build_transformer

    model = build_transformer(ARCH, seed=0, dtype=torch.float32)
    if config:
        class Pipe:  # parallelize() needs only `.transformer`
            transformer = model

        parallelize(Pipe, ParallelConfig(**config))
    caches = [QwenImage21KVCache(len(model.transformer_blocks)) if cache else None for _ in range(branches)]
    outs = []
    with torch.no_grad(), count_collectives() as counts:
        for i, t in enumerate(timesteps):
            for b in range(branches):
                mode = None if not cache else ("extract" if i == 0 else "cached")
                call = dict(inputs, timestep=torch.full_like(inputs["timestep"], t) + 0.05 * b, kv_cache=caches[b],
                            kv_cache_mode=mode)
                outs.append(model(**call)[0])
    return outs, dict(counts)
