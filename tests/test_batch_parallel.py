"""Data and CFG parallelism against single-process runs on the same weights and inputs (gloo, float32)."""

from __future__ import annotations

from cases_batch import flux_call
from ditmesh.testing import rel_err

TRUE_CFG = {"prompt": "a red circle", "negative_prompt": "a blue square", "true_cfg_scale": 4.0}
THREE_PROMPTS = {"prompt": ["a red circle", "a green triangle", "a blue square"]}


def test_flux_true_cfg_cfg2_matches_single_with_one_exchange_per_step(pools, flux_tiny):
    ref, _ = flux_call(flux_tiny, {}, TRUE_CFG)
    for latents, counts in pools(2).run(flux_call, flux_tiny, {"cfg": 2}, TRUE_CFG):
        assert rel_err(latents, ref) <= 1e-5
        assert counts == {"all_gather": 2}  # 2 steps x one cond/uncond exchange


def test_flux_dp2_three_prompts_matches_single_same_order(pools, flux_tiny):
    ref, _ = flux_call(flux_tiny, {}, THREE_PROMPTS)
    assert ref.shape[0] == 3
    for latents, counts in pools(2).run(flux_call, flux_tiny, {"dp": 2}, THREE_PROMPTS):
        assert rel_err(latents, ref) <= 1e-5
        for i in range(3):  # every image is the one a single process makes, in order
            assert rel_err(latents[i], ref[i]) <= 1e-5
        assert counts == {"all_gather": 2}  # one batch gather per transformer call


def test_flux_dp2_one_image_leaves_a_rank_an_empty_chunk_without_a_cache(pools, flux_tiny):
    # fewer images than dp ranks: the second rank computes nothing and still takes part in the gather (only step
    # caching and the redundancy probe, which need every rank to compute every call, refuse it)
    call = {"prompt": "a red circle"}
    ref, _ = flux_call(flux_tiny, {}, call)
    for latents, counts in pools(2).run(flux_call, flux_tiny, {"dp": 2}, call):
        assert not isinstance(latents, str), latents
        assert rel_err(latents, ref) <= 1e-5 and counts == {"all_gather": 2}


def test_flux_dp2_images_per_prompt_uneven(pools, flux_tiny):
    call = {"prompt": "a red circle", "num_images_per_prompt": 3}
    ref, _ = flux_call(flux_tiny, {}, call)
    for latents, _ in pools(2).run(flux_call, flux_tiny, {"dp": 2}, call):
        assert rel_err(latents, ref) <= 1e-5


def test_flux_cfg2_x_ulysses2_matches_single(pools, flux_tiny):
    ref, _ = flux_call(flux_tiny, {}, TRUE_CFG)
    for latents, counts in pools(4).run(flux_call, flux_tiny, {"cfg": 2, "ulysses": 2}, TRUE_CFG):
        assert rel_err(latents, ref) <= 1e-5
        # per step (2 steps): the computing call does 4 blocks x 2 all-to-alls + 1 sequence gather; the
        # skipped call does nothing (no gather of a placeholder); then the cfg exchange
        assert counts == {"all_to_all": 2 * 4 * 2, "all_gather": 2 * 2}


def test_flux_dp2_x_cfg2_four_ranks_matches_single(pools, flux_tiny):
    call = dict(TRUE_CFG, prompt=["a red circle", "a green triangle", "a blue square"],
                negative_prompt=["a blue square"] * 3)
    ref, _ = flux_call(flux_tiny, {}, call)
    for latents, _ in pools(4).run(flux_call, flux_tiny, {"dp": 2, "cfg": 2}, call):
        assert rel_err(latents, ref) <= 1e-5


def test_cfg2_with_guidance_off_is_rejected_with_what_to_change(pools, flux_tiny):
    results = pools(2).run(flux_call, flux_tiny, {"cfg": 2}, {"prompt": "a red circle"})
    for r in results:
        assert isinstance(r, str) and "cfg=2 needs classifier-free guidance" in r and "--negative-prompt" in r


def test_flux_cfg2_x_tp2_hybrid_matches_single(pools, flux_tiny):
    ref, _ = flux_call(flux_tiny, {}, TRUE_CFG)
    for latents, counts in pools(4).run(flux_call, flux_tiny, {"cfg": 2, "tp": 2}, TRUE_CFG):
        assert rel_err(latents, ref) <= 1e-5
        assert counts["all_reduce"] == 2 * (2 * 4 + 2 * 1)  # 2 computed calls x (4 per double + 1 per single block)
