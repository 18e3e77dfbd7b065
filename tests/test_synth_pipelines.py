"""The whole synthetic pipelines of the families issue 46 added (``ditmesh synth --arch NAME`` builds their text
encoders, tokenizers and VAEs offline, with seeded random weights): each folder through ``ditmesh generate`` on two
ranks of the shared pool, under the one parallel axis its pipeline calls for, against the same command on one process
(the final latents, float32, rel. err <= 1e-5). One generate pair per family: 2 steps, the smallest sizes. Cosmos is not
here: its pipeline cannot be built offline (synth says why in one line). The pipelines that need torchvision (OmniGen's,
:data:`WITH_TORCHVISION`) run where torchvision imports; where it does not, their one-line refusal is tested instead
(the test extra cannot carry torchvision beside the CPU torch: docs/testing.md)."""

from __future__ import annotations

import json
import re
import wave

import pytest
import torch

from cases_models import run_ranks
from ditmesh.models.base import torchvision_error
from ditmesh.testing import rel_err

#: why torchvision does not import here (None: it does); decides which of each torchvision pair of tests runs
NO_TORCHVISION = torchvision_error()
needs_torchvision = pytest.mark.skipif(NO_TORCHVISION is not None, reason=f"torchvision does not import here "
                                       f"({NO_TORCHVISION}): the pipeline's refusal is tested instead")
needs_no_torchvision = pytest.mark.skipif(NO_TORCHVISION is None, reason="torchvision imports here: the pipeline "
                                          "itself is tested instead of its refusal")

