"""AnyFlow (``models/anyflow.py``) under every axis on real gloo process groups, against one process: on diffusers' test
configuration of the class at its inputs' size (2 latent frames of 16 x 16: 128 tokens, one source and one target
timestep per frame) and at 3 latent frames of 6 x 6 (27 tokens) with a batch of 2, each frame at its own timesteps
(the per-token modulation cut at every block), and the text cross-attention to 7 tokens."""

from __future__ import annotations

import pytest
import torch

from cases_models import SP_AXES, case_id, check_transformer, sequence_counts, transformer_call
from ditmesh.testing import rel_err

ARCH = "anyflow-tiny"
LAYERS = 2


def inputs_of(shape: str) -> dict:
    g = torch.Generator().manual_seed(0)
    rand = lambda *shape: torch.randn(*shape, generator=g)  # noqa: E731
    if shape == "diffusers":
        return dict(hidden_states=rand(1, 2, 4, 16, 16), timestep=torch.full((1, 2), 500.0),
                    r_timestep=torch.full((1, 2), 250.0), encoder_hidden_states=rand(1, 12, 16), return_dict=False)
    timestep = torch.rand(2, 3, generator=g) * 1000
    return dict(hidden_states=rand(2, 3, 4, 6, 6), timestep=timestep, r_timestep=timestep * 0.6,
                encoder_hidden_states=rand(2, 7, 16), return_dict=False)


# diffusers' configuration under Ulysses; ours, the harder one, under every axis
CASES = [({"ulysses": 2}, "diffusers")] + [(c, "odd") for c in (*SP_AXES, {"tp": 2}, {"cfg": 2})]


@pytest.mark.parametrize("config, shape", CASES, ids=case_id)
def test_anyflow_transformer_matches_single_process(pools, config, shape):
    inputs = inputs_of(shape)
    # tp: per block Q/K/V column-, to_out row-parallel in both attentions and the feed-forward (3 all-reduces) and
    # the four sharded QK-norms' mean squares (4); sequence: attn1's exchanges and the gather at norm_out; cfg (its
    # pipeline's batched [uncond, cond] call, the odd case's batch of 2): the output's gather
    want = ({"all_reduce": 7 * LAYERS} if "tp" in config else {"all_gather": 1} if "cfg" in config
            else sequence_counts(config, LAYERS, 1))
    check_transformer(pools, ARCH, config, inputs, want)


def test_anyflow_per_frame_timesteps_matter():
    # the split per-token modulation is what the parallel runs cut: a frame's own timesteps must change the output
    inputs = inputs_of("odd")
    ref = transformer_call(ARCH, {}, inputs)[0]
    flat = dict(inputs, r_timestep=inputs["r_timestep"].mean(1, keepdim=True).expand_as(inputs["r_timestep"]))
    assert rel_err(transformer_call(ARCH, {}, flat)[0], ref) > 1e-3


def test_generate_runs_anyflow_as_one_process_does(tmp_path, tiny_checkpoints):
    # AnyFlowPipeline end to end on the synthetic checkpoint (UMT5, the Wan VAE of 4 channels), guidance on: its one
    # batched [uncond, cond] call a step, under ulysses 2; the latents equal the pipeline's own in one process
    from cases_models import generate_beside_pipeline

    got, want = generate_beside_pipeline(tmp_path, tiny_checkpoints(ARCH), frames=5, size=48)
    # the step callback's latents are frames-first, as the transformer takes them; the pipeline returns them
    # channels-first
    assert rel_err(got.permute(0, 2, 1, 3, 4), want) <= 1e-5
