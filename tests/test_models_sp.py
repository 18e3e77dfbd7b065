"""SD3, Wan and HiDream under sequence parallelism on real gloo process groups, against single-process results.

Matrix: model x parallel configuration x token counts that divide the degree or not. Add ring / USP
configurations to ``CONFIGS`` (with their expected collectives in ``expected_counts``) and every model and
shape runs under them. Inputs no pipeline of the suite passes run through the transformer itself: Wan 2.2
TI2V's per-token timesteps and SD3 ControlNet residuals, under ulysses 2 and ring 2, even and uneven.
"""

from __future__ import annotations

import math
import sys

import pytest
import torch

from cases_models import pipeline_generate, run_ranks, transformer_call
from ditmesh.testing import rel_err

#: per model: shapes whose token counts divide 2 and 4 ("even") and whose counts divide neither ("uneven")
SHAPES = {
    # image tokens (H/16 * W/16) and text tokens (77 CLIP + T5 max_sequence_length)
    "sd3-tiny": {
        "even": dict(height=64, width=64, max_sequence_length=35),  # 16 image + 112 text tokens
        "uneven": dict(height=48, width=48, max_sequence_length=32),  # 9 image + 109 text tokens
    },
    # video tokens: ((frames - 1) / 4 + 1) latent frames x H/16 x W/16; text is not split (cross-attention)
    "wan-tiny": {
        "even": dict(height=64, width=64, frames=5),  # 2 x 4 x 4 = 32 tokens
        "uneven": dict(height=48, width=48, frames=9),  # 3 x 3 x 3 = 27 tokens
    },
    # image tokens and T5 and Llama tokens (max_sequence_length each); HiDreamImagePipeline renders
    # default_sample_size^2 latent pixels whatever size is asked: 8 -> 64x64 (16 tokens), 6 -> 48x48 (9 tokens)
    "hidream-tiny": {
        "even": dict(height=64, width=64, max_sequence_length=32, pipe_attrs={"default_sample_size": 8}),
        "uneven": dict(height=48, width=48, max_sequence_length=15, pipe_attrs={"default_sample_size": 6}),
    },
}

#: attention layers that run through ``sp.attention`` in one transformer call
SP_ATTENTION_LAYERS = {
    "sd3-tiny": 4,  # 3 joint attentions + the image-only attn2 of dual-attention block 0
    "wan-tiny": 2,  # one self-attention per block; the cross-attentions communicate nothing
    "hidream-tiny": 4,  # 2 double + 2 single blocks, one attention each
}

CONFIGS = [{"ulysses": 2}, {"ulysses": 4}, {"ring": 2}, {"ring": 4}, {"ring": 2, "ulysses": 2}]


def expected_counts(model: str, config: dict) -> dict:
    """Collectives of ONE transformer call, per attention layer: 2 all-to-alls when ulysses > 1 (Q/K/V out,
    output back) and ring - 1 ring exchange rounds when ring > 1; plus 1 all-gather before unpatchify."""
    ring, ulysses = config.get("ring", 1), config.get("ulysses", 1)
    per_layer = {"all_to_all": 2 if ulysses > 1 else 0, "ring_p2p": ring - 1}
    counts = {kind: n * SP_ATTENTION_LAYERS[model] for kind, n in per_layer.items() if n}
    counts["all_gather"] = 1
    return counts


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict:
    """Synthetic sd3-tiny, wan-tiny and hidream-tiny pipeline folders (seed 0)."""
    from ditmesh.synth import write_checkpoint

    root = tmp_path_factory.mktemp("models")
    return {name: str(write_checkpoint(name, root / name, seed=0, device="cpu")) for name in SHAPES}


_REFERENCES: dict = {}


def reference(path: str, model: str, shape: str) -> torch.Tensor:
    """Single-process final latents, computed once per model and shape."""
    key = (model, shape)
    if key not in _REFERENCES:
        _REFERENCES[key] = pipeline_generate(path, {}, **SHAPES[model][shape])[0]
    return _REFERENCES[key]


