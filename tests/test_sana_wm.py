"""Sana-WM (``models/sana_wm.py``) on real gloo process groups, against one process: the video split in whole frames,
each self-attention's token-mixing ops (the gated delta nets' scans, the temporal short convolutions, the softmax
attentions, both with the camera branch) run on every token of the rank's heads between two all-to-alls, the QK-norms'
sums of squares added over the ranks, the feed-forward's temporal convolution given a halo frame. On diffusers' test
configuration and inputs of the class (4 latent frames of 8 x 8) and on an awkward one (3 heads that 2 does not divide,
short convolutions on Q, K and V; 5 frames of 3 x 5, split 3 + 2, under a frame mask and a text mask); then
SanaWMPipeline through generate."""

from __future__ import annotations

import math

import pytest
import torch

from cases_models import axis_id, refused_call, transformer_call
from ditmesh.testing import rel_err

TINY, ODD = "sana-wm-tiny", "sana-wm-tiny-3h"


def inputs_of(shape: str) -> dict:
    from ditmesh.models.sana_wm import camera_conditions

    g = torch.Generator().manual_seed(0)
    rand = lambda *shape: torch.randn(*shape, generator=g)  # noqa: E731
    if shape == "diffusers":  # get_dummy_inputs of diffusers' test, with Plucker rays of the synthetic arch's width
        return dict(hidden_states=rand(1, 4, 4, 8, 8),
                    timestep=torch.randint(0, 1000, (1, 1, 4), generator=g).float(),
                    encoder_hidden_states=rand(1, 1, 16, 16), encoder_attention_mask=torch.ones(1, 16, dtype=torch.long),
                    camera_conditions=camera_conditions(1, 4, 8, 8), chunk_plucker=rand(1, 12, 4, 8, 8),
                    return_dict=False)
    text_mask = torch.ones(2, 11)
    text_mask[1, 6:] = 0
    frames = torch.ones(2, 5)
    frames[0, 4] = 0  # the last frame padded (the last rank's), and the first of the second rank under ulysses 2
    frames[1, 3] = 0
    inputs = dict(hidden_states=rand(2, 4, 5, 3, 5), timestep=torch.rand(2, 1, 5, generator=g) * 1000,
                  encoder_hidden_states=rand(2, 1, 11, 16), encoder_attention_mask=text_mask,
                  camera_conditions=camera_conditions(2, 5, 3, 5), chunk_plucker=rand(2, 12, 5, 3, 5),
                  return_dict=False)
    if shape == "masked":
        inputs["frame_valid_mask"] = frames
    if shape == "no-camera":
        del inputs["camera_conditions"], inputs["chunk_plucker"]
    return inputs


def counts_of(arch: str, config: dict) -> dict:
    """Per gated-delta-net block (block 0) 2 all-to-alls and 1 all-reduce (the QK-norms' sums of squares), per softmax
    block (block 1) 2 all-to-alls, per block 1 halo exchange, 1 all-gather per call; cfg and dp: 1 all-gather."""
    if "ulysses" not in config:
        return {"all_gather": 1}
    return {"all_to_all": 4, "all_reduce": 1, "halo": 2, "all_gather": 1}


CASES = [(TINY, {"ulysses": 2}, "diffusers"), (ODD, {"ulysses": 2}, "odd"),
         (ODD, {"ulysses": 2}, "masked"), (ODD, {"ulysses": 2}, "no-camera"), (ODD, {"ulysses": 3}, "masked"),
         (ODD, {"cfg": 2}, "masked"), (ODD, {"dp": 2}, "odd")]


@pytest.mark.parametrize("arch, config, shape", CASES, ids=lambda c: axis_id(c) if isinstance(c, dict) else c)
def test_sana_wm_transformer_matches_single_process(pools, arch, config, shape):
    inputs = inputs_of(shape)
    ref, _ = transformer_call(arch, {}, inputs)
    for out, counts in pools(math.prod(config.values())).run(transformer_call, arch, config, inputs):
        assert rel_err(out, ref) <= 1e-5
        assert counts == counts_of(arch, config)


def test_sana_wm_cases_could_fail():
    # the inputs the cases rely on change the output: the frame mask, the camera, the short convolutions' weights
    odd, masked, plain = (transformer_call(ODD, {}, inputs_of(s))[0] for s in ("odd", "masked", "no-camera"))
    assert rel_err(masked, odd) > 1e-2 and rel_err(plain, odd) > 1e-2
    from ditmesh.synth import build_transformer

    model = build_transformer(ODD, seed=0, dtype=torch.float32)
    with torch.no_grad():
        before = model(**inputs_of("odd"))[0]
        for conv in ("conv_q", "conv_k", "conv_v", "conv_k_cam"):  # a filter of another shape (a scale the norm undoes)
            weight = getattr(model.blocks[0].attn, conv).weight
            kept = weight.clone()
            weight[..., 0].mul_(-3)
            assert rel_err(model(**inputs_of("odd"))[0], before) > 1e-3
            weight.copy_(kept)


