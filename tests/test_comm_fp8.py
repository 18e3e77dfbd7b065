"""``comm_dtype="fp8"``: sequence-parallel payloads as float8_e4m3fn bytes with a float32 scale per token and head,
against one process that applies the same rounding where the tensors travel (``parallel.eight.emulate_fp8_comm``)."""

from __future__ import annotations

import pytest
import torch

from cases import flux_generate
from cases_eight import fp8_attention_case
from ditmesh.comm import fp8_bytes, fp8_pack, fp8_round, fp8_rows, fp8_unpack
from ditmesh.testing import rel_err

HEAD_DIM = 16  # cases_eight's q/k/v and flux-tiny's attention_head_dim


def test_fp8_payload_round_trip_is_the_rounding_and_travels_as_bytes():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 7, 5, 16, generator=g) * torch.logspace(-3, 3, 16)
    x[0, 0, 0] = 0.0  # an all-zero row stays zero (no 0/0)
    x[1, 2, 3, 4] = 1e30  # a huge element sets its row's scale; the rest of the row keeps its sign
    payload = fp8_pack(x, 16)
    assert payload.dtype == torch.uint8 and payload.numel() == fp8_bytes(x.numel(), 16) == 3 * 7 * 5 * 20
    back = fp8_unpack(payload, 16, torch.float32).view_as(x)
    assert torch.equal(back, fp8_round(x))
    assert torch.equal(back[0, 0, 0], torch.zeros(16)) and torch.isfinite(back).all()
    # the largest magnitude of each row is kept to fp8's precision (3 mantissa bits); each element within half a step
    assert ((back - x).abs() <= x.abs().amax(-1, keepdim=True) / 448 * 16 + x.abs() / 16).all()
    assert rel_err(back[2], x[2]) > 1e-3  # it does round
    # the same row gives the same bytes whether cut from a shard or from the whole tensor
    q_whole, s_whole = fp8_rows(x)
    q_shard, s_shard = fp8_rows(x[:, 3:5])
    assert torch.equal(q_whole[:, 3:5].view(torch.uint8), q_shard.view(torch.uint8)) and torch.equal(s_whole[:, 3:5], s_shard)


@pytest.mark.parametrize("method,world,seq,heads,ring,ulysses,chunks", [
    ("ulysses", 2, 15, 3, 1, 2, 1),  # uneven tokens and heads
    ("ulysses", 2, 16, 4, 1, 2, 2),  # two head groups pipelined
    ("ring", 2, 15, 2, 2, 1, 1),
    ("usp", 4, 18, 4, 2, 2, 1),
])
def test_fp8_payload_attention_matches_one_process_rounding(pools, method, world, seq, heads, ring, ulysses, chunks):
    for emulated, exact, counts, sent, exact_sent in pools(world).run(fp8_attention_case, method, seq, heads, ring,
                                                                      ulysses, chunks):
        assert emulated <= 1e-6
        assert exact > 1e-4  # the payloads were rounded
        # every payload is fp8 bytes plus a float32 scale per token and head: (D + 4) / (4 D) of the float32 bytes
        assert {dtype for _, dtype in sent} == {"uint8"} and {dtype for _, dtype in exact_sent} == {"float32"}
        for kind in counts:
            assert sent[kind, "uint8"] * 4 * HEAD_DIM == exact_sent[kind, "float32"] * (HEAD_DIM + 4)


def test_flux_ulysses_fp8_payloads_match_one_process_with_the_rounding(pools, flux_tiny):
    exact, _ = flux_generate(flux_tiny, {}, 2, 48, 48)
    ref, _ = flux_generate(flux_tiny, {}, 2, 48, 48, emulate={"layout": "ulysses"})
    outs = pools(2).run(flux_generate, flux_tiny, {"ulysses": 2}, 2, 48, 48, options={"comm_dtype": "fp8"})
    plain = pools(2).run(flux_generate, flux_tiny, {"ulysses": 2}, 2, 48, 48, options={})
    for (latents, counts, sent), (_, plain_counts, plain_sent) in zip(outs, plain):
        assert rel_err(latents, ref) <= 1e-5
        assert rel_err(latents, exact) > 1e-3
        assert counts == plain_counts == {"all_to_all": 2 * 4 * 2, "all_gather": 2}
        assert sent["all_to_all", "uint8"] * 4 * HEAD_DIM == plain_sent["all_to_all", "float32"] * (HEAD_DIM + 4)
        assert sent["all_gather", "float32"] == plain_sent["all_gather", "float32"]  # the exit gather stays exact


def test_flux_ring_fp8_payloads_stay_near_one_process_with_the_rounding(pools, flux_tiny):
    """The ring merges partial results in another order than one process, so a later layer's K/V differ by float32
    rounding before the quantizer and an element near an fp8 rounding boundary can round the other way: the run is
    near the emulation, not equal (docs/quantization.md)."""
    exact, _ = flux_generate(flux_tiny, {}, 2, 48, 48)
    ref, _ = flux_generate(flux_tiny, {}, 2, 48, 48, emulate={"layout": "ring"})
    for latents, counts, sent in pools(2).run(flux_generate, flux_tiny, {"ring": 2}, 2, 48, 48,
                                              options={"comm_dtype": "fp8"}):
        assert rel_err(latents, ref) < 0.5 * rel_err(ref, exact)
        assert counts == {"ring_p2p": 2 * 4, "all_gather": 2}
        assert set(sent) == {("ring_p2p", "uint8"), ("all_gather", "float32")}


@pytest.mark.parametrize("options,message", [
    ({"comm_dtype": "fp16"}, "comm_dtype='fp16' is not a communication dtype; use one of auto, fp8"),
    ({"comm_dtype": "fp8"}, "ulysses=ring=1 sends none"),
])
def test_bad_comm_dtype_is_refused_with_what_would_work(flux_tiny, options, message):
    from diffusers import FluxPipeline

    from ditmesh import ParallelConfig, parallelize
    from ditmesh.api import runtime_of
    from ditmesh.config import ConfigError

    pipe = FluxPipeline.from_pretrained(flux_tiny, dtype=torch.float32)
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        parallelize(pipe, ParallelConfig(), **options)
    assert runtime_of(pipe) is None




def test_fp8_packing_compiles_to_the_same_bytes():
    """Inside compiled blocks the packing and unpacking are traced with the all-to-all: inductor gives the eager
    rounding, bit for bit (the float8 and float32 views of the uint8 payload included)."""
    def round_trip(x):
        return fp8_unpack(fp8_pack(x * 2, 16), 16, x.dtype).view_as(x) + 1

    x = torch.randn(4, 7, 16, generator=torch.Generator().manual_seed(0))
    assert torch.equal(torch.compile(round_trip)(x), fp8_round(x * 2) + 1)


def test_fp8_packing_takes_a_scale_whose_size_one_dim_has_any_stride(monkeypatch):
    """inductor (on H200) laid out ``amax(keepdim=True)``'s ``[rows, 1]`` with a last stride of 165888, and a dtype
    view of such a tensor fails; the payload is the same bytes whatever the layout."""
    import ditmesh.comm as comm

    x = torch.randn(6, 16, generator=torch.Generator().manual_seed(1))
    expected = fp8_pack(x, 16)
    rows = comm.fp8_rows

    def strided(t):
        q, scale = rows(t)
        odd = torch.empty_strided(scale.shape, (1, 165888))
        odd.copy_(scale)
        return q, odd

    monkeypatch.setattr(comm, "fp8_rows", strided)
    assert torch.equal(comm.fp8_pack(x, 16), expected)
