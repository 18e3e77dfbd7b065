"""Image-conditioned pipelines (img2img, Kontext editing, inpainting, Fill; Wan image-to-video) under every axis that
applies, each equal to one process; the condition image is VAE-encoded split over the ranks."""

from __future__ import annotations

import json

import pytest
import torch

from cases_image import image_case
from ditmesh.testing import rel_err

TOLERANCE = 1e-5
IMG2IMG = ("FluxImg2ImgPipeline", {"image": (64, 64), "strength": 0.6})
#: a condition image of another size than the output: 16 + 12 image tokens
KONTEXT = ("FluxKontextPipeline", {"image": (48, 64)})
INPAINT = ("FluxInpaintPipeline", {"image": (64, 64), "mask_image": (64, 64), "strength": 0.9})
FILL = ("FluxFillPipeline", {"image": (64, 64), "mask_image": (64, 64)})
CFG = {"negative_prompt": "a blue square", "true_cfg_scale": 4.0}
DP = {"prompt": ["a red circle", "a green square"]}
#: Wan 2.2 I2V-A14B style: 5 frames of 32x32 (2 latent frames of 4x4, 8 tokens), 3 steps over both experts
I2V = ("WanImageToVideoPipeline", {"image": (32, 32)})
VIDEO = dict(size=(32, 32), frames=5, steps=3)


@pytest.fixture(scope="module")
def flux_fill_tiny(tmp_path_factory) -> str:
    from ditmesh.synth import write_checkpoint

    return str(write_checkpoint("flux-fill-tiny", tmp_path_factory.mktemp("ckpt") / "flux-fill-tiny", seed=0,
                                device="cpu"))


@pytest.fixture(scope="module")
def wan_i2v_tiny(tmp_path_factory) -> str:
    from ditmesh.synth import write_checkpoint

    return str(write_checkpoint("wan2.2-i2v-tiny", tmp_path_factory.mktemp("ckpt") / "wan2.2-i2v-tiny", seed=0,
                                device="cpu"))


@pytest.fixture(scope="module")
def wan21_i2v_tiny(tmp_path_factory) -> str:
    from ditmesh.synth import write_checkpoint

    return str(write_checkpoint("wan2.1-i2v-tiny", tmp_path_factory.mktemp("ckpt") / "wan2.1-i2v-tiny", seed=0,
                                device="cpu"))


def _check(pools, model, config, runs, **kwargs):
    ref = image_case(model, {}, runs, **kwargs)
    results = pools(2).run(image_case, model, config, runs, **kwargs)
    errors = []
    for r in results:
        for (cls, _), got, want in zip(runs, r, ref):
            err = rel_err(got["latents"], want["latents"])
            errors.append(err)
            print(f"rel err {cls} {config}: {err:.2e}")
            assert err <= TOLERANCE, (cls, config, err)
    return ref, results, max(errors)


@pytest.mark.parametrize("config", [{"ulysses": 2}, {"ring": 2}, {"tp": 2}], ids=["ulysses2", "ring2", "tp2"])
def test_img2img_kontext_inpaint_match_single_process(pools, flux_tiny, config):
    """Sequence and tensor parallelism: img2img and inpainting start part-way (strength), Kontext's condition tokens
    join the image stream (16 + 12 tokens, split as one stream); the VAE encode runs split over both ranks."""
    runs = [IMG2IMG, KONTEXT, INPAINT]
    ref, results, _ = _check(pools, flux_tiny, config, runs)
    img2img, kontext, inpaint = results[0]
    assert kontext["tokens"] == 16 + 12 and ref[1]["tokens"] == 28
    # img2img starts part-way: 4 steps at strength 0.6 run steps 1..3 of the schedule
    assert img2img["steps"] == [1, 2, 3] and kontext["steps"] == [0, 1, 2, 3]
    assert img2img["encoder_rows"] == [32] and ref[0]["encoder_rows"] == [64]  # the encode was split
    assert inpaint["encoder_rows"] == [32, 32]  # the image and the masked image