#: architecture -> (the axis of the two-rank run, the size and guidance options of both runs)
CASES = {
    # batched CFG: [uncond, cond] in one call; 4 x 4 image patches and the 32-token text split over the ranks
    "auraflow-tiny": (["--ulysses", "2"], ["--height", "64", "--width", "64", "--guidance", "4"]),
    # batched CFG split over the ranks (one branch each); the v-prediction DDIM scheduler
    "cogview3plus-tiny": (["--cfg", "2"], ["--height", "64", "--width", "64", "--guidance", "4"]),
    # batched CFG ([cond, uncond]); grouped-query heads (4 query, 2 key-value) split over the ranks
    "lumina-next-tiny": (["--ulysses", "2"], ["--height", "64", "--width", "64", "--guidance", "4"]),
    # batched CFG; the text's key padding whole on every rank, odd 3 x 5 patches of image split 8 + 7
    "prx-tiny": (["--ulysses", "2"], ["--height", "48", "--width", "80", "--guidance", "4"]),
    # batched CFG; the empty negative prompt (one token) padded to the prompt's length: the text's key mask and the
    # encoder's layers split with the text; 4 x 6 image tokens
    "bria-fibo-tiny": (["--ulysses", "2"], ["--height", "64", "--width", "96", "--guidance", "4"]),
    # batched CFG; one head: ring attention over the [image, text] sequence (the prompt and the empty negative prompt of
    # different lengths, padded to the longer)
    "ernie-image-tiny": (["--ring", "2"], ["--height", "64", "--width", "64", "--guidance", "4"]),
    # CFG by the pipeline's guider (two calls a step); the 1,000-token padded Qwen prompt and the 4 x 4 image split
    "hunyuan-image-tiny": (["--ulysses", "2"], ["--height", "128", "--width", "128"]),
    # sequential CFG (the prompt's call, then the negative prompt's); the joined [text, image] sequence split over
    # grouped-query heads (4 query, 2 key-value), the text padded in the middle of its template
    "krea2-tiny": (["--ulysses", "2"], ["--height", "64", "--width", "64", "--guidance", "4"]),
    # sequential CFG; 2 latent frames of 3 x 3 patches split over the ranks (the text blocks run whole on each)
    "kandinsky5-tiny": (["--ulysses", "2"], ["--height", "48", "--width", "48", "--frames", "5", "--guidance", "4"]),
    # batched CFG; the global token and 4 latent samples split 3 + 2 over 24 heads (2 key-value heads in the
    # cross-attention); the stereo clip written as a WAV
    "stable-audio-tiny": (["--ulysses", "2"], ["--guidance", "4"]),
    # no CFG (LTX-2 refuses cfg: its transformer returns the audio beside the video); the video split, the audio whole
    # on every rank; its pipeline test's VAE halves each side: 5 latent frames of 16 x 16 tokens
    "ltx-2-tiny": (["--ulysses", "2"], ["--height", "32", "--width", "32", "--frames", "9", "--guidance", "1"]),
    # sequential CFG (Kandinsky 6 refuses cfg: its blocks return the audio beside the video); the video split, the
    # audio whole on every rank, decoded by the MMAudio VAE and vocoder
    "kandinsky6-tiny": (["--ulysses", "2"], ["--height", "48", "--width", "48", "--frames", "5", "--guidance", "4"]),
    # the unconditional branch on a second transformer (both parallelized; Ideogram 4 refuses cfg), --guidance as a
    # constant scale in place of the pipeline's 48-step schedule; [text, image] split with the segment mask
    "ideogram4-tiny": (["--ulysses", "2"], ["--height", "64", "--width", "64", "--guidance", "4"]),
    # a class by its name in the checkpoint's id2label; no CFG (the tiny's 8 classes lack the null class 1000); 4 x 4
    # patches split over 2 heads
    "dit-tiny": (["--ulysses", "2"], ["--prompt", "cat", "--guidance", "1"]),
    # batched CFG; the 60 s clip's latent frames split over grouped-query heads (4 query, 2 key-value) in sliding
    # windows; written as a WAV
    "ace-step-tiny": (["--ulysses", "2"], ["--guidance", "4"]),
    # image to video (the condition image's SigLIP tokens and first latent frame): the pipeline's first window of 9
    # latent frames with its 4x, 2x and 1x history, 2 x 2 tokens a frame, split over 2 heads; distilled guidance
    "hunyuan-video-framepack-tiny": (["--ulysses", "2"], ["--image", "{image}", "--height", "32", "--width", "32",
                                                          "--guidance", "1"]),
    # batched CFG split over the ranks, without a negative prompt (EasyAnimate's call_arguments give the pipeline an
    # empty one: it iterates over a missing one)
    "easyanimate-tiny": (["--cfg", "2"], ["--height", "64", "--width", "64", "--frames", "5", "--guidance", "4"]),
    # -- issue 46, helper i46e's families (JoyImage-Edit, JoyImage-Edit Plus, GLM-Image, Nucleus-MoE) -------------
    # sequential CFG with the empty negative prompt; odd 3 x 5 image tokens split 8 + 7 over 4 heads, the padded
    # text split with them
    "nucleusmoe-image-tiny": (["--ulysses", "2"], ["--height", "48", "--width", "80", "--guidance", "4"]),
    # sequential CFG; the pipeline's nearest bucket of 1024 x 1024 (whatever --height and --width): 64 x 64 image
    # tokens split over 2 heads with the text
    "joyimage-edit-tiny": (["--ulysses", "2"], ["--guidance", "4"]),
    # batched CFG ([uncond, cond], the grids listed twice), the negative prompt padded to the prompt's length under the
    # key mask; odd 3 x 5 image tokens split 8 + 7 over 2 heads
    "joyimage-edit-plus-tiny": (["--ulysses", "2"], ["--height", "48", "--width", "80", "--guidance", "4"]),
    # sequential CFG (the negative prompt's call drops the prior's tokens); the prior's 4 x 4 grid and 16 x 16 preview
    # sampled on every rank from the same seed; the quoted words' ByT5 glyph tokens and 4 x 6 image tokens split
    "glm-image-tiny": (["--ulysses", "2"], ["--prompt", 'a sign that says "hello"', "--height", "64", "--width", "96",
                                            "--guidance", "4"]),
    # -- end of i46e's families ---------------------------------------------------------------------------------
}
#: the audio pipelines (their clips written as WAV): their channels and the VAE's sampling rate
AUDIO = {"stable-audio-tiny": (2, 4), "ace-step-tiny": (2, 4)}

# -- issue 46 item 2, second batch (branch i46f): Helios, Stable Audio 3, LongCat-Audio-DiT ------------------------------
CASES.update({
    # sequential CFG; the pipeline's one chunk of 9 latent frames after its 16 + 2 + 1 history frames (patchified 4x,
    # 2x and 1x coarser), 2 x 2 tokens a frame, split over 2 heads
    "helios-tiny": (["--ulysses", "2"], ["--height", "32", "--width", "32", "--frames", "5", "--guidance", "4"]),
    # sequential CFG; the clip's 26 latent frames (its length read off the default prompt) split 13 + 13 under the
    # whole padding mask; written as a mono WAV at the tiny VAE's 8 Hz
    "longcat-audio-dit-tiny": (["--ulysses", "2"], ["--guidance", "4"]),
    # batched CFG; the 3 memory tokens and the 10 s clip's 40 latent samples split 22 + 21; a stereo WAV at 16 Hz
    "stable-audio-3-tiny": (["--ulysses", "2"], ["--guidance", "4"]),
})
AUDIO.update({"longcat-audio-dit-tiny": (1, 8), "stable-audio-3-tiny": (2, 16)})
# -- end of branch i46f's cases -------------------------------------------------------------------------------------

