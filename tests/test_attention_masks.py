"""Masks in Ulysses, ring and USP attention: key padding, general boolean and additive masks, fully masked rows,
against torch's SDPA over the whole sequence in one process (what diffusers' native backend runs)."""

from __future__ import annotations

import pytest
import torch

from cases_mask import masked_inputs, sdpa, sp_masked_attention_case
from ditmesh.attention.local import attention_with_lse
from ditmesh.attention.ring import merge_partial
from ditmesh.testing import rel_err

KINDS = ["padding", "general", "additive", "text-only"]


@pytest.mark.parametrize("kind", KINDS)
def test_masked_local_attention_matches_sdpa_and_gives_fully_masked_rows_zero(kind):
    q, k, v, mask = masked_inputs(7, 6, 3, kind)
    out, lse = attention_with_lse(q, k, v, mask=mask)
    ref = sdpa(q, k, v, mask if mask.ndim == 4 else mask[:, None, None, :])
    assert torch.isfinite(out).all() and not torch.isnan(lse).any()
    assert rel_err(out, ref) <= 1e-6 if ref.norm() else out.abs().max() == 0
    if kind == "text-only":  # sample 0 keeps no key: 0 out (as SDPA gives), -inf LSE
        assert torch.isneginf(lse[0]).all() and out[0].abs().max() == 0


def test_merge_of_chunks_masked_whole_stays_finite_and_exact():
    # a row masked in one chunk adds nothing; a row masked in both stays 0 with LSE -inf, never NaN
    q, k, v, mask = masked_inputs(7, 6, 2, "general")
    out = lse = None
    for cols in (slice(0, 5), slice(5, 13)):
        out, lse = merge_partial(out, lse, *attention_with_lse(q, k[:, cols], v[:, cols], mask=mask[..., cols]))
    assert torch.isfinite(out).all() and not torch.isnan(lse).any()
    assert rel_err(out, sdpa(q, k, v, mask)) <= 1e-6
    assert torch.isneginf(lse[0, :, 1]).all() and out[0, 1].abs().max() == 0


def test_a_mask_that_does_not_cover_the_streams_tokens_is_refused():
    # one process, 3 text + 5 image tokens: a mask over 8 keys (and 1 or 8 query rows) is taken, any other refused
    from ditmesh import ParallelConfig
    from ditmesh.hooks import ForwardContext
    from ditmesh.mesh import ParallelMesh
    from ditmesh.models.base import SequencePlan
    from ditmesh.parallel.sequence import SequenceParallel

    class Adapter:
        sequence_plan = SequencePlan(streams=("text", "image"))

    mesh = ParallelMesh.build(ParallelConfig(), torch.device("cpu"))
    sp = SequenceParallel(mesh, Adapter, ForwardContext(), chunks=1)
    sp.begin()
    x = torch.zeros(2, 8, 4)
    sp.split(x[:, :3], 1, "text")
    sp.split(x[:, 3:], 1, "image")
    for shape in ((2, 8), (2, 1, 1, 8), (2, 3, 8, 8)):
        mask = torch.rand(shape) > 0.5
        assert torch.equal(sp.gathered_mask(mask, ("text", "image")), mask if mask.ndim == 4 else mask[:, None, None])
    for shape, covers in (((2, 7), "1 queries x 7 keys"), ((2, 1, 1, 9), "1 queries x 9 keys"),
                          ((2, 1, 5, 8), "5 queries x 8 keys")):
        with pytest.raises(ValueError, match=f"^the attention mask covers {covers} but the attention runs over 8 "
                                             r"tokens of \('text', 'image'\)$"):
            sp.gathered_mask(torch.ones(shape, dtype=torch.bool), ("text", "image"))


#: text, image tokens: 7 + 6 divides neither 2 nor 4 per stream (ranks hold 2,2,2,1 text tokens at 4)
SHAPES = [(7, 6), (9, 3)]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("text,image", SHAPES)
@pytest.mark.parametrize("ring,ulysses,chunks", [(1, 2, 1), (1, 2, 2), (2, 1, 1), (1, 4, 1), (4, 1, 1), (2, 2, 1)],
                         ids=["ulysses2", "ulysses2-chunks2", "ring2", "ulysses4", "ring4", "usp2x2"])
def test_masked_sequence_parallel_attention_matches_single_process(pools, ring, ulysses, chunks, text, image, kind):
    heads = 4 if kind != "general" else 5  # per-head masks with heads that do not divide the degree
    results = pools(ring * ulysses).run(sp_masked_attention_case, ring, ulysses, text, image, heads, kind, chunks)
    for err, finite, counts in results:
        assert finite and err <= 1e-5, err
        # the mask costs no collective: each rank slices its own copy
        assert counts == {k: n for k, n in {"all_to_all": 2 * chunks if ulysses > 1 else 0, "ring_p2p": ring - 1}.items() if n}


@pytest.mark.parametrize("ring,ulysses", [(1, 2), (2, 1)], ids=["ulysses2", "ring2"])
def test_masked_attention_over_one_stream_keeps_the_model_order(pools, ring, ulysses):
    # one stream (no text tokens): the ranks' order is the model's, so the mask is used without a reorder
    for kind in ("padding", "general"):
        for err, finite, _ in pools(2).run(sp_masked_attention_case, ring, ulysses, 0, 11, 4, kind):
            assert finite and err <= 1e-5