@pytest.mark.parametrize("config,call", [({"cfg": 2}, CFG), ({"dp": 2}, DP)], ids=["cfg2", "dp2"])
def test_img2img_and_kontext_batch_parallel_match_single_process(pools, flux_tiny, config, call):
    """True CFG (a negative prompt) split over cfg ranks, two prompts over dp ranks; the cond/uncond branch of each
    call is found from the step index, which starts part-way for img2img."""
    runs = [(cls, {**kw, **call}) for cls, kw in (IMG2IMG, KONTEXT)]
    ref, results, _ = _check(pools, flux_tiny, config, runs)
    if config.get("cfg"):
        assert results[0][0]["steps"] == [1, 1, 2, 2, 3, 3]


#: strength 0.6 of 6 steps runs the scheduler's steps 2..5: the run's steps 0..3
PART_WAY = ("FluxImg2ImgPipeline", {"image": (64, 64), "strength": 0.6})
#: each step-indexed cache policy's decisions (run step, skipped) on such a run, by the rules in the run's steps: a
#: listed step; every other step after the warm-up once two steps ran; teacache's last step always runs; dbcache
#: (a threshold no change reaches) skips from its warm-up on, up to max_skips
PART_WAY_CACHES = {
    "static:skip=1": [(0, False), (1, True), (2, False), (3, False)],
    "taylor:interval=2,warmup=1": [(0, False), (1, False), (2, True), (3, False)],
    "teacache:threshold=100,max_skips=9": [(0, False), (1, True), (2, True), (3, False)],
    "dbcache:threshold=100,warmup=2,max_skips=9": [(0, False), (1, False), (2, True), (3, True)],
}


@pytest.mark.parametrize("cache", list(PART_WAY_CACHES))
def test_step_cache_counts_steps_from_where_img2img_starts(pools, flux_tiny, cache):
    """A run that starts part-way counts its cache steps from its first one, as diffusers' step callbacks do, and
    knows its last: every policy decides on the run's steps, under ulysses as on one process."""
    ref, results, _ = _check(pools, flux_tiny, {"ulysses": 2}, [PART_WAY], steps=6, cache=cache)
    assert results[0][0]["steps"] == [2, 3, 4, 5]
    assert ref[0]["cache"] == results[0][0]["cache"] == results[1][0]["cache"] == PART_WAY_CACHES[cache]


@pytest.mark.parametrize("config, warmup", [({"pp": 2}, "pp_warmup"), ({"ulysses": 2}, "displaced_warmup")],
                         ids=["pipefusion", "displaced"])
def test_stale_schemes_count_their_warmup_from_where_img2img_starts(pools, flux_tiny, config, warmup):
    """PipeFusion's and displaced attention's exact warm-up steps are the run's first steps: a warm-up of 4 covers
    every step of a run of 4 that starts at the scheduler's step 2 (exact: equal to one process); one of 3 leaves
    its last step stale (not equal)."""
    options = {"displaced": True} if warmup == "displaced_warmup" else {}
    _check(pools, flux_tiny, config, [PART_WAY], steps=6, options={**options, warmup: 4})
    ref = image_case(flux_tiny, {}, [PART_WAY], steps=6)[0]["latents"]
    stale = pools(2).run(image_case, flux_tiny, config, [PART_WAY], steps=6, options={**options, warmup: 3})
    assert all(rel_err(r[0]["latents"], ref) > 1e-4 for r in stale)


@pytest.mark.parametrize("config", [{"ulysses": 2}, {"ring": 2}, {"tp": 2}, {"dp": 2}],
                         ids=["ulysses2", "ring2", "tp2", "dp2"])
def test_fill_matches_single_process(pools, flux_fill_tiny, config):
    """FLUX.1-Fill (no true CFG in diffusers): the masked image's latents and the mask on the transformer's input
    channels (384 in, 64 out)."""
    runs = [(FILL[0], {**FILL[1], **(DP if config.get("dp") else {})})]
    _check(pools, flux_fill_tiny, config, runs)


@pytest.mark.parametrize("config,call", [({"ulysses": 2}, {}), ({"ring": 2}, {}), ({"tp": 2}, {}), ({"cfg": 2}, {}),
                                         ({"dp": 2}, DP)], ids=["ulysses2", "ring2", "tp2", "cfg2", "dp2"])
