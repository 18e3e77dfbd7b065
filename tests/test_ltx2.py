"""LTX-2 (``models/ltx2.py``) under sequence parallelism on real gloo process groups, against one process: the video
split, the audio whole on every rank, its video-to-audio attention merged from every rank's partial result. On
diffusers' own test configuration and inputs of the class (2 x 256 video tokens, 9 audio tokens) and on an odd count
(3 latent frames of 3 x 3: 27 video tokens, 7 audio tokens) with a per-token timestep, padded text and the video
coordinates passed by the caller, as the pipelines do."""

from __future__ import annotations

import math

import pytest
import torch

from cases_models import axis_id, transformer_call, whole_audio_counts
from ditmesh.testing import rel_err

ARCH = "ltx-2-tiny"  # diffusers' get_init_dict of the class
LAYERS = 2


def inputs_of(shape: str) -> dict:
    g = torch.Generator().manual_seed(0)
    rand = lambda *shape: torch.randn(*shape, generator=g)  # noqa: E731
    if shape == "diffusers":  # diffusers' get_dummy_inputs
        return dict(hidden_states=rand(2, 2 * 16 * 16, 4), audio_hidden_states=rand(2, 9, 4),
                    encoder_hidden_states=rand(2, 16, 16), audio_encoder_hidden_states=rand(2, 16, 16),
                    timestep=rand(2).abs() * 1000, encoder_attention_mask=torch.ones(2, 16).bool(), num_frames=2,
                    height=16, width=16, audio_num_frames=9, fps=25.0, return_dict=False)
    from diffusers import LTX2VideoTransformer3DModel

    from ditmesh.synth import get_arch

    model = LTX2VideoTransformer3DModel(**get_arch(ARCH).transformer)
    mask = torch.tensor([[1] * 9 + [0] * 2, [1] * 4 + [0] * 7])
    return dict(hidden_states=rand(2, 27, 4), audio_hidden_states=rand(2, 7, 4), encoder_hidden_states=rand(2, 11, 16),
                audio_encoder_hidden_states=rand(2, 11, 16), timestep=torch.rand(2, 27, generator=g) * 1000,
                audio_timestep=torch.tensor([700.0, 300.0]), sigma=torch.tensor([0.7, 0.3]),
                encoder_attention_mask=mask, audio_encoder_attention_mask=mask,
                video_coords=model.rope.prepare_video_coords(2, 3, 3, 3, "cpu", fps=24.0),
                audio_coords=model.audio_rope.prepare_audio_coords(2, 7, "cpu"), return_dict=False)



@pytest.mark.parametrize("shape", ["diffusers", "odd"])
@pytest.mark.parametrize("config", [{"ulysses": 2}, {"ring": 2}, {"ring": 2, "ulysses": 2}], ids=axis_id)
def test_ltx2_video_and_audio_match_single_process(pools, config, shape):
    inputs = inputs_of(shape)
    (video, audio), _ = transformer_call(ARCH, {}, inputs, outputs=2)
    results = pools(math.prod(config.values())).run(transformer_call, ARCH, config, inputs, outputs=2)
    for (got_video, got_audio), counts in results:
        assert rel_err(got_video, video) <= 1e-5 and rel_err(got_audio, audio) <= 1e-5
        assert counts == whole_audio_counts(config, LAYERS)
    assert all(torch.equal(results[0][0][1], r[0][1]) for r in results)  # every rank holds the same audio


def test_ltx2_what_the_plan_splits_matters():
    inputs = inputs_of("odd")
    (video, audio), _ = transformer_call(ARCH, {}, inputs, outputs=2)
    one_timestep = dict(inputs, timestep=inputs["timestep"].mean(1, keepdim=True))
    assert rel_err(transformer_call(ARCH, {}, one_timestep)[0], video) > 1e-3
    reversed_video = dict(inputs, hidden_states=inputs["hidden_states"].flip(1))  # the audio reads every video token
    assert rel_err(transformer_call(ARCH, {}, reversed_video, outputs=2)[0][1], audio) > 1e-4


def test_ltx2_refuses_cfg_dp_caches_and_pipefusion_in_one_line():
    from ditmesh import ParallelConfig, parallelize
    from ditmesh.config import ConfigError
    from ditmesh.synth import build_transformer

    class Pipe:
        transformer = build_transformer(ARCH, dtype=torch.float32)

    for config, kwargs, error, needle in [(ParallelConfig(cfg=2), {}, ConfigError, "cfg and dp do not run ltx-2"),
                                          (ParallelConfig(), {"cache": "fbcache:0.08"}, ConfigError, "step caches"),
                                          (ParallelConfig(pp=2), {}, NotImplementedError, "PipeFusion does not run")]:
        with pytest.raises(error, match=needle):
            parallelize(Pipe, config, **kwargs)


def test_ltx2_split_rope_and_gated_attention_match_single_process(pools):
    # LTX-2.3's layout: RoPE tables per head ([B, H, N, D / 2], tokens next to last) and gated attention
    import dataclasses

    from ditmesh.synth import get_arch

    arch = get_arch(ARCH)
    arch = dataclasses.replace(arch, transformer=dict(arch.transformer, rope_type="split", gated_attn=True,
                                                      audio_gated_attn=True))
    inputs = inputs_of("odd")
    (video, audio), _ = transformer_call(arch, {}, inputs, outputs=2)
    assert rel_err(video, transformer_call(ARCH, {}, inputs)[0]) > 1e-3  # another model indeed
    for (got_video, got_audio), counts in pools(2).run(transformer_call, arch, {"ulysses": 2}, inputs, outputs=2):
        assert rel_err(got_video, video) <= 1e-5 and rel_err(got_audio, audio) <= 1e-5
        assert counts == whole_audio_counts({"ulysses": 2}, LAYERS)
