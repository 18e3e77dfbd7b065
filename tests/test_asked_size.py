"""`generate` draws the size it is asked for. PixArt, Sana and HunyuanDiT pipelines bin a size to the nearest one
they were trained at and resize the picture afterwards (48x80 asked, 768x1280 computed); ditmesh turns that off,
so the latents and the picture have the asked size. Tiny synthetic pipelines, one step, one process."""

from __future__ import annotations

import pytest
import torch
from diffusers import DiffusionPipeline

from ditmesh.cli import build_parser
from ditmesh.runtime.generate import _call_kwargs
from ditmesh.runtime.models import read_defaults


@pytest.mark.parametrize("arch, height, width", [("pixart-sigma-tiny", 48, 80), ("hunyuan-dit-tiny", 48, 80),
                                                 ("sana-tiny", 96, 160)])  # Sana's DC-AE divides by 32
def test_generate_computes_the_asked_size_not_the_pipelines_bin(tiny_checkpoints, arch, height, width):
    path = tiny_checkpoints(arch)
    args = build_parser().parse_args(["generate", "--model", path, "--prompt", "a red circle", "--steps", "1",
                                      "--height", str(height), "--width", str(width), "--max-sequence-length", "8"])
    pipe = DiffusionPipeline.from_pretrained(path, dtype=torch.float32)
    call = _call_kwargs(pipe, args, read_defaults(path))
    assert call["use_resolution_binning"] is False
    seen = []
    pipe.transformer.register_forward_pre_hook(
        lambda m, a, kw: seen.append((kw["hidden_states"] if "hidden_states" in kw else a[0]).shape[-2:]),
        with_kwargs=True)
    image = pipe(**call).images[0]
    scale = pipe.vae_scale_factor
    assert image.size == (width, height)
    assert seen and all(tuple(s) == (height // scale, width // scale) for s in seen), seen  # computed at that size