def test_wan_i2v_matches_single_process(pools, wan_i2v_tiny, config, call):
    """Wan image-to-video (two experts, CFG on at guidance 5): the condition video (the image, then black frames) is
    encoded split over the ranks, and its latents and the first-frame mask join the noise on channels (36 in)."""
    ref, results, _ = _check(pools, wan_i2v_tiny, config, [(I2V[0], {**I2V[1], **call})], **VIDEO)
    assert ref[0]["tokens"] == 36  # Wan's hidden_states are [B, C, F, H, W]: the noise, the mask, the condition
    assert ref[0]["encoder_rows"] == [32, 32]  # the encoder's causal chunks: the first frame, then the other 4
    for r in results:
        assert r[0]["encoder_rows"] == [16, 16]  # the encode was split
        assert r[0]["steps"] == [0, 0, 1, 1, 2, 2]  # cond and uncond calls of each step, over both experts


@pytest.mark.parametrize("config,call", [({"ulysses": 2}, {}), ({"tp": 2}, {}), ({"dp": 2}, DP)],
                         ids=["ulysses2", "tp2", "dp2"])
def test_wan21_i2v_with_clip_image_tokens_matches_single_process(pools, wan21_i2v_tiny, config, call):
    """Wan 2.1 I2V: the transformer also cross-attends to the image's CLIP tokens (replicated context; under tp the
    image key/value projections and their norm are split like the text ones)."""
    _check(pools, wan21_i2v_tiny, config, [(I2V[0], {**I2V[1], **call})], **VIDEO)


def test_wan_i2v_condition_image_changes_the_video(wan_i2v_tiny):
    """The image conditions the output: another image (another seed of the test image) gives another video."""
    one, other = image_case(wan_i2v_tiny, {}, [I2V, (I2V[0], {"image": (32, 32, 1)})], **VIDEO)
    err = rel_err(other["latents"], one["latents"])
    print(f"rel change with another image: {err:.2e}")
    assert err > 1e-2


def test_generate_image_options_match_single_process(tmp_path, flux_tiny, flux_fill_tiny):
    """`generate --image [--mask] [--strength]`: the family's image pipeline on the same checkpoint, split over two
    processes (the condition image encoded split), equal to one process; the report names the pipeline."""
    from cases_image import condition_image, condition_mask
    from test_generate_cli import generate

    condition_image().save(tmp_path / "cond.png")
    condition_mask().save(tmp_path / "mask.png")
    image = ["--image", str(tmp_path / "cond.png")]
    mask = ["--mask", str(tmp_path / "mask.png")]
    for name, opts, procs in (
        ("img2img", ["--model", flux_tiny, *image, "--strength", "0.6"], ["--ulysses", "2"]),
        ("fill", ["--model", flux_fill_tiny, *image, *mask], ["--dp", "1", "--tp", "2"]),
    ):
        one, latents_one, _ = generate(tmp_path, f"{name}-1", *opts, "--nproc", "1")
        two, latents_two, _ = generate(tmp_path, f"{name}-2", *opts, "--nproc", "2", *procs)
        err = rel_err(latents_two, latents_one)
        print(f"rel err generate {name} {procs}: {err:.2e}")
        assert err <= TOLERANCE, (name, err)
        assert two["image"] == str(tmp_path / "cond.png") and two["vae_parallel"]["split"]
    assert one["pipeline"] == "FluxFillPipeline" and one["strength"] == 1.0 and one["mask"] == mask[1]
    img2img = json.loads((tmp_path / "img2img-2.png.json").read_text())
    assert img2img["pipeline"] == "FluxImg2ImgPipeline" and img2img["strength"] == 0.6
    assert len(img2img["step_latency_s"]) == 2  # 3 steps at strength 0.6 run the last two


