"""Ulysses sequence parallelism on real gloo process groups, against single-process results."""

from __future__ import annotations

import time

import pytest
import torch

from cases import (flux_generate, new_groups_case, os_threads, rank_one_dies_case, rank_zero_fails_case,
                   ulysses_attention_case, world_info)
from ditmesh.comm import split_sizes
from ditmesh.testing import rel_err


def test_pool_ranks_are_real_processes(pools):
    assert pools(2).run(world_info) == [(0, 2), (1, 2)]


def test_a_failed_rank_does_not_leave_the_others_waiting():
    from ditmesh.testing import ProcessPool, RankError

    pool = ProcessPool(2, timeout_s=300, error_grace_s=2)
    try:
        start = time.monotonic()
        with pytest.raises(RankError, match="rank 0 fails before the barrier"):
            pool.run(rank_zero_fails_case)
        # rank 1 would wait out the 300 s collective timeout; the pool stops it instead
        assert pool.closed and time.monotonic() - start < 60
    finally:
        pool.close(force=True)


def test_the_groups_a_case_creates_are_destroyed_after_it(pools):
    # a gloo group keeps a thread that wakes every 10 ms: kept for every case, they slowed the suite as it went
    pool = pools(2)
    before = pool.run(os_threads)
    assert pool.run(new_groups_case, 4) == [16.0, 16.0]
    assert pool.run(os_threads) == before


@pytest.mark.parametrize("how, said", [("kill", r"signal SIGKILL\n"), ("crash", r"signal SIGSEGV\n.*Fatal Python error")])
def test_a_rank_whose_process_dies_is_named_with_its_signal_at_once(how, said):
    from ditmesh.testing import ProcessPool, RankError

    pool = ProcessPool(2, timeout_s=300, error_grace_s=2)
    try:
        start = time.monotonic()
        with pytest.raises(RankError, match=rf"failed on rank\(s\) [^\n]*; rank 1:\nthe worker process of rank 1 \(pid \d+\) ended with {said}") as info:
            pool.run(rank_one_dies_case, how)
        assert pool.closed and time.monotonic() - start < 60  # not rank 0's 300 s collective timeout
        if how == "crash":
            assert "rank_one_dies_case" in str(info.value)  # the fault handler's stack of the crashed rank
    finally:
        pool.close(force=True)


def test_a_crash_report_keeps_the_stacks_before_a_long_list_of_extension_modules():
    from ditmesh.testing import fault_stacks

    log = ("Fatal Python error: Segmentation fault\n\nCurrent thread 0x1 (most recent call first):\n"
           '  File "cases.py", line 44 in rank_one_dies_case\n\n'
           "Extension modules: " + ", ".join(f"c{i:050d}.kernel" for i in range(400)) + " (total: 400)\n")
    kept = fault_stacks(log)
    assert "rank_one_dies_case" in kept and "Extension modules" not in kept and len(kept) < 4000


@pytest.mark.parametrize("batch", [1, 2])
@pytest.mark.parametrize("world,seq,heads", [(2, 16, 4), (2, 15, 3), (4, 18, 6), (4, 7, 6)])
def test_ulysses_attention_matches_full_attention_even_and_uneven(pools, world, seq, heads, batch):
    results = pools(world).run(ulysses_attention_case, seq, heads, 0, 1, batch)
    for rank, (err, counts, calls, cats) in enumerate(results):
        assert err < 1e-6
        assert counts == {"all_to_all": 2}  # one fused Q/K/V exchange, one for the output
        assert calls == [split_sizes(heads, world)[rank]]  # one local attention over this rank's heads
        # one concatenation joins the output's head chunks; at batch 1 attention reads Q/K/V in place from the
        # received buffer, at batch 2 the received sequence chunks are joined by one more
        assert cats == (1 if batch == 1 else 2)


