"""Functions run on every rank of a gloo worker pool for Kandinsky 6 SR's NABLA and Kandinsky 5's nabla attention
(tests/test_kandinsky6_sr.py, tests/test_kandinsky5.py).

On CPU, torch's eager ``flex_attention`` attends over every key whatever the ``BlockMask`` says when the mask is made
of full blocks only (NABLA's: ``mask_mod=None``), so one process and a parallel run would agree even with a wrong
mask. :func:`block_masks_applied` swaps in, for a call, a float32 emulation that applies the block mask as compiled
flex attention does on GPUs (SDPA under the mask expanded to tokens), in the reference and in the parallel run alike.
"""

from __future__ import annotations

import contextlib

import torch

from cases_models import transformer_call


def emulated_flex_attention(query, key, value, score_mod=None, block_mask=None, scale=None, enable_gqa=False,
                            return_lse=False, kernel_options=None):
    """flex attention ``[B, H, S, D]`` under ``block_mask``'s blocks (no ``score_mod``, no log-sum-exp)."""
    assert score_mod is None and not return_lse and not enable_gqa
    mask = None
    if block_mask is not None:
        rows, cols = block_mask.BLOCK_SIZE
        dense = block_mask.to_dense().bool().repeat_interleave(rows, -2).repeat_interleave(cols, -1)
        mask = dense[..., : query.shape[-2], : key.shape[-2]]
    return torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=scale)


@contextlib.contextmanager
def block_masks_applied():
    """Within the context, ``torch.nn.attention.flex_attention.flex_attention`` is :func:`emulated_flex_attention`."""
    from torch.nn.attention import flex_attention

    kept = flex_attention.flex_attention
    flex_attention.flex_attention = emulated_flex_attention
    try:
        yield
    finally:
        flex_attention.flex_attention = kept


def flex_backend(model) -> None:
    """The model's attention layers on diffusers' flex backend (what Kandinsky 5's pipeline sets for nabla). diffusers'
    ``set_attention_backend`` also makes it the process's active backend, for every model after it: that is put back
    (under the suite's shared processes, later files' models attended through flex and failed on their masks)."""
    from diffusers.models.attention_dispatch import _AttentionBackendRegistry

    active = _AttentionBackendRegistry._active_backend
    try:
        model.set_attention_backend("flex")
    finally:
        _AttentionBackendRegistry.set_active_backend(active)


def masked_transformer_call(arch: str, config: dict, inputs: dict, model_config: dict | None = None, prepare=None):
    """:func:`cases_models.transformer_call` with the block masks applied (:func:`block_masks_applied`)."""
    with block_masks_applied():
        return transformer_call(arch, config, inputs, model_config, prepare)
