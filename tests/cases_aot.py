"""Compiled blocks kept between processes (``ditmesh.aot``): rank functions for tests/test_aot.py (module-level for
the workers)."""

from __future__ import annotations

import gc
import os


CALL = dict(prompt="a red circle", height=64, width=64, max_sequence_length=32)


def aot_round_trip(model: str, config: dict, options: dict, root: str, call: dict | None = None, steps: int = 2,
                   modes=("eager", "save", "load")) -> dict:
    """Runs of the pipeline in folder ``model`` under ``config`` and ``options``, each of ``modes`` in turn: without
    compile (``eager``), compiled the ordinary way (``off``), compiled with the blocks saved to ``root`` (``save``),
    then, after dynamo forgets everything it traced, with them loaded (``load``). Each run's latents, dynamo's frame
    count and what it saved, loaded and fell back on."""
    import torch._dynamo
    from diffusers import DiffusionPipeline
    from torch._dynamo.utils import counters

    from ditmesh import ParallelConfig, aot, parallelize, remove

    os.environ["DITMESH_CACHE"] = root  # artifact_folder's root: $DITMESH_CACHE/compile/aot
    out = {}
    pipe = DiffusionPipeline.from_pretrained(model, dtype=torch.float32)
    pipe.set_progress_bar_config(disable=True)
    try:
        for mode in modes:
            gc.collect()  # the runtimes the last run left (a new one takes the smallest free id, as in a new process)
            torch._dynamo.reset()
            counters.clear()
            for entries in aot.STATS.values():
                entries.clear()
            compiled = {} if mode == "eager" else {"compile": True, "compile_artifacts": mode}
            parallelize(pipe, ParallelConfig(**config), **compiled, **options)
            try:
                latents = pipe(**CALL, **(call or {}), num_inference_steps=steps, generator=torch.Generator().manual_seed(3),
                               output_type="latent").images
            finally:
                remove(pipe)
            out[mode] = {"latents": latents, "frames": int(counters["frames"]["total"]),
                         "loaded": sorted(name for name, _ in aot.STATS["loaded"]),
                         "saved": sorted(name for name, _ in aot.STATS["saved"]),
                         "fallbacks": list(aot.STATS["fallbacks"])}
    finally:
        os.environ.pop("DITMESH_CACHE", None)
    return out
