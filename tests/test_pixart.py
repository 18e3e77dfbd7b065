"""PixArt-Σ under every axis on real gloo process groups, against one process: image self-attention split over the
ranks (Ulysses, ring, USP), cross-attention to the whole text under its padding mask on every rank, tensor parallelism,
batched CFG and data parallelism."""

from __future__ import annotations

import pytest
import torch

from cases_models import PROMPTS, FamilyRuns, transformer_call
from ditmesh.testing import rel_err

#: two prompts of different lengths: each sample pads its text differently, so the cross-attention mask differs
#: image tokens (H/16 * W/16): 16 divide 2 and 4, 9 do not; text is not split
SHAPES = {"even": dict(height=64, width=64, max_sequence_length=32),
          "uneven": dict(height=48, width=48, max_sequence_length=15)}
#: PixArtSigmaPipeline options for tiny CPU runs: no resolution binning (it would pick a 256-px bin), no caption cleaning
EXTRA = dict(use_resolution_binning=False, clean_caption=False)
BLOCKS = 2  # pixart-sigma-tiny: one self-attention (split) and one cross-attention (local) per block
STEPS = 2
CALLS = STEPS  # batched CFG: one transformer call per step on [uncond, cond]


@pytest.fixture(scope="module")
def pixart_tiny(tiny_checkpoints) -> str:
    return tiny_checkpoints("pixart-sigma-tiny")


#: the pipeline runs of this file and their one-process references (pipeline_generate's guidance 5.0)
RUNS = FamilyRuns(SHAPES, steps=STEPS, guidance_scale=5.0, extra=EXTRA)
generate, reference = RUNS.generate, RUNS.reference






def expected_counts(config: dict) -> dict:
    """Collectives of one pipeline call (2 steps, one transformer call each)."""
    counts = {}
    if config.get("tp", 1) > 1:
        counts["all_reduce"] = 3 * BLOCKS * CALLS  # attn1.to_out.0, attn2.to_out.0, ff.net.2
    if config.get("ulysses", 1) > 1:
        counts["all_to_all"] = 2 * BLOCKS * CALLS  # the self-attentions only: cross-attention moves nothing
    if config.get("ring", 1) > 1:
        counts["ring_p2p"] = (config["ring"] - 1) * BLOCKS * CALLS
    gathers = CALLS if config.get("ulysses", 1) * config.get("ring", 1) > 1 else 0  # the image tokens at proj_out
    gathers += CALLS if config.get("cfg", 1) * config.get("dp", 1) > 1 else 0  # the batch chunks
    if gathers:
        counts["all_gather"] = gathers
    return counts


@pytest.mark.parametrize("shape", ["even", "uneven"])
@pytest.mark.parametrize("config", [{"ulysses": 2}, {"ring": 2}, {"ring": 2, "ulysses": 2}, {"ulysses": 4}, {"tp": 2},
                                    {"tp": 2, "ulysses": 2}, {"cfg": 2}],
                         ids=lambda c: "-".join(f"{k}{v}" for k, v in c.items()))
def test_pixart_pipeline_matches_single_process(pools, pixart_tiny, config, shape):
    RUNS.check(pools, pixart_tiny, config, shape, CALLS, expected_counts(config))


def test_pixart_dp2_three_prompts_matches_single_process(pools, pixart_tiny):
    prompts = PROMPTS + ["a green triangle"]  # 3 prompts x [uncond, cond] = 6 samples over 2 ranks
    ref = reference(pixart_tiny, "uneven", tuple(prompts))
    for latents, counts, calls in generate(pixart_tiny, {"dp": 2}, "uneven", prompts, pools=pools):
        assert latents.shape[0] == 3 and rel_err(latents, ref) <= 1e-5
        assert counts == expected_counts({"dp": 2})


def test_pixart_text_mask_changes_the_output(pixart_tiny):
    # the cross-attention mask every rank applies whole matters: dropping it gives another result
    from diffusers import PixArtSigmaPipeline

    pipe = PixArtSigmaPipeline.from_pretrained(pixart_tiny, dtype=torch.float32)
    pipe.set_progress_bar_config(disable=True)
    seen = []

    def drop_mask(module, args, kwargs):
        seen.append(kwargs["encoder_attention_mask"])
        return args, dict(kwargs, encoder_attention_mask=None)

    pipe.transformer.register_forward_pre_hook(drop_mask, with_kwargs=True)
    out = pipe(PROMPTS, num_inference_steps=STEPS, guidance_scale=5.0, generator=torch.Generator().manual_seed(42),
               output_type="latent", **EXTRA, **SHAPES["even"]).images
    mask = seen[0]
    assert mask.shape == (4, 32) and not torch.equal(mask[2], mask[3])  # [uncond x 2, cond x 2], per-sample padding
    assert rel_err(out, reference(pixart_tiny, "even")) > 1e-3


def _inputs(arch: str, height: int, width: int) -> dict:
    from ditmesh.models.base import adapter_for
    from ditmesh.synth import build_transformer

    model = build_transformer(arch, dtype=torch.float32)
    return adapter_for(model).example_inputs(model, height=height, width=width, batch=3, text_len=11, device="cpu",
                                             dtype=torch.float32, generator=torch.Generator().manual_seed(3))


