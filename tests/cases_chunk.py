"""Functions run on every rank of a gloo worker pool for the chunked feed-forward and attention tests."""

from __future__ import annotations

import torch


def chunked_output(model_path: str, config: dict, chunk_tokens, size: int = 64, frames: int | None = None,
                   remove: bool = False) -> dict:
    """One denoising step's transformer output under ``config`` with feed-forwards and attention chunked: ``out``,
    ``hooked`` (modules with a ``chunk`` hook), ``attention_splits`` (attention calls that ran in pieces),
    ``counts`` (the step's collectives) and, with ``remove``, ``left`` (``chunk`` hooks left after
    ``ditmesh.remove``) and ``processors_back`` (every attention layer has its own processor again)."""
    from diffusers import DiffusionPipeline

    from ditmesh import ParallelConfig, parallelize
    from ditmesh.comm import count_collectives
    from ditmesh.hooks import find_hook
    from ditmesh.models import adapter_for

    pipe = DiffusionPipeline.from_pretrained(model_path, dtype=torch.float32)
    model = pipe.transformer
    adapter = adapter_for(model)
    inputs = adapter.example_inputs(model, height=size, width=size, batch=1, text_len=8,
                                    generator=torch.Generator().manual_seed(5), device=torch.device("cpu"),
                                    dtype=torch.float32, **({"frames": frames} if frames else {}))
    processors = {name: type(attn.processor) for name, attn in adapter.attention_modules(model)}
    runtime = parallelize(pipe, ParallelConfig(**config), chunk_tokens=chunk_tokens)
    hooked = sum(find_hook(m, "chunk") is not None for m in model.modules())
    # every block's feed-forward, and nothing else
    assert hooked == (sum(type(m).__name__ == "FeedForward" for m in model.modules()) if chunk_tokens else 0)
    with torch.no_grad(), count_collectives() as counts:
        out = model(**inputs)[0]
    if chunk_tokens:  # the sequences were longer than a piece: some calls really ran in pieces
        assert sum(find_hook(m, "chunk").split_calls for m in model.modules() if find_hook(m, "chunk")) > 0
    runtimes = {id(attn.processor.sp): attn.processor.sp for _, attn in adapter.attention_modules(model)
                if hasattr(attn.processor, "sp")}
    result = dict(out=out, hooked=hooked, counts=dict(counts),
                  attention_splits=sum(r.query_chunks.split_calls for r in runtimes.values() if r.query_chunks))
    if remove:
        runtime.remove()
        result["left"] = sum(find_hook(m, "chunk") is not None for m in model.modules())
        result["processors_back"] = processors == {n: type(a.processor) for n, a in adapter.attention_modules(model)}
    return result
