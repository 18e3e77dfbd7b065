"""Functions run on every rank of a gloo worker pool for the chunked feed-forward tests."""

from __future__ import annotations

import torch


def chunked_output(model_path: str, config: dict, chunk_tokens, size: int = 64, frames: int | None = None,
                   remove: bool = False):
    """One denoising step's transformer output under ``config`` with feed-forwards chunked, the number of hooked
    modules, and (``remove``) whether ``ditmesh.remove`` gave back modules without a ``chunk`` hook."""
    from diffusers import DiffusionPipeline

    from ditmesh import ParallelConfig, parallelize
    from ditmesh.hooks import find_hook
    from ditmesh.models import adapter_for

    pipe = DiffusionPipeline.from_pretrained(model_path, dtype=torch.float32)
    model = pipe.transformer
    adapter = adapter_for(model)
    inputs = adapter.example_inputs(model, height=size, width=size, batch=1, text_len=8,
                                    generator=torch.Generator().manual_seed(5), device=torch.device("cpu"),
                                    dtype=torch.float32, **({"frames": frames} if frames else {}))
    runtime = parallelize(pipe, ParallelConfig(**config), chunk_tokens=chunk_tokens)
    hooked = sum(find_hook(m, "chunk") is not None for m in model.modules())
    # every block's feed-forward, and nothing else
    assert hooked == (sum(type(m).__name__ == "FeedForward" for m in model.modules()) if chunk_tokens else 0)
    with torch.no_grad():
        out = model(**inputs)[0]
    if chunk_tokens:  # the sequences were longer than a piece: some calls really ran in pieces
        assert sum(find_hook(m, "chunk").split_calls for m in model.modules() if find_hook(m, "chunk")) > 0
    if remove:
        runtime.remove()
        return out, hooked, sum(find_hook(m, "chunk") is not None for m in model.modules())
    return out, hooked
