"""The FLUX.1-shaped families (LongCat-Image, Ovis-Image, Bria, Bria FIBO: ``models/flux_like.py``) on real gloo process groups,
against one process: each transformer at diffusers' own test configuration under Ulysses, ring, USP and tp, on
diffusers' test input sizes and on odd token counts; each pipeline under its CFG mode; one ``generate`` per family."""

from __future__ import annotations

import pytest
import torch

from cases_models import (FamilyRuns, axis_id, call_counts, check_ranks, check_transformer, example_inputs, run_ranks,
                          transformer_call)
from ditmesh.testing import rel_err

FAMILIES = ["longcat-image-tiny", "ovis-image-tiny", "bria-tiny", "bria-fibo-tiny"]
#: (height, width, text tokens): diffusers' test inputs (4 x 4 image tokens, 48 text tokens) and an odd count
#: (3 x 5 image tokens, 11 text tokens) that no degree divides
SIZES = {"diffusers": (64, 64, 48), "odd": (48, 80, 11)}
#: one double and one single block: two attention layers; under tp FLUX's plan all-reduces 4 times in a double block
#: (both attention outputs, both feed-forwards) and once in a single block
LAYERS, ALL_REDUCES = 2, 4 + 1
CASES = [({"ulysses": 2}, "diffusers"), ({"ulysses": 2}, "odd"), ({"ring": 2}, "odd"), ({"ring": 2, "ulysses": 2}, "odd"),
         ({"tp": 2}, "odd")]


def _inputs(arch: str, size: str) -> dict:
    height, width, text = SIZES[size]
    inputs = example_inputs(arch, height, width, text)
    if arch == "bria-fibo-tiny":  # BriaFiboPipeline's key padding over [text, image]: sample 0's last 3 text tokens
        keys = torch.ones(2, text + inputs["hidden_states"].shape[1], dtype=torch.bool)
        keys[0, text - 3:text] = False
        inputs["joint_attention_kwargs"] = {"attention_mask": keys[:, None, None, :]}
    return inputs


@pytest.mark.parametrize("config, size", CASES, ids=lambda c: axis_id(c) if isinstance(c, dict) else c)
@pytest.mark.parametrize("arch", FAMILIES)
def test_flux_like_transformer_matches_single_process(pools, arch, config, size):
    check_transformer(pools, arch, config, _inputs(arch, size), call_counts(config, LAYERS, ALL_REDUCES))


def test_bria_fibo_batched_cfg_splits_the_mask_and_layers(pools):
    # BriaFiboPipeline runs CFG as one call on [uncond, cond]: each cfg rank takes its sample of the latents, of every
    # encoder layer and of the key padding inside joint_attention_kwargs (sample 0 is padded, sample 1 is not)
    inputs = _inputs("bria-fibo-tiny", "odd")
    ref, _ = transformer_call("bria-fibo-tiny", {}, inputs)
    for out, counts in pools(2).run(transformer_call, "bria-fibo-tiny", {"cfg": 2}, inputs):
        assert rel_err(out, ref) <= 1e-5
        assert counts == {"all_gather": 1}


def test_bria_fibo_mask_and_encoder_layers_matter():
    # what the parallel runs split or reorder changes the output: the key padding, the per-block encoder layers
    inputs = _inputs("bria-fibo-tiny", "odd")
    ref, _ = transformer_call("bria-fibo-tiny", {}, inputs)
    assert rel_err(transformer_call("bria-fibo-tiny", {}, dict(inputs, joint_attention_kwargs=None))[0], ref) > 1e-3
    layers = [layer.flip(1) for layer in inputs["text_encoder_layers"]]
    assert rel_err(transformer_call("bria-fibo-tiny", {}, dict(inputs, text_encoder_layers=layers))[0], ref) > 1e-3


def test_flux_like_ids_matter():
    # the split ids carry the positions: the same tokens with the image ids shifted give another output
    inputs = _inputs("bria-tiny", "odd")
    ref, _ = transformer_call("bria-tiny", {}, inputs)
    inputs["img_ids"] = inputs["img_ids"] + 1
    assert rel_err(transformer_call("bria-tiny", {}, inputs)[0], ref) > 1e-3


#: the pipelines' CFG: LongCat-Image and Ovis-Image call the transformer twice a step, Bria once on [uncond, cond]
CALLS_PER_STEP = {"longcat-image-tiny": 2, "ovis-image-tiny": 2, "bria-tiny": 1}
#: both pipelines pad the text to max_sequence_length (15, odd); Ovis-Image at 3 x 5 image tokens, Bria at 4 x 6 (its
#: pipeline rounds sizes to multiples of 32)
RUNS = FamilyRuns({"ovis-image-tiny": dict(height=48, width=80, max_sequence_length=15),
                   "bria-tiny": dict(height=64, width=96, max_sequence_length=15)}, steps=2, guidance_scale=5.0)


@pytest.mark.parametrize("config", [{"cfg": 2}, {"ulysses": 2}], ids=axis_id)
@pytest.mark.parametrize("arch", ["ovis-image-tiny", "bria-tiny"])
def test_flux_like_pipeline_matches_single_process(pools, tiny_checkpoints, arch, config):
    path = tiny_checkpoints(arch)
    calls = CALLS_PER_STEP[arch] * RUNS.steps
    if "cfg" in config:  # the branches exchanged once a step
        counts = {"all_gather": RUNS.steps}
    else:
        counts = {"all_to_all": 2 * LAYERS * calls, "all_gather": calls}
    ref = RUNS.reference(path, arch)
    check_ranks(RUNS.generate(path, config, arch, pools=pools), ref, calls, counts)


@pytest.mark.parametrize("arch", ["ovis-image-tiny", "bria-tiny"])
def test_flux_like_generate_writes_an_image(tmp_path, tiny_checkpoints, arch):
    out = tmp_path / f"{arch}.png"
    run_ranks(["generate", "--model", tiny_checkpoints(arch), "--steps", "2", "--height", "64", "--width", "96",
               "--nproc", "2", "--ulysses", "2", "--guidance", "3", "--out", str(out)])
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_longcat_image_checkpoint_loads_and_encodes(tiny_checkpoints):
    # LongCatImagePipeline rewrites prompts with its text encoder unless told not to, which `generate` does not say:
    # the synthetic checkpoint loads in diffusers and encodes a prompt as the pipeline does before its calls
    from diffusers import LongCatImagePipeline

    pipe = LongCatImagePipeline.from_pretrained(tiny_checkpoints("longcat-image-tiny"), text_processor=None)
    embeds, ids = pipe.encode_prompt(["a red circle"])
    assert embeds.shape == (1, pipe.tokenizer_max_length, 32) and ids.shape == (pipe.tokenizer_max_length, 3)


def test_flux_like_real_sizes():
    from ditmesh.models import adapter_for_class
    from ditmesh.synth import get_arch

    longcat, ovis = get_arch("longcat-image").transformer, get_arch("ovis-image").transformer
    assert (longcat["num_layers"], longcat["num_single_layers"], longcat["joint_attention_dim"]) == (19, 38, 3584)
    assert (ovis["num_layers"], ovis["num_single_layers"], ovis["joint_attention_dim"]) == (6, 27, 2048)
    layout = adapter_for_class("BriaTransformer2DModel").layout(get_arch("bria-3.2").transformer, 1024, 1024, 1, 128)
    assert (layout.image_tokens, layout.split_tokens) == (4096, 4096 + 128)