RING_REFUSAL = "does not run sana-wm: its gated delta nets scan every frame of a head in order"


@pytest.mark.parametrize("config, line", [
    ({"ring": 2}, f"ring=2 {RING_REFUSAL}"),
    ({"ring": 2, "ulysses": 2}, f"ring=2 {RING_REFUSAL}"),
    ({"tp": 2}, "SanaWMTransformer3DModel has no tensor-parallel plan; use tp=1 and sequence parallelism"),
], ids=["ring2", "ring2-ulysses2", "tp2"])
def test_sana_wm_refuses_ring_usp_and_tp_in_one_line(pools, config, line):
    for got in pools(math.prod(config.values())).run(refused_call, TINY, config, inputs_of("diffusers")):
        assert got.startswith(line) and "\n" not in got


def test_sana_wm_refuses_fewer_frames_than_ranks_in_one_line(pools):
    inputs = inputs_of("odd")
    two = dict(inputs, camera_conditions=inputs["camera_conditions"][:, :2],
               **{k: inputs[k][:, :, :2] for k in ("hidden_states", "timestep", "chunk_plucker")})
    for got in pools(3).run(refused_call, ODD, {"ulysses": 3}, two):
        assert got.endswith("30 tokens in rows of 15 cannot go to 3 sequence-parallel ranks; use a video of at least "
                            "3 latent frames or fewer ranks")


def test_generate_runs_sana_wm_as_one_process_does(tmp_path, tiny_checkpoints):
    # SanaWMPipeline from a first frame along generate's default camera (a forward walk, a centred pinhole): batched
    # CFG split over cfg 2, each branch's video over ulysses 2 (9 frames: 5 latent frames of 8 x 8, split 3 + 2)
    import json

    import diffusers
    import numpy as np
    from PIL import Image
    from safetensors.torch import load_file

    from cases_models import run_ranks

    path, out, first = tiny_checkpoints(TINY), tmp_path / "video.gif", tmp_path / "first.png"
    Image.fromarray((np.random.RandomState(0).rand(24, 40, 3) * 255).astype("uint8")).save(first)
    run_ranks(["generate", "--model", path, "--image", str(first), "--frames", "9", "--height", "16", "--width", "16",
               "--steps", "2", "--guidance", "4", "--out", str(out), "--save-latents", str(tmp_path / "latents.st"),
               "--nproc", "4", "--cfg", "2", "--ulysses", "2"])
    report = json.loads(out.with_name(out.name + ".json").read_text())
    assert out.exists()
    pipe = diffusers.SanaWMPipeline.from_pretrained(path, dtype=torch.float32)
    pipe.set_progress_bar_config(disable=True)
    want = pipe(image=Image.open(first).convert("RGB"), prompt=report["prompt"][0], action="w-9",
                intrinsics=[16.0, 16.0, 8.0, 8.0], height=16, width=16, num_frames=9, num_inference_steps=2,
                guidance_scale=4, generator=torch.Generator("cpu").manual_seed(report["seed"]), max_sequence_length=16,
                output_type="latent").frames
    assert want.shape == (1, 4, 5, 8, 8)
    assert rel_err(load_file(str(tmp_path / "latents.st"))["latents"], want) <= 1e-5


def test_generate_refuses_sana_wm_without_a_first_frame_in_one_line(tiny_checkpoints):
    from cases_models import generate_refusal

    path = tiny_checkpoints(TINY)
    assert generate_refusal(path, "--steps", "2").endswith(
        f"--model {path}: SanaWMPipeline generates from an image; give --image PATH")


def test_remove_gives_back_the_sana_wm_pipeline(pools, tiny_checkpoints):
    # the family's own hooks (every block's frame cut, every self-attention's head-parallel forward) come off too
    import numpy as np
    from PIL import Image

    from cases_hooks import remove_restores_case

    first = Image.fromarray((np.random.RandomState(0).rand(24, 40, 3) * 255).astype("uint8"))
    extra = dict(image=first, action="w-9", intrinsics=[16.0, 16.0, 8.0, 8.0], height=16, width=16, num_frames=9,
                 max_sequence_length=16, guidance_scale=4.0)
    for diffs, parallel_err, after_remove in pools(2).run(remove_restores_case, tiny_checkpoints(TINY),
                                                             {"ulysses": 2}, extra=extra):
        assert diffs == [] and parallel_err <= 1e-5 and after_remove == 0.0
