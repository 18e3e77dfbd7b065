"""Ring attention and USP (ulysses x ring) on real gloo process groups, against single-process results.

What the collective counts mean (ditmesh.comm.COUNTS):
- ``ring_p2p``: one exchange round of the ring, i.e. one async batch holding this rank's send of the K/V
  chunk in hand to the next rank and its receive of the next chunk from the previous rank. A ring of N
  ranks runs N - 1 rounds per attention layer.
- ``all_to_all``: one Ulysses all-to-all (USP: 2 per attention layer, fused Q/K/V out and output back).
- ``all_gather``: the one gather of the output stream at the transformer's exit.
"""

from __future__ import annotations

import pytest
import torch

from cases_ring import flux_latents_and_call_counts, reference_attention, ring_attention_case, usp_attention_case

FLUX_TINY_ATTENTION_LAYERS = 4  # 2 double-stream + 2 single-stream blocks, one attention each
STEPS = 2


@pytest.mark.parametrize("world,seq,heads", [(2, 16, 2), (2, 15, 3), (4, 16, 2), (4, 7, 3), (4, 3, 2)])
def test_ring_attention_even_and_uneven_lengths_matches_full_attention(pools, world, seq, heads):
    # (4, 3): one rank holds no tokens at all; its empty chunk still travels the ring
    for err, counts, finite in pools(world).run(ring_attention_case, seq, heads):
        assert finite and err < 1e-6
        assert counts == {"ring_p2p": world - 1}


def test_ring_attention_with_huge_logits_stays_finite_and_exact(pools):
    # scores of order 1e4: exp() of a raw score overflows float32, the LSE merge must not
    for err, counts, finite in pools(4).run(ring_attention_case, 13, 2, 3, 3000.0):
        assert finite and err < 1e-5
        assert counts == {"ring_p2p": 3}


def test_lse_merge_of_key_blocks_is_stable_for_large_logits():
    from ditmesh.attention.local import attention_with_lse
    from ditmesh.attention.ring import merge_partial

    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(1, 6, 2, 8, generator=g) for _ in range(3))
    q = q * 5000.0  # logits ~ 1e4; block maxima differ by thousands
    out = lse = None
    for block in (slice(0, 1), slice(1, 4), slice(4, 6)):
        out, lse = merge_partial(out, lse, *attention_with_lse(q, k[:, block], v[:, block]))
    assert torch.isfinite(out).all() and torch.isfinite(lse).all()
    ref = reference_attention(q, k, v)
    assert float((out.double() - ref).norm() / ref.norm()) < 1e-6


@pytest.mark.parametrize("seq,heads", [(16, 4), (13, 3)])
def test_usp_2x2_matches_full_attention_and_places_ulysses_inner(pools, seq, heads):
    results = pools(4).run(usp_attention_case, seq, heads, 2, 2)
    for rank, (err, counts, placement) in enumerate(results):
        assert err < 1e-6
        assert counts == {"all_to_all": 2, "ring_p2p": 1}
        # ring-major sp rank == the DeviceMesh's row-major order == the rank order of the combined group
        assert placement["sp_rank"] == placement["device_mesh_index"] == placement["rank_in_sp_group"] == rank
        # ulysses on consecutive ranks (inner axis), ring across them (outer axis)
        assert placement["ulysses_group_ranks"] == [rank - rank % 2, rank - rank % 2 + 1]
        assert placement["ring_group_ranks"] == [rank % 2, rank % 2 + 2]


_REFERENCES: dict[tuple, torch.Tensor] = {}


def _single_process_latents(flux_tiny: str, height: int, width: int, text_len: int) -> torch.Tensor:
    key = (height, width, text_len)
    if key not in _REFERENCES:
        _REFERENCES[key] = flux_latents_and_call_counts(flux_tiny, {}, STEPS, height, width, text_len)[0]
    return _REFERENCES[key]


def _expected_per_call(ring: int, ulysses: int) -> dict:
    per_layer = {"ring_p2p": ring - 1, "all_to_all": 2 if ulysses > 1 else 0}
    counts = {kind: n * FLUX_TINY_ATTENTION_LAYERS for kind, n in per_layer.items() if n}
    counts["all_gather"] = 1
    return counts


@pytest.mark.parametrize("size,text_len,image_tokens", [(64, 32, 16), (48, 30, 9)], ids=["even", "uneven"])
@pytest.mark.parametrize("ring,ulysses", [(2, 1), (4, 1), (2, 2), (1, 2), (1, 4)],
                         ids=["ring2", "ring4", "ulysses2xring2", "ulysses2", "ulysses4"])
def test_flux_sequence_parallel_matches_single_process(pools, flux_tiny, ring, ulysses, size, text_len, image_tokens):
    # uneven: 9 image and 30 text tokens do not divide 4 (ring 4: 11,10,9,9 tokens; USP ring chunks 21,18)
    ref = _single_process_latents(flux_tiny, size, size, text_len)
    outs = pools(ring * ulysses).run(flux_latents_and_call_counts, flux_tiny, {"ring": ring, "ulysses": ulysses},
                                     STEPS, size, size, text_len)
    expected = _expected_per_call(ring, ulysses)
    for latents, per_call, total, tokens in outs:
        assert tokens == {"text": text_len, "image": image_tokens}
        assert float((latents - ref).norm() / ref.norm()) <= 1e-5
        assert per_call == [expected] * STEPS
        assert total == {kind: n * STEPS for kind, n in expected.items()}
    assert torch.equal(outs[0][0], outs[-1][0])