# -- branch i46j: the pipelines that need torchvision -----------------------------------------------------------------
WITH_TORCHVISION = {
    # batched CFG ([cond, uncond] in one call, OmniGen refuses cfg and dp); the left-padded [prompt, time, image]
    # sequence under its causal-and-image mask, 4 x 4 image patches and the prompts' tokens split over 4 heads
    "omnigen-tiny": (["--ulysses", "2"], ["--height", "64", "--width", "64", "--guidance", "4"]),
    # true CFG (the prompt's call, then the negative prompt's, each extracting its text prefix's K/V on the first step
    # and attending the target's 4 x 4 tokens to it on the second); the joint sequence split under the block-causal mask
    "qwenimage21-tiny": (["--ulysses", "2"], ["--height", "64", "--width", "64", "--negative-prompt", "blurry",
                                              "--true-cfg-scale", "4"]),
    # a condition image (resized to the pipeline's 1024 x 1024 output resolution: 64 x 64 tokens of the prefix, one
    # bidirectional block under the block-causal mask, cached with the text) and the target's 4 x 4 tokens
    "qwenimage21-tiny+image": (["--ulysses", "2"], ["--image", "{image}", "--height", "64", "--width", "64",
                                                    "--negative-prompt", "blurry", "--true-cfg-scale", "4"]),
    # JoyImage-Edit's reference image (the condition image in the prompt through the Qwen3-VL processor, and as a
    # second item of latent frames): sequential CFG; the target's and the reference's 64 x 64 tokens (the 1024 bucket)
    # split over 2 heads with the text
    "joyimage-edit-tiny+image": (["--ulysses", "2"], ["--image", "{image}", "--guidance", "4"]),
}
CASES.update(WITH_TORCHVISION)
# -- end of branch i46j's cases -------------------------------------------------------------------------------------

# -- issue 46, branch i46i: Motif-Video and Bria FIBO 2 --------------------------------------------------------------
CASES.update({
    # sequential CFG (the prompt's call, then the default negative prompt's); odd 3 x 5 image tokens split 8 + 7
    # through the refiner, then joined with the gist tokens through the main blocks
    "bria-fibo2-tiny": (["--ulysses", "2"], ["--height", "48", "--width", "80", "--guidance", "4"]),
    # image to video: the first frame's latents as condition channels and its SigLIP features (the T5Gemma 2 encoder's
    # vision tower) prepended to the text; CFG by the pipeline's guider (two calls a step); 2 latent frames of 6 x 10
    # tokens and the context (image features, then the text padded to the maximum length under its key mask) split
    "motif-video-tiny": (["--ulysses", "2"], ["--image", "{image}", "--height", "48", "--width", "80",
                                              "--frames", "5"]),
})


# -- issue 46, branch i46h: Latte ---------------------------------------------------------------------------------------
CASES.update({
    # batched CFG; 2 frames of 4 x 4 patch positions, each rank the same 8 positions in both frames (the temporal
    # attention local), split over 2 heads
    "latte-tiny": (["--ulysses", "2"], ["--height", "64", "--width", "64", "--frames", "2", "--guidance", "4"]),
})
# -- end of branch i46h's cases -------------------------------------------------------------------------------------


@pytest.mark.parametrize("arch", [pytest.param(arch, marks=needs_torchvision if arch in WITH_TORCHVISION else ())
                                  for arch in CASES])
def test_generate_runs_the_synthetic_pipeline_as_one_process_does(tmp_path, tiny_checkpoints, arch):
    from PIL import Image
    from safetensors.torch import load_file

    axis, options = CASES[arch]
    arch = arch.split("+")[0]  # a second case of one architecture: "NAME+what it adds"
    image = tmp_path / "condition.png"  # the image-to-video pipelines' condition image
    Image.fromarray((torch.rand(32, 32, 3, generator=torch.Generator().manual_seed(0)) * 255).byte().numpy()).save(image)
    options = [str(image) if option == "{image}" else option for option in options]
    command = ["generate", "--model", tiny_checkpoints(arch), "--steps", "2", *options]
    latents = {}
    for name, parallel in (("one", []), ("two", ["--nproc", "2", *axis])):
        out = tmp_path / f"{name}{'.gif' if '--frames' in options else '.wav' if arch in AUDIO else '.png'}"
        run_ranks([*command, "--out", str(out), "--save-latents", str(tmp_path / f"{name}.safetensors"), *parallel])
        report = json.loads(out.with_name(out.name + ".json").read_text())
        assert report["world_size"] == (2 if parallel else 1) and len(report["step_latency_s"]) == 2
        assert out.exists() or out.with_name(f"{name}_frames").is_dir()
        if out.suffix == ".wav":  # the clip's channels at the VAE's sampling rate (the tiny Oobleck VAE's 4 Hz stereo)
            with wave.open(str(out)) as clip:
                assert (clip.getnchannels(), clip.getframerate()) == AUDIO[arch] and clip.getnframes() > 0
        latents[name] = load_file(str(tmp_path / f"{name}.safetensors"))["latents"]
    assert rel_err(latents["two"], latents["one"]) <= 1e-5