@pytest.mark.parametrize("shape", ["even", "uneven"])
@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: "-".join(f"{k}{v}" for k, v in c.items()))
@pytest.mark.parametrize("model", list(SHAPES))
def test_sequence_parallel_matches_single_process(pools, checkpoints, model, config, shape):
    ref = reference(checkpoints[model], model, shape)
    outs = pools(math.prod(config.values())).run(pipeline_generate, checkpoints[model], config, **SHAPES[model][shape])
    per_call = expected_counts(model, config)
    for latents, counts, calls in outs:
        assert rel_err(latents, ref) <= 1e-5
        # SD3 and HiDream run CFG as one batched call per step, Wan as two calls: 2 steps -> 2 or 4 calls
        assert calls == {"sd3-tiny": 2, "wan-tiny": 4, "hidream-tiny": 2}[model]
        assert counts == {kind: n * calls for kind, n in per_call.items()}
    assert torch.equal(outs[0][0], outs[-1][0])


#: text tokens of the transformer-level cases (SD3 splits them as a stream of their own; Wan cross-attends to them)
TEXT_TOKENS = {"even": 12, "uneven": 11}
TRANSFORMER_CONFIGS = [{"ulysses": 2}, {"ring": 2}]


def _transformer_inputs(arch: str, shape: str) -> dict:
    """One denoising step's inputs of the synthetic ``arch`` transformer at ``SHAPES[arch][shape]`` (batch 2)."""
    from ditmesh.models.base import adapter_for
    from ditmesh.synth import build_transformer

    size = {k: v for k, v in SHAPES[arch][shape].items() if k != "max_sequence_length"}
    model = build_transformer(arch, dtype=torch.float32)
    return adapter_for(model).example_inputs(model, batch=2, text_len=TEXT_TOKENS[shape], device="cpu",
                                             dtype=torch.float32, generator=torch.Generator().manual_seed(3), **size)


def _check_transformer_call(pools, arch: str, config: dict, inputs: dict) -> torch.Tensor:
    """``arch``'s transformer on ``inputs`` under ``config`` (2 ranks) against one process: same output, and the
    collectives of one call. Returns the single-process output."""
    ref, _ = transformer_call(arch, {}, inputs)
    for out, counts in pools(2).run(transformer_call, arch, config, inputs):
        assert rel_err(out, ref) <= 1e-5
        assert counts == expected_counts(arch, config)
    return ref


