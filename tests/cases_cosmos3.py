"""Cosmos 3 Omni transformers and inputs for tests/test_cosmos3.py, built the same way on every rank of a gloo pool.

Models: ``diffusers`` is diffusers' test configuration of the class (2 heads x 6 over 1 key-value head, Nemotron's
ReLU^2 MLP and norms, no text QK-norm); ``odd`` is ours, 3 heads x 8 over 1 key-value head with the generation
pathway's own text-key norm (``use_und_k_norm_for_gen``), sound and action heads; ``tiny`` is the synthetic
``cosmos3-omni-tiny`` (4 heads over 2 key-value heads, SiLU MLP, text QK-norms), which tp 2 divides.
"""

from __future__ import annotations

import torch

#: diffusers' test configuration of Cosmos3OmniTransformer
DIFFUSERS = dict(head_dim=6, hidden_act="relu2", hidden_size=12, intermediate_size=24, latent_channel=2,
                 latent_patch_size=1, num_attention_heads=2, num_hidden_layers=2, num_key_value_heads=1,
                 patch_latent_dim=2, qk_norm_for_text=False, rms_norm_eps=1e-5, rope_axes_dim=[1, 1, 1],
                 rope_theta=1e8, vocab_size=32)
ODD = dict(head_dim=8, hidden_act="relu2", hidden_size=24, intermediate_size=40, latent_channel=3, latent_patch_size=2,
           num_attention_heads=3, num_hidden_layers=2, num_key_value_heads=1, patch_latent_dim=12,
           qk_norm_for_text=False, use_und_k_norm_for_gen=True, rms_norm_eps=1e-5, rope_axes_dim=[2, 1, 1],
           rope_theta=1e4, vocab_size=40, sound_gen=True, sound_dim=3, action_gen=True, action_dim=5,
           num_embodiment_domains=2)
LAYERS = 2


def build(name: str) -> torch.nn.Module:
    """The model ``name`` (module docstring) with seeded weights, float32."""
    from diffusers import Cosmos3OmniTransformer

    from ditmesh.synth import build_transformer, seeded_init_

    if name == "tiny":
        return build_transformer("cosmos3-omni-tiny", seed=0, dtype=torch.float32)
    return seeded_init_(Cosmos3OmniTransformer(**{"diffusers": DIFFUSERS, "odd": ODD}[name]), 0).eval()


def inputs_of(model, case: str) -> dict:
    """The call of ``case``: ``diffusers`` is diffusers' dummy inputs (2 text tokens, 1 vision token, positions all
    zero) and ``diffusers-3x5`` the same at 3 x 5 latent cells; ``odd`` is 7 text tokens, 2 latent frames of 5 x 3
    cells in 2x2 patches (12 tokens, the first frame conditioning), 5 sound and 3 action tokens (the first action
    conditioning); ``tiny`` is 5 text tokens and 3 latent frames of 4 x 6 cells (18 tokens)."""
    from ditmesh.models.cosmos3 import cosmos3_inputs

    g = torch.Generator().manual_seed(0)
    if case.startswith("diffusers"):
        h, w = (1, 1) if case == "diffusers" else (3, 5)
        vision = torch.arange(2, 2 + h * w)
        return dict(input_ids=torch.tensor([1, 2]), text_indexes=torch.tensor([0, 1]),
                    position_ids=torch.zeros(3, 2 + h * w, dtype=torch.long), und_len=2, sequence_length=2 + h * w,
                    vision_tokens=[torch.randn(1, 2, 1, h, w, generator=g)], vision_token_shapes=[(1, h, w)],
                    vision_sequence_indexes=vision, vision_mse_loss_indexes=vision,
                    vision_timesteps=torch.ones(h * w), vision_noisy_frame_indexes=[torch.tensor([0])],
                    return_dict=False)
    if case == "odd":
        return cosmos3_inputs(model, 7, (2, 5, 3), noisy_frames=[1], sound=5, action=3, noisy_actions=[1, 2],
                              generator=g)
    return cosmos3_inputs(model, 5, (3, 4, 6), generator=g)


def flat(out) -> torch.Tensor:
    """Every prediction of a call (vision, then sound and action where present) as one flat tensor."""
    return torch.cat([t.flatten() for part in out if part is not None for t in part])


def cosmos3_call(name: str, case: str, config: dict, change=None):
    """One call of model ``name`` on ``case``'s inputs under ``config`` on this rank (``{}``: one process);
    ``change``: (name, value) of one input replaced. Returns (every prediction flat, collectives of the call)."""
    from cases_models import model_call

    model = build(name)
    inputs = inputs_of(model, case)
    if change is not None:
        inputs[change[0]] = change[1]
    out, counts = model_call(model, config, inputs)
    return flat(out), counts


def counts_of(config: dict) -> dict:
    """The collectives of one call: per layer two attentions, each 2 all-to-alls under Ulysses and ``ring - 1``
    exchange rounds under ring; the two streams gathered once each; under tp 4 all-reduces a layer."""
    counts = {"all_reduce": 4 * LAYERS} if config.get("tp", 1) > 1 else {}
    if config.get("ulysses", 1) > 1:
        counts["all_to_all"] = 2 * 2 * LAYERS
    if config.get("ring", 1) > 1:
        counts["ring_p2p"] = 2 * (config["ring"] - 1) * LAYERS
    if config.get("ulysses", 1) * config.get("ring", 1) > 1:
        counts["all_gather"] = 2
    return counts
