"""Sana-Video (``models/sana_variants.py``) under every axis on real gloo process groups, against one process: the video
split in whole frames (the Mix-FFN's temporal convolution exchanging one halo frame with each neighbour), the linear
attention's key sums added over the ranks, on diffusers' test configuration and inputs of the class (2 latent frames of
16 x 16: 2 x 64 tokens; two ranks, one frame each) and on 5 latent frames of 6 x 6 (45 tokens: frames of 9 split 3 + 2
or 2 + 1 + 1 + 1), with a per-token timestep; then SanaVideoPipeline through generate."""

from __future__ import annotations

import math

import pytest
import torch

from cases_models import axis_id, transformer_call
from ditmesh.testing import rel_err

ARCH = "sana-video-tiny"  # diffusers' get_init_dict of the class
LAYERS = 2


def inputs_of(shape: str) -> dict:
    g = torch.Generator().manual_seed(0)
    rand = lambda *shape: torch.randn(*shape, generator=g)  # noqa: E731
    if shape == "diffusers":
        return dict(hidden_states=rand(1, 16, 2, 16, 16), encoder_hidden_states=rand(1, 12, 16),
                    timestep=torch.tensor([700.0]), return_dict=False)
    mask = torch.ones(2, 11)
    mask[1, 6:] = 0
    return dict(hidden_states=rand(2, 16, 5, 6, 6), encoder_hidden_states=rand(2, 11, 16), encoder_attention_mask=mask,
                timestep=torch.rand(2, 45, generator=g) * 1000, return_dict=False)


def counts_of(config: dict) -> dict:
    """Per block one all-reduce of the key sums and one halo exchange (two neighbour sends) under any sequence
    parallelism; 6 all-reduces per block under tp (2 row-parallel outputs, 4 sharded QK-norms); one gather per call."""
    if "tp" in config:
        return {"all_reduce": 6 * LAYERS}
    return {"all_reduce": LAYERS, "halo": LAYERS, "all_gather": 1}


CASES = [({"ulysses": 2}, "diffusers"), ({"ring": 2}, "diffusers"), ({"tp": 2}, "diffusers"), ({"ulysses": 2}, "odd"),
         ({"ring": 2}, "odd"), ({"ring": 2, "ulysses": 2}, "odd"), ({"tp": 2}, "odd")]


@pytest.mark.parametrize("config, shape", CASES, ids=lambda c: axis_id(c) if isinstance(c, dict) else c)
def test_sana_video_transformer_matches_single_process(pools, config, shape):
    inputs = inputs_of(shape)
    ref, _ = transformer_call(ARCH, {}, inputs)
    for out, counts in pools(math.prod(config.values())).run(transformer_call, ARCH, config, inputs):
        assert rel_err(out, ref) <= 1e-5
        assert counts == counts_of(config)


def test_sana_video_refuses_fewer_frames_than_ranks_in_one_line(pools):
    from cases_models import refused_call

    for line in pools(4).run(refused_call, ARCH, {"ulysses": 2, "ring": 2}, inputs_of("diffusers")):
        assert line.endswith("128 tokens in rows of 64 cannot go to 4 sequence-parallel ranks; use a video of at least 4 "
                             "latent frames or fewer ranks")


def test_generate_runs_sana_video_as_one_process_does(tmp_path, tiny_checkpoints):
    # SanaVideoPipeline: batched CFG split over cfg 2, each branch's video over ring 2 (3 latent frames: 2 + 1)
    import json

    import diffusers
    from safetensors.torch import load_file

    from cases_models import run_ranks

    path, out = tiny_checkpoints(ARCH), tmp_path / "video.gif"
    run_ranks(["generate", "--model", path, "--frames", "9", "--height", "64", "--width", "64", "--steps", "2",
               "--guidance", "4", "--out", str(out), "--save-latents", str(tmp_path / "latents.safetensors"),
               "--nproc", "4", "--cfg", "2", "--ring", "2"])
    report = json.loads(out.with_name(out.name + ".json").read_text())
    pipe = diffusers.SanaVideoPipeline.from_pretrained(path, dtype=torch.float32)
    pipe.set_progress_bar_config(disable=True)
    want = pipe(prompt=report["prompt"][0], height=64, width=64, frames=9, num_inference_steps=2, guidance_scale=4,
                generator=torch.Generator("cpu").manual_seed(report["seed"]), max_sequence_length=16,
                use_resolution_binning=False, output_type="latent").frames
    assert want.shape[2] == 3  # 9 frames, not the pipeline's default 81 (it names the count `frames`)
    assert rel_err(load_file(str(tmp_path / "latents.safetensors"))["latents"], want) <= 1e-5