@pytest.mark.parametrize("shape", ["even", "uneven"])
@pytest.mark.parametrize("config", TRANSFORMER_CONFIGS, ids=lambda c: "-".join(f"{k}{v}" for k, v in c.items()))
def test_wan_per_token_timesteps_match_single_process(pools, config, shape):
    # Wan 2.2 TI2V (expand_timesteps) passes one timestep per video token, [B, N]; here every token and sample
    # has its own, so a split along the wrong dimension, or none, changes the output
    inputs = _transformer_inputs("wan-tiny", shape)
    hidden = inputs["hidden_states"]
    tokens = hidden.shape[2] * (hidden.shape[3] // 2) * (hidden.shape[4] // 2)  # patch 1 x 2 x 2
    assert tokens == {"even": 32, "uneven": 27}[shape]
    inputs["timestep"] = torch.rand(2, tokens, generator=torch.Generator().manual_seed(4)) * 1000
    ref = _check_transformer_call(pools, "wan-tiny", config, inputs)
    inputs["timestep"] = inputs["timestep"].mean(1)  # the per-token values matter: one per sample gives another output
    assert rel_err(transformer_call("wan-tiny", {}, inputs)[0], ref) > 1e-2


@pytest.mark.parametrize("shape", ["even", "uneven"])
@pytest.mark.parametrize("config", TRANSFORMER_CONFIGS, ids=lambda c: "-".join(f"{k}{v}" for k, v in c.items()))
def test_sd3_controlnet_residuals_match_single_process(pools, config, shape):
    # SD3 ControlNet adds one residual [B, N_image, D] per block group to the image tokens; the plan splits them
    # with the image stream at the entry. sd3-tiny: 3 blocks, 3 residuals (the last block is context_pre_only
    # and takes none)
    from ditmesh.synth import get_arch

    inputs = _transformer_inputs("sd3-tiny", shape)
    latent = inputs["hidden_states"]
    image_tokens = (latent.shape[2] // 2) * (latent.shape[3] // 2)  # patch 2
    assert image_tokens == {"even": 16, "uneven": 9}[shape]
    arch = get_arch("sd3-tiny").transformer
    width = arch["num_attention_heads"] * arch["attention_head_dim"]
    g = torch.Generator().manual_seed(5)
    inputs["block_controlnet_hidden_states"] = [torch.randn(2, image_tokens, width, generator=g) for _ in range(3)]
    ref = _check_transformer_call(pools, "sd3-tiny", config, inputs)
    inputs.pop("block_controlnet_hidden_states")
    assert rel_err(transformer_call("sd3-tiny", {}, inputs)[0], ref) > 1e-2  # the residuals matter


def test_synth_sd3_and_wan_load_with_from_pretrained(checkpoints):
    from diffusers import StableDiffusion3Pipeline, WanPipeline

    sd3 = StableDiffusion3Pipeline.from_pretrained(checkpoints["sd3-tiny"])
    assert sd3.transformer.config.num_attention_heads == 6 and sd3.transformer.config.qk_norm == "rms_norm"
    assert sd3.transformer.transformer_blocks[0].attn2 is not None and sd3.transformer.transformer_blocks[-1].context_pre_only
    wan = WanPipeline.from_pretrained(checkpoints["wan-tiny"])
    assert wan.transformer.config.num_attention_heads == 6 and type(wan.vae).__name__ == "AutoencoderKLWan"
    assert type(wan.text_encoder).__name__ == "UMT5EncoderModel"


def test_real_size_configs_match_published_widths():
    from ditmesh.synth import get_arch

    sd35 = get_arch("sd3.5-large").transformer
    assert (sd35["num_layers"], sd35["num_attention_heads"], sd35["attention_head_dim"]) == (38, 38, 64)
    assert sd35["caption_projection_dim"] == 38 * 64 and sd35["qk_norm"] == "rms_norm"
    wan = get_arch("wan2.1-14b").transformer
    assert (wan["num_layers"], wan["num_attention_heads"], wan["attention_head_dim"], wan["ffn_dim"]) == (40, 40, 128, 13824)
    assert get_arch("wan2.1-14b").t5["d_model"] == wan["text_dim"] == 4096


def test_generate_cli_writes_video_and_latents(tmp_path, checkpoints):
    out = tmp_path / "clip.mp4"
    run_ranks(["generate", "--model", checkpoints["wan-tiny"], "--frames", "5", "--steps", "2", "--height", "48",
               "--width", "48", "--nproc", "2", "--ulysses", "2", "--out", str(out),
               "--save-latents", str(tmp_path / "lat.safetensors")])
    try:
        import imageio_ffmpeg  # noqa: F401

        assert out.read_bytes()[4:8] == b"ftyp"  # an MP4 container
    except ImportError:  # without the [video] extra the frames are written as PNGs
        assert len(list((tmp_path / "clip_frames").glob("frame_*.png"))) == 5
    from safetensors.torch import load_file

    assert load_file(str(tmp_path / "lat.safetensors"))["latents"].shape == (1, 16, 2, 6, 6)


def test_generate_cli_rejects_bad_frame_counts(checkpoints):
    from cases_models import generate_refusal

    line = generate_refusal(checkpoints["wan-tiny"], "--frames", "6")
    assert "--frames 6" in line and "4k+1" in line
    assert "video" in generate_refusal(checkpoints["sd3-tiny"], "--frames", "5")


def test_video_writer_falls_back_to_png_frames_without_imageio_ffmpeg(tmp_path, monkeypatch, capsys):
    from ditmesh.runtime.video import write_video

    video = torch.rand(3, 16, 16, 3).numpy()  # [F, H, W, C] in [0, 1], as WanPipeline returns it
    monkeypatch.setitem(sys.modules, "imageio_ffmpeg", None)  # import now raises ImportError
    paths = write_video(tmp_path / "v.mp4", video)
    assert [p.rsplit("/", 1)[-1] for p in paths] == ["frame_0000.png", "frame_0001.png", "frame_0002.png"]
    assert "pip install 'ditmesh[video]'" in capsys.readouterr().err
    assert not (tmp_path / "v.mp4").exists()
    assert write_video(tmp_path / "v.gif", video) == [str(tmp_path / "v.gif")]
