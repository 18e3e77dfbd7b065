"""Kandinsky 6 SR (``models/kandinsky6_sr.py``) on real gloo process groups, against one process: its NABLA sparse
attention built per head after the Ulysses all-to-all (each rank its heads' block masks over the whole sequence), tp,
dp over the tiles; ring refused in one line. At diffusers' test configuration and inputs (2 latent frames of one 8 x 8
token block) and at an awkward one of ours (3 heads: 2 + 1 over two ranks; 3 latent frames of 8 x 16 tokens; a NABLA
that drops blocks). Both sides run flex attention through ``cases_nabla``'s emulation, which applies the block mask
(torch's eager flex attention on CPU ignores NABLA's)."""

from __future__ import annotations

import pytest
import torch

from cases_models import axis_id, call_counts, refused_call
from cases_nabla import masked_transformer_call
from ditmesh.testing import rel_err

BLOCKS = 2
ARCHS = {"diffusers": "kandinsky6-sr-tiny", "sparse": "kandinsky6-sr-tiny-sparse"}


def inputs_of(shape: str) -> dict:
    g = torch.Generator().manual_seed(0)
    if shape == "diffusers":  # diffusers' get_dummy_inputs: one tile of 2 latent frames, 16 x 16, 2 * 4 + 1 channels
        return dict(hidden_states=torch.randn(1, 2, 16, 16, 9, generator=g),
                    timestep=torch.randint(0, 1000, (1,), generator=g).float(), return_dict=False)
    return dict(hidden_states=torch.randn(2, 3, 16, 32, 9, generator=g), timestep=torch.tensor([700.0, 300.0]),
                return_dict=False)


@pytest.mark.parametrize("config, shape", [({"ulysses": 2}, "diffusers"), ({"tp": 2}, "diffusers"),
                                           ({"ulysses": 2}, "sparse"), ({"dp": 2}, "sparse")],
                         ids=lambda v: axis_id(v) if isinstance(v, dict) else v)
def test_kandinsky6_sr_transformer_matches_single_process(pools, config, shape):
    counts = {"all_gather": 1} if "dp" in config else call_counts(config, BLOCKS, 2 * BLOCKS)
    inputs = inputs_of(shape)
    ref, _ = masked_transformer_call(ARCHS[shape], {}, inputs)
    for out, got in pools(2).run(masked_transformer_call, ARCHS[shape], config, inputs):
        assert rel_err(out, ref) <= 1e-5
        assert got == counts


def test_kandinsky6_sr_nabla_mask_drops_blocks():
    # the awkward configuration's block mask is sparse: the same weights attending densely (every block kept) differ,
    # so a mask built from the wrong heads or tokens could not pass the sparse cases above
    inputs = inputs_of("sparse")
    sparse, _ = masked_transformer_call(ARCHS["sparse"], {}, inputs)
    dense, _ = masked_transformer_call(ARCHS["sparse"], {}, inputs, model_config={"nabla_threshold": 1.0,
                                                                                 "nabla_window": (11, 7, 7)})
    assert rel_err(sparse, dense) > 1e-3


def test_kandinsky6_sr_refuses_ring_in_one_line(pools):
    for message in pools(2).run(refused_call, ARCHS["sparse"], {"ring": 2}, inputs_of("sparse")):
        assert message.startswith("ring=2 does not run kandinsky6-sr: its NABLA attention") and "use ring=1" in message
        assert "\n" not in message


def test_kandinsky6_sr_planner_traces_it_on_the_meta_device():
    # flex attention does not run on the meta device: the adapter's meta_trace attends densely there
    from ditmesh.planner.stats import model_stats, resolve_model

    stats = model_stats(resolve_model(ARCHS["diffusers"]), 256, 256, 5)
    assert (stats.num_heads, stats.layout.split_tokens, stats.num_blocks) == (2, 128, BLOCKS)