@pytest.mark.parametrize("batch", [1, 2])
@pytest.mark.parametrize("world,seq,heads,chunks,groups", [
    (2, 16, 4, 2, 2),   # 2 heads per rank -> 2 groups of 1
    (4, 18, 6, 2, 2),   # heads 2,2,1,1 per rank: rank 2's second group is empty, the group is not
    (4, 7, 6, 3, 2),    # 3 groups asked, at most 2 heads on a rank: the empty third group is left out
    (2, 15, 3, 4, 2),   # more groups than heads per rank
])
def test_ulysses_head_group_pipeline_matches_full_attention(pools, world, seq, heads, chunks, groups, batch):
    results = pools(world).run(ulysses_attention_case, seq, heads, 0, chunks, batch)
    for rank, (err, counts, calls, cats) in enumerate(results):
        assert err < 1e-6
        assert counts == {"all_to_all": 2 * groups}
        # this rank attends once per group in which it holds heads, over all of its heads in total
        assert sum(calls) == split_sizes(heads, world)[rank] and 1 <= len(calls) <= groups
        # the output's head chunks are joined once; at batch 2 each group's received sequence chunks once more
        assert cats == (1 if batch == 1 else 1 + groups)


@pytest.mark.parametrize("chunks", [1, 2])
def test_flux_ulysses_head_group_pipeline_matches_single_process(pools, flux_tiny, chunks):
    ref, _ = flux_generate(flux_tiny, {}, 2, 48, 48)
    for latents, counts in pools(2).run(flux_generate, flux_tiny, {"ulysses": 2}, 2, 48, 48, chunks=chunks):
        assert rel_err(latents, ref) <= 1e-5
        assert counts == {"all_to_all": 2 * 4 * 2 * chunks, "all_gather": 2}


@pytest.mark.parametrize("world", [2, 4])
def test_flux_ulysses_matches_single_process(pools, flux_tiny, world):
    ref, _ = flux_generate(flux_tiny, {})
    outs = pools(world).run(flux_generate, flux_tiny, {"ulysses": world}, 2)
    blocks = 4  # flux-tiny: 2 double + 2 single blocks
    for latents, counts in outs:
        assert rel_err(latents, ref) <= 1e-5
        # per transformer call: 2 all-to-alls per attention layer + 1 all-gather at the exit; 2 steps
        assert counts == {"all_to_all": 2 * blocks * 2, "all_gather": 2}
    assert torch.equal(outs[0][0], outs[-1][0])


def test_flux_ulysses_uneven_tokens_and_heads_matches_single_process(pools, flux_tiny):
    # 48x48 -> 9 image tokens, 30 text tokens: neither divides 4; 6 heads do not divide 4 either.
    ref, _ = flux_generate(flux_tiny, {}, 2, 48, 48)
    for latents, _ in pools(4).run(flux_generate, flux_tiny, {"ulysses": 4}, 2, 48, 48):
        assert rel_err(latents, ref) <= 1e-5


def test_consistency_check_passes_on_identical_ranks(pools, flux_tiny):
    ref, _ = flux_generate(flux_tiny, {}, 1)
    for latents, counts in pools(2).run(flux_generate, flux_tiny, {"ulysses": 2}, 1, check_consistency=True):
        assert rel_err(latents, ref) <= 1e-5
        assert counts["check"] > 0


def test_consistency_check_catches_ranks_with_different_latents(pools, flux_tiny):
    from cases import diverging_ranks_case

    messages = pools(2).run(diverging_ranks_case, flux_tiny)
    assert all(m is not None and "ranks disagree on 'hidden_states'" in m for m in messages)


def test_flux_ulysses_with_compiled_blocks_matches_single_process(pools, flux_tiny):
    # regional torch.compile traces the all-to-alls inside each block (functional collectives)
    ref, _ = flux_generate(flux_tiny, {}, 2)
    for latents, counts in pools(2).run(flux_generate, flux_tiny, {"ulysses": 2}, 2, compile=True):
        assert rel_err(latents, ref) <= 1e-5
        assert counts == {"all_gather": 2}  # all-to-alls inside compiled graphs are not host-counted


def test_default_head_groups_pipeline_only_eager_gpu_runs():
    from ditmesh.parallel.sequence import default_chunks

    assert default_chunks(torch.device("cuda", 0)) == 2
    assert default_chunks(torch.device("cuda", 0), compiled=True) == 1  # measured: no gain once compiled
    assert default_chunks(torch.device("cpu")) == 1
