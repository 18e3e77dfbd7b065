"""Image-conditioned pipeline cases run on every rank of a gloo worker pool (module-level so workers can import them),
and the condition images they read."""

from __future__ import annotations

import torch


def condition_image(height: int = 64, width: int = 64, seed: int = 0):
    """A seeded RGB test image: smooth gradients plus noise, so every latent row differs."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width]
    rgb = np.stack([x * 255 / width, y * 255 / height, (x + y) * 127 / (height + width)], -1)
    rgb = np.clip(rgb + rng.normal(0, 30, rgb.shape), 0, 255).astype(np.uint8)
    return Image.fromarray(rgb)


def condition_mask(height: int = 64, width: int = 64):
    """A mask (white = repaint) over a rectangle that crosses the middle row, where the VAE split cuts."""
    from PIL import Image, ImageDraw

    mask = Image.new("L", (width, height), 0)
    ImageDraw.Draw(mask).rectangle([width // 4, height // 4, 3 * width // 4, 3 * height // 4], fill=255)
    return mask


def image_case(model: str, config: dict, runs: list, steps: int = 4, vae_parallel: str = "auto",
               cache: str | None = None, size: tuple[int, int] = (64, 64), frames: int | None = None,
               options: dict | None = None) -> list[dict]:
    """Each run ``(pipeline class name, call arguments)`` on the pipeline in folder ``model``, loaded with that class
    and parallelized with ``config`` (``{}``: one process). ``call`` may hold ``image`` / ``mask_image`` as
    ``(height, width)`` of :func:`condition_image` / :func:`condition_mask`. The output is ``size`` (height,
    width), with ``frames`` video frames when given. Returns per run the final latents, the
    transformer's inputs' token counts of the first call (``tokens``), the step indices the context saw
    (``steps``), the heights the VAE encoder's first convolution saw on this rank (``encoder_rows``), and with a step
    ``cache`` its decisions (``cache``: (run step, skipped) per call). ``options``: more of parallelize's options
    (PipeFusion's, displaced attention's)."""
    import inspect

    import diffusers

    from ditmesh import ParallelConfig, parallelize

    from ditmesh.models import adapters

    setups = {p.pipeline: p.setup for a in adapters() for p in a.image_pipelines if p.setup}
    results = []
    for class_name, call in runs:
        if class_name in setups:
            setups[class_name]()
        torch.manual_seed(0)
        pipe = getattr(diffusers, class_name).from_pretrained(model, dtype=torch.float32)
        pipe.set_progress_bar_config(disable=True)
        runtime = parallelize(pipe, ParallelConfig(**config), vae_parallel=vae_parallel, cache=cache,
                              **(options or {})) if config or cache else None
        seen, rows = {"tokens": None, "steps": []}, []

        def pre(module, args, kwargs):
            if seen["tokens"] is None:
                seen["tokens"] = kwargs["hidden_states"].shape[1]

        def post(module, args, out):  # after ditmesh's context hook (inside forward) opened this call
            seen["steps"].append(runtime.context.step_index if runtime is not None else None)

        for transformer in (pipe.transformer, getattr(pipe, "transformer_2", None)):
            if transformer is not None:  # Wan 2.2's second expert runs the low-noise steps
                transformer.register_forward_pre_hook(pre, with_kwargs=True)
                transformer.register_forward_hook(post)
        pipe.vae.encoder.conv_in.register_forward_pre_hook(lambda m, args: rows.append(args[0].shape[-2]))
        final = {}

        def grab(p, i, t, kw):
            final["latents"] = kw["latents"].clone()
            return kw

        call = dict(call)
        for key, make in (("image", condition_image), ("mask_image", condition_mask)):
            if key in call:
                call[key] = make(*call[key])
        out_size = dict(height=size[0], width=size[1])
        if frames is not None:
            out_size["num_frames"] = frames
        if "max_area" in inspect.signature(pipe.__call__).parameters:  # an editing pipeline: keep both sizes as given
            out_size.update(max_area=size[0] * size[1], _auto_resize=False)
        kwargs = dict(prompt="a red circle", num_inference_steps=steps, generator=torch.Generator().manual_seed(42),
                      max_sequence_length=32, output_type="latent", callback_on_step_end=grab, **out_size)
        pipe(**{**kwargs, **call})
        decisions = [(h["step"], h["skip"]) for c in runtime.caches.values() for h in c.history] if cache else None
        results.append(dict(latents=final["latents"], encoder_rows=rows, cache=decisions, **seen))
    return results