def test_generate_image_to_video_matches_single_process(tmp_path, wan_i2v_tiny):
    """`generate --image PATH --frames 5` on an image-to-video checkpoint, split over two processes (ulysses, the
    condition video encoded split), equals the pipeline called in this process with the same arguments."""
    import diffusers
    from PIL import Image
    from safetensors.torch import load_file

    from cases_image import condition_image
    from cases_models import run_ranks
    from ditmesh.models import adapters

    condition_image(32, 32).save(tmp_path / "cond.png")
    out = tmp_path / "video.gif"
    run_ranks(["generate", "--model", wan_i2v_tiny, "--image", str(tmp_path / "cond.png"), "--frames", "5",
               "--height", "32", "--width", "32", "--steps", "3", "--out", str(out),
               "--save-latents", str(tmp_path / "latents.safetensors"), "--nproc", "2", "--ulysses", "2"])
    report = json.loads(out.with_name(out.name + ".json").read_text())
    assert report["pipeline"] == I2V[0] and report["frames"] == 5 and report["vae_parallel"]["split"]
    assert Image.open(out).n_frames == 5

    next(p.setup for a in adapters() for p in a.image_pipelines if p.pipeline == I2V[0])()
    pipe = diffusers.WanImageToVideoPipeline.from_pretrained(wan_i2v_tiny, dtype=torch.float32)
    pipe.set_progress_bar_config(disable=True)
    want = pipe(image=Image.open(tmp_path / "cond.png").convert("RGB"), prompt=report["prompt"][0], height=32, width=32,
                num_frames=5, num_inference_steps=3, guidance_scale=report["guidance"],
                generator=torch.Generator("cpu").manual_seed(report["seed"]), max_sequence_length=32,
                output_type="latent").frames
    err = rel_err(load_file(str(tmp_path / "latents.safetensors"))["latents"], want)
    print(f"rel err generate i2v ulysses 2: {err:.2e}")
    assert err <= TOLERANCE


@pytest.mark.parametrize("extra,needle", [
    (["--mask", "{mask}"], "--mask needs --image PATH"),
    (["--image", "{missing}"], "no such file"),
    (["--image", "{bad}"], "not an image Pillow can read"),
    (["--image", "{cond}", "--strength", "0"], "--strength 0.0 must be in (0, 1]"),
    (["--image", "{cond}", "--model", "wan2.2-tiny"], "i2v needs an image-to-video checkpoint"),
    (["--image", "{cond}", "--model", "wan2.2-i2v-tiny", "--strength", "0.5"], "i2v (WanImageToVideoPipeline) has no "
                                                                                 "strength"),
    (["--image", "{cond}", "--model", "wan2.2-i2v-tiny", "--mask", "{mask}"], "wan has no masked pipeline"),
    (["--image", "{cond}", "--model", "wan2.2-i2v-tiny", "--frames", "6"], "--frames 6 must be 4k+1"),
    (["--image", "{cond}", "--model", "flux-tiny", "--frames", "5"], "flux pipelines generate images"),
    (["--image", "{cond}", "--model", "flux-tiny", "--image-mode", "fill", "--mask", "{mask}"],
     "fill needs a Fill checkpoint"),
    (["--image", "{cond}", "--model", "flux-tiny", "--image-mode", "kontext", "--mask", "{mask}"],
     "takes no mask; use --image-mode inpaint or fill"),
    (["--image", "{cond}", "--model", "flux-tiny", "--image-mode", "kontext", "--strength", "0.5"], "has no strength"),
    (["--image", "{cond}", "--model", "flux-tiny", "--image-mode", "zoom"], "flux has no image mode 'zoom'"),
])
def test_generate_bad_image_options_are_one_line_errors(extra, needle, tmp_path, capsys):
    from cases_image import condition_image, condition_mask
    from ditmesh.cli import main

    condition_image().save(tmp_path / "cond.png")
    condition_mask().save(tmp_path / "mask.png")
    (tmp_path / "bad.png").write_text("not an image")
    paths = dict(cond=tmp_path / "cond.png", mask=tmp_path / "mask.png", bad=tmp_path / "bad.png",
                 missing=tmp_path / "missing.png")
    assert main(["generate", "--out", str(tmp_path / "o.png"), *(e.format(**paths) for e in extra)]) == 2
    err = capsys.readouterr().err.strip()
    assert needle in err and len(err.splitlines()) == 1, err