@pytest.mark.parametrize("config", [{"ulysses": 2}, {"ring": 2}], ids=lambda c: "-".join(f"{k}{v}" for k, v in c.items()))
def test_pixart_self_attention_mask_matches_single_process(pools, config):
    # the model's own attention_mask ([B, image tokens], 1 keeps) masks image keys of the self-attention; the
    # pipelines never pass one. 9 image tokens split 5 + 4; the masked keys differ per sample and sit on both ranks
    inputs = _inputs("pixart-sigma-tiny", 48, 48)
    keep = torch.ones(3, 9)
    keep[0, 6:] = 0
    keep[1, :3] = 0
    keep[2, ::2] = 0
    inputs["attention_mask"] = keep
    ref, _ = transformer_call("pixart-sigma-tiny", {}, inputs)
    for out, counts in pools(2).run(transformer_call, "pixart-sigma-tiny", config, inputs):
        assert rel_err(out, ref) <= 1e-5
        assert counts == {k: v // CALLS for k, v in expected_counts(config).items()}
    inputs.pop("attention_mask")
    assert rel_err(transformer_call("pixart-sigma-tiny", {}, inputs)[0], ref) > 1e-3  # the mask matters


def test_pixart_alpha_micro_conditions_split_with_the_batch(pools):
    # PixArt-α 1024 reads the image size and aspect ratio per sample (added_cond_kwargs, a dict): dp narrows each entry
    inputs = _inputs("pixart-alpha-tiny", 32, 48)
    inputs["added_cond_kwargs"]["resolution"] = torch.tensor([[256.0, 384.0], [512.0, 512.0], [1024.0, 768.0]])
    ref, _ = transformer_call("pixart-alpha-tiny", {}, inputs)
    for out, counts in pools(2).run(transformer_call, "pixart-alpha-tiny", {"dp": 2}, inputs):
        assert rel_err(out, ref) <= 1e-5 and counts == {"all_gather": 1}
    inputs["added_cond_kwargs"]["resolution"] = inputs["added_cond_kwargs"]["resolution"].flip(0)
    assert rel_err(transformer_call("pixart-alpha-tiny", {}, inputs)[0], ref) > 1e-3  # the conditions matter


def test_pixart_tp4_matches_single_process(pools, tiny_checkpoints):
    path = tiny_checkpoints("pixart-sigma-tiny-tp")
    ref = generate(path, {}, "uneven")[0][0]
    for latents, counts, calls in generate(path, {"tp": 4}, "uneven", pools=pools):
        assert rel_err(latents, ref) <= 1e-5 and counts == expected_counts({"tp": 4})


def test_pixart_real_size_matches_the_published_config():
    from ditmesh.synth import get_arch

    sigma = get_arch("pixart-sigma").transformer
    assert (sigma["num_layers"], sigma["num_attention_heads"], sigma["attention_head_dim"]) == (28, 16, 72)
    assert sigma["cross_attention_dim"] == 16 * 72 and sigma["caption_channels"] == get_arch("pixart-sigma").t5["d_model"]


def test_generate_cli_runs_pixart_and_times_its_steps(tmp_path, pixart_tiny):
    # PixArtSigmaPipeline takes the older per-step `callback`, not `callback_on_step_end`: generate times the steps
    # and keeps the final latents through it
    from test_generate_cli import generate as cli_generate

    r1, l1, img1 = cli_generate(tmp_path, "single", "--model", pixart_tiny, "--nproc", "1")
    r2, l2, img2 = cli_generate(tmp_path, "ring2", "--model", pixart_tiny, "--nproc", "2", "--ring", "2")
    assert rel_err(l2, l1) <= 1e-5 and abs(img1 - img2).max() <= 1
    assert len(r1["step_latency_s"]) == len(r2["step_latency_s"]) == 3 and r2["pipeline"] == "PixArtSigmaPipeline"


def test_pixart_modulated_input_is_what_attn1_reads_and_caches_decide_as_one_process(pools, pixart_tiny):
    # the block list and the modulated input make step caching apply: teacache reads block 0's modulated input,
    # dbcache the blocks' residuals; under ulysses and cfg they decide as one process
    from diffusers import PixArtSigmaPipeline

    from cases_cache import cached_run
    from ditmesh.hooks import bind_kwargs
    from ditmesh.models import adapter_for
    from test_cache import assert_same_run

    pipe = PixArtSigmaPipeline.from_pretrained(pixart_tiny, dtype=torch.float32)
    block, seen = pipe.transformer.transformer_blocks[0], {}

    def ours(module, args, kwargs):
        seen["ours"] = adapter_for(pipe.transformer).modulated_input(module, bind_kwargs(module.forward, args, kwargs))

    block.register_forward_pre_hook(ours, with_kwargs=True)
    block.attn1.register_forward_pre_hook(lambda module, args: seen.setdefault("attention", args[0]))
    pipe.set_progress_bar_config(disable=True)
    pipe("a cat", num_inference_steps=1, output_type="latent", **EXTRA, **SHAPES["uneven"])
    assert torch.equal(seen["ours"], seen["attention"])
    kwargs = dict(steps=6, size=48, guidance_scale=5.0, **EXTRA)
    for setting in ("teacache:threshold=0.34", "dbcache:threshold=0.34,warmup=1"):  # changes of 0.2-0.33 (probed)
        ref = cached_run(pixart_tiny, {}, setting, **kwargs)
        assert any(h["skip"] for h in ref[1]["transformer"]), setting
        for config in ({"ulysses": 2}, {"cfg": 2}):
            for got in pools(2).run(cached_run, pixart_tiny, config, setting, **kwargs):
                assert_same_run(got, ref)