def test_dit_takes_its_classes_by_name_or_id_and_refuses_the_rest_in_one_line():
    from ditmesh.models.dit import dit_call_arguments
    from ditmesh.synth import build_pipeline

    pipe = build_pipeline("dit-tiny")
    call = dict(guidance_scale=1.0, num_inference_steps=2)
    assert dit_call_arguments(pipe, dict(call, prompt=["dog", "7"]))["class_labels"] == [1, 7]
    for prompt, guidance, why in (("a cat", 1.0, "give a class name it knows (car, cat, dog, flower, ...) or a class id "
                                                 "from 0 to 7"),
                                  ("8", 1.0, "from 0 to 7"), ("cat", 4.0, "has 8 classes; use --guidance 1")):
        with pytest.raises(ValueError, match=re.escape(why)) as refused:
            dit_call_arguments(pipe, dict(call, prompt=prompt, guidance_scale=guidance))
        assert "\n" not in str(refused.value)


@pytest.mark.parametrize("arch, line", [
    ("hunyuan-video-framepack-tiny", "HunyuanVideoFramepackPipeline generates from an image; give --image PATH"),
    ("flux-fill-tiny", "FluxFillPipeline generates from an image; give --image PATH and --mask PATH")])
def test_a_checkpoint_whose_pipeline_needs_an_image_is_refused_without_one_before_loading(arch, line):
    from cases_models import generate_refusal

    assert generate_refusal(arch, "--steps", "2").endswith(f"--model {arch}: {line}")


# -- branches i46f and i46j: the pipelines that need torchvision, where it does not import -----------------------------
@needs_no_torchvision
@pytest.mark.parametrize("arch, family, why", [
    ("omnigen-tiny", "OmniGen", "OmniGenPipeline's constructor builds its multimodal processor from torchvision's "
                                "transforms"),
    ("qwenimage21-tiny", "Qwen-Image 2.1", "that processor's video processor needs torchvision")])
def test_synth_refuses_a_pipeline_that_needs_torchvision_in_one_line_naming_its_install(tmp_path, capsys, arch,
                                                                                         family, why):
    from ditmesh.cli import main

    assert main(["synth", "--arch", arch, "--out", str(tmp_path / arch)]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and err.startswith(f"ditmesh: error: {arch}: ditmesh builds {family}'s pipeline only where "
                                              "torchvision imports")
    assert why in err and f"here it does not ({NO_TORCHVISION}): pip install torchvision" in err
    assert not (tmp_path / arch).exists()
    # the transformer alone is still built (plan, bench and the transformer-level tests take it)
    from ditmesh.synth import build_transformer

    assert build_transformer(arch).config.num_layers == 2


@needs_no_torchvision
def test_a_reference_image_without_torchvision_is_refused_in_one_line(tmp_path, tiny_checkpoints):
    from PIL import Image

    from cases_models import generate_refusal

    image = tmp_path / "reference.png"
    Image.new("RGB", (32, 32), (200, 40, 40)).save(image)
    line = generate_refusal(tiny_checkpoints("joyimage-edit-tiny"), "--image", str(image), "--steps", "2")
    assert line.endswith("holds a Qwen2Tokenizer in its place; give a checkpoint with one (ditmesh synth writes it "
                         "where torchvision imports)"), line
    assert "--image: JoyImageEditPipeline puts the image in the prompt through a Qwen3VLProcessor" in line
    for arch in ("joyimage-edit-tiny", "qwenimage21-tiny"):  # by name: the pipeline would be built here
        assert generate_refusal(arch, "--image", str(image)).endswith(
            f"through a Qwen3VLProcessor, whose video processor needs torchvision, and torchvision does not import here "
            f"({NO_TORCHVISION}): pip install torchvision (the release built for your torch)")
# -- end of the torchvision refusals ----------------------------------------------------------------------------------
