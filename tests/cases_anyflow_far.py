"""AnyFlow-FAR's autoregressive rollout at the transformer level, run on every rank of a gloo pool (or in one process):
the calls AnyFlowFARPipeline makes, chunk by chunk, through one K/V cache."""

from __future__ import annotations

import copy

import torch

#: (chunk partition, latent height, latent width, batch, text tokens) of each input case; the partitions are the
#: archs' own (``anyflow-far-tiny``: 4 chunks of 1, the last 3 full; ``anyflow-far-tiny3``: 2, 1, 2, the last 2 full)
SHAPES = {"diffusers": ([1, 1, 1, 1], 16, 16, 1, 12), "odd": ([2, 1, 2], 6, 6, 2, 7)}


def rollout_inputs(shape: str) -> dict:
    """The latents of every frame (frames-first), the text, and per chunk its source and target timesteps (each frame
    its own, so that a modulation cut at the wrong tokens shows)."""
    partition, height, width, batch, text = SHAPES[shape]
    g = torch.Generator().manual_seed(0)
    frames = sum(partition)
    return dict(latents=torch.randn(batch, frames, 4, height, width, generator=g),
                text=torch.randn(batch, text, 16, generator=g),
                timestep=torch.rand(batch, frames, generator=g) * 900 + 50, partition=partition)


def rollout(arch, config: dict, inputs: dict, model_config: dict | None = None):
    """AnyFlowFARPipeline's calls on this rank under ``config`` (``{}``: one process) by the synthetic ``arch`` (a name
    or a ``SynthArch``) transformer: per chunk a denoising call reading the K/V cache (the chunk at its timesteps,
    ``r`` at 0.6 of them), then, but after the last chunk, the call that writes every chunk so far into the cache under
    the ``cache`` mask; last, the training call over every frame under the ``train`` mask (no cache). Returns (the
    denoising calls' outputs and the training call's, the final K/V cache of every block, the collectives of all
    calls)."""
    from ditmesh import ParallelConfig, parallelize
    from ditmesh.comm import count_collectives
    from ditmesh.models.anyflow import far_kv_cache
    from ditmesh.synth import build_transformer

    model = build_transformer(arch, seed=0, dtype=torch.float32)
    model.register_to_config(**(model_config or {}))
    if config:
        class Pipe:  # parallelize() needs only `.transformer`
            transformer = model

        parallelize(Pipe, ParallelConfig(**config))
    latents, text, timestep, partition = (inputs[k] for k in ("latents", "text", "timestep", "partition"))
    batch, _, _, height, width = latents.shape
    cache = far_kv_cache(model.config, partition, batch, height, width, "cpu", torch.float32)
    flag = {"num_cached_chunks": 0, "is_cache_step": False}
    outs = []
    with torch.no_grad(), count_collectives() as counts:
        for c in range(len(partition)):
            chunk = slice(sum(partition[:c]), sum(partition[:c + 1]))
            t = timestep[:, chunk]
            out, _ = model(hidden_states=latents[:, chunk], timestep=t, r_timestep=0.6 * t, encoder_hidden_states=text,
                           chunk_partition=partition[:c + 1], kv_cache=cache, kv_cache_flag=copy.deepcopy(flag),
                           return_dict=False)
            outs.append(out)
            if c == len(partition) - 1:
                break
            done = slice(0, chunk.stop)
            zero = torch.zeros(batch, chunk.stop)
            mask = model.build_attention_mask(chunk_partition=partition[:c + 1], height=height, width=width,
                                              mode="cache")
            none, _ = model(hidden_states=latents[:, done], timestep=zero, r_timestep=zero,
                            encoder_hidden_states=text, chunk_partition=partition[:c + 1], attention_mask=mask,
                            kv_cache=cache, kv_cache_flag=dict(flag, is_cache_step=True), return_dict=False)
            assert none is None
            flag["num_cached_chunks"] += 1
        mask = model.build_attention_mask(chunk_partition=partition, height=height, width=width, mode="train")
        outs.append(model(hidden_states=latents, timestep=timestep, r_timestep=0.6 * timestep,
                          encoder_hidden_states=text, chunk_partition=partition, attention_mask=mask,
                          return_dict=False)[0])
    return outs, cache, dict(counts)


def refused_rollout(arch: str, config: dict, inputs: dict) -> str | None:
    """:func:`rollout`'s one-line refusal on this rank (None: it ran)."""
    try:
        rollout(arch, config, inputs)
    except (NotImplementedError, ValueError) as error:
        return str(error)
    return None
