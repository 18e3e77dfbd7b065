"""Step caching: a cached parallel run takes the decisions of the same cached run on one process and gives its
result (the statistics are reduced over the ranks that share a computation), under every axis."""

from __future__ import annotations

import pytest

from cases_cache import TINY_PROMPTS, cached_run
from ditmesh.testing import rel_err

FB = "fbcache:0.2"  # on the tiny trained pipeline at 10 steps: several steps cached (relative change 0.14-0.3)
TC = "teacache:threshold=0.2"  # at 10 steps the modulated input changes by 0.15-0.2 a step: every other step cached


def decisions(history: dict) -> dict:
    return {name: [(h["step"], h["branch"], h["skip"]) for h in entries] for name, entries in history.items()}


_REF: dict = {}


def reference(cache, **kwargs):
    key = (cache, tuple(sorted(kwargs.items())))
    if key not in _REF:
        _REF[key] = cached_run(None, {}, cache, **kwargs)
    return _REF[key]


def assert_same_run(got, ref):
    latents, history, _ = got
    ref_latents, ref_history, _ = ref
    assert decisions(history) == decisions(ref_history)
    assert rel_err(latents, ref_latents) <= 1e-5


def test_cache_off_and_threshold_zero_are_bit_identical_to_no_cache():
    plain = reference(None)[0]
    for setting in ("off", "dbcache:threshold=0", "teacache:threshold=0"):
        latents, history, _ = reference(setting)
        assert (latents == plain).all()
        assert not any(h["skip"] for entries in history.values() for h in entries)


def test_the_cache_skips_steps_and_stays_close_on_the_trained_pipeline():
    latents, history, _ = reference(FB)
    skipped = sum(h["skip"] for h in history["transformer"])
    assert 2 <= skipped <= 7, history
    assert rel_err(latents, reference(None)[0]) < 0.05


@pytest.mark.parametrize("config", [{"ulysses": 2}, {"ring": 2}, {"tp": 2}], ids=str)
def test_sequence_and_tensor_parallel_caches_decide_as_one_process(pools, config):
    ref = reference(FB)
    for got in pools(2).run(cached_run, None, config, FB):
        assert_same_run(got, ref)


def test_a_cached_ulysses_call_issues_one_decision_all_reduce(pools):
    ref = reference(FB)
    calls = len(ref[1]["transformer"])
    skipped = sum(h["skip"] for h in ref[1]["transformer"])
    for _, _, counts in pools(2).run(cached_run, None, {"ulysses": 2}, FB):
        # tiny pipeline: 3 double + 4 single blocks, one attention each; fbcache computes block 0 when it skips
        assert counts["all_to_all"] == 2 * (7 * (calls - skipped) + 1 * skipped)
        assert counts["all_reduce"] == calls - 1  # the first call has no previous step to compare with
        assert counts["all_gather"] == calls


def assert_same_cfg_runs(runs, ref):
    """Under cfg parallelism each cfg rank decides for its own branch: together they took one process's decisions."""
    ref_latents, ref_history, _ = ref
    merged = sorted({d for _, history, _ in runs for d in decisions(history)["transformer"]})
    assert merged == sorted(decisions(ref_history)["transformer"])
    for latents, _, _ in runs:
        assert rel_err(latents, ref_latents) <= 1e-5


def test_cfg_branches_decide_for_themselves_as_on_one_process(pools):
    ref = reference(FB, cfg=True)
    assert {h["branch"] for h in ref[1]["transformer"]} == {0, 1}
    assert_same_cfg_runs(pools(2).run(cached_run, None, {"cfg": 2}, FB, cfg=True), ref)


def test_data_parallel_ranks_decide_as_one_process_on_the_whole_batch(pools, model_checkpoints):
    """One process decides once per call for its whole batch; the dp ranks split that batch, so they add their sums
    and take that decision, where each alone would decide otherwise (the threshold sits between the two images'
    own changes at one step). FLUX (sequential CFG: dp splits the prompts) and SD3 (batched CFG: dp splits the
    [uncond, cond] batch, so a rank may hold a CFG half of both prompts)."""
    import torch

    # FLUX: the same starting noise per image, whether it runs in the batch of two or alone
    noise = torch.randn(2, 16, 64, generator=torch.Generator().manual_seed(3))  # 64x64: 16 tokens of 64 channels
    alone = [cached_run(None, {}, "dbcache:threshold=0", prompts=(p,), latents=noise[i:i + 1])[1]["transformer"]
             for i, p in enumerate(TINY_PROMPTS)]
    a, b = next((x["rel"], y["rel"]) for x, y in zip(alone[0], alone[1]) if x["rel"] and abs(x["rel"] - y["rel"]) > 1e-3)
    setting = f"dbcache:threshold={(a + b) / 2:.6f},warmup=0,max_skips=100"
    refs = [cached_run(None, {}, setting, prompts=(p,), latents=noise[i:i + 1]) for i, p in enumerate(TINY_PROMPTS)]
    assert decisions(refs[0][1]) != decisions(refs[1][1])  # each image alone would decide otherwise
    ref = cached_run(None, {}, setting, prompts=TINY_PROMPTS, latents=noise)
    for got in pools(2).run(cached_run, None, {"dp": 2}, setting, prompts=TINY_PROMPTS, latents=noise):
        assert_same_run(got, ref)
    # SD3: the dp ranks' halves of the batch, probed for a threshold between their own changes
    sd3 = model_checkpoints["sd3-tiny"]
    kwargs = dict(steps=6, size=32, guidance_scale=5.0, prompts=TINY_PROMPTS)
    probe = pools(2).run(cached_run, sd3, {"dp": 2}, "dbcache:threshold=0", **kwargs)
    halves = [[h.get("local_rel") for h in r[1]["transformer"]] for r in probe]
    a, b = next((x, y) for x, y in zip(*halves) if x is not None and abs(x - y) > 1e-3)
    setting = f"dbcache:threshold={(a + b) / 2:.6f},warmup=0,max_skips=100"
    ref = cached_run(sd3, {}, setting, **kwargs)
    for got in pools(2).run(cached_run, sd3, {"dp": 2}, setting, **kwargs):
        assert_same_run(got, ref)


def test_usp_and_cfg_with_ulysses_decide_as_one_process(pools):
    for got in pools(4).run(cached_run, None, {"ring": 2, "ulysses": 2}, FB):
        assert_same_run(got, reference(FB))
    assert_same_cfg_runs(pools(4).run(cached_run, None, {"cfg": 2, "ulysses": 2}, FB, cfg=True),
                         reference(FB, cfg=True))


SHARDED = {"ulysses2": {"ulysses": 2}, "ring2": {"ring": 2}, "usp2x2": {"ring": 2, "ulysses": 2}}


@pytest.mark.parametrize("axis", list(SHARDED))
@pytest.mark.parametrize("policy", ["dbcache", "teacache"])
def test_ranks_agree_where_their_own_shards_would_not(pools, policy, axis):
    # First learn each rank's own statistic per step (threshold 0: nothing skipped), then put the threshold between
    # the ranks' values at one step: a rank deciding on its shard alone would disagree with a peer there (and hang
    # in the next collective). Reduced over the ranks, every rank takes the one process's decisions.
    config = SHARDED[axis]
    pool = pools(2 * len(config))
    probe = pool.run(cached_run, None, config, f"{policy}:threshold=0")
    per_step = [[r[1]["transformer"][i].get("local_rel") for r in probe] for i in range(len(probe[0][1]["transformer"]))]
    if policy == "teacache":
        step = 1  # after the one warm-up step the accumulated change is that step's change alone
    else:
        split = [i for i, locs in enumerate(per_step) if None not in locs and max(locs) - min(locs) > 1e-3]
        assert split, "the shards never differ"
        step = split[len(split) // 2]
    locs = per_step[step]
    assert max(locs) - min(locs) > 1e-4, locs
    threshold = round((min(locs) + max(locs)) / 2, 6)
    assert len({loc < threshold for loc in locs}) == 2  # on their own shards the ranks would disagree here
    setting = (f"teacache:threshold={threshold}" if policy == "teacache"
               else f"dbcache:threshold={threshold},first=1,warmup=0,max_skips=100")
    runs = pool.run(cached_run, None, config, setting)
    if policy == "dbcache":  # skips change the later steps: the straddle must show in this run's own statistics
        straddled = [hs for hs in zip(*[r[1]["transformer"] for r in runs])
                     if all("local_rel" in h for h in hs) and len({h["local_rel"] < threshold for h in hs}) == 2]
        assert straddled, "no step where the shards' own statistics straddle the threshold"
    ref = cached_run(None, {}, setting)
    for got in runs:
        assert_same_run(got, ref)


def test_sd3_batched_cfg_cache_decides_over_both_halves_of_the_batch(pools, model_checkpoints):
    # SD3 runs [uncond, cond] in one call: one process decides on the whole batch, so the cfg ranks (a half each)
    # must add their sums. The threshold sits between the two halves' own statistics at one step.
    sd3 = model_checkpoints["sd3-tiny"]
    kwargs = dict(steps=6, size=32, guidance_scale=5.0)
    probe = pools(2).run(cached_run, sd3, {"cfg": 2}, "dbcache:threshold=0", **kwargs)
    halves = [[h.get("local_rel") for h in r[1]["transformer"]] for r in probe]
    a, b = next((x, y) for x, y in zip(*halves) if x is not None and abs(x - y) > 1e-3)
    setting = f"dbcache:threshold={(a + b) / 2:.6f},warmup=0,max_skips=100"
    ref = cached_run(sd3, {}, setting, **kwargs)
    for got in pools(2).run(cached_run, sd3, {"cfg": 2}, setting, **kwargs):
        assert_same_run(got, ref)


def test_sd3_and_wan_caches_under_ulysses_decide_as_one_process(pools, model_checkpoints):
    sd3 = model_checkpoints["sd3-tiny"]
    setting = "dbcache:threshold=0.5,warmup=1"
    ref = cached_run(sd3, {}, setting, steps=6, size=32, guidance_scale=5.0)
    for got in pools(2).run(cached_run, sd3, {"ulysses": 2}, setting, steps=6, size=32, guidance_scale=5.0):
        assert_same_run(got, ref)
    wan = model_checkpoints["wan2.2-tiny"]
    ref = cached_run(wan, {}, setting, steps=6, size=32, num_frames=5, guidance_scale=5.0)
    for got in pools(2).run(cached_run, wan, {"ulysses": 2}, setting, steps=6, size=32, num_frames=5,
                            guidance_scale=5.0):
        assert_same_run(got, ref)


def test_a_skip_leaves_out_the_middle_blocks_only():
    # count each block's own forward (wrapped before parallelize, so the cache's hooks call it): the first `first` and
    # the last `last` blocks run at every call, the middle ones only at the calls that compute
    import torch
    from diffusers import DiffusionPipeline

    from cases_cache import tiny_model
    from ditmesh import ParallelConfig, parallelize

    pipe = DiffusionPipeline.from_pretrained(tiny_model(), dtype=torch.float32)
    pipe.set_progress_bar_config(disable=True)
    blocks = list(pipe.transformer.transformer_blocks) + list(pipe.transformer.single_transformer_blocks)
    runs = [0] * len(blocks)
    for i, block in enumerate(blocks):
        def counted(*args, _i=i, _forward=block.forward, **kwargs):
            runs[_i] += 1
            return _forward(*args, **kwargs)
        block.forward = counted
    runtime = parallelize(pipe, ParallelConfig(), cache="dbcache:threshold=100,first=2,last=2,warmup=1,max_skips=9")
    pipe(prompt=TINY_PROMPTS[0], height=64, width=64, num_inference_steps=6, max_sequence_length=16,
         output_type="latent", generator=torch.Generator().manual_seed(7))
    history = runtime.caches["transformer"].history
    skipped = sum(h["skip"] for h in history)
    assert len(history) == 6 and skipped == 5  # every call after the first
    assert runs == [6, 6] + [6 - skipped] * (len(blocks) - 4) + [6, 6]


def test_step_scheduled_policies_compute_what_they_replay_before_they_skip():
    # a listed step with nothing computed yet runs (there is no residual to replay); taylor extrapolates only once
    # two steps ran (its first skip is the first off-interval step after the second computed one)
    static = reference("static:skip=0-1+5")[1]["transformer"]
    assert [h["skip"] for h in static][:6] == [False, True, False, False, False, True]
    taylor = reference("taylor:interval=2,warmup=0")[1]["transformer"]
    assert [h["skip"] for h in taylor][:6] == [False, False, False, True, False, True]


@pytest.mark.parametrize("setting", ["static:skip=3-4+6-7", "taylor:interval=3,warmup=2"])
def test_step_scheduled_policies_decide_alike_everywhere_without_a_collective(pools, setting):
    ref = reference(setting)
    assert any(h["skip"] for h in ref[1]["transformer"])
    for got in pools(2).run(cached_run, None, {"ulysses": 2}, setting):
        assert_same_run(got, ref)
        assert "all_reduce" not in got[2]  # decided by the step alone
    for config in ({"tp": 2}, {"ring": 2}):
        for got in pools(2).run(cached_run, None, config, setting):
            assert_same_run(got, ref)
    assert_same_cfg_runs(pools(2).run(cached_run, None, {"cfg": 2}, setting, cfg=True), reference(setting, cfg=True))
    both = reference(setting, prompts=TINY_PROMPTS)  # the schedule is the same for every dp group's images
    for got in pools(2).run(cached_run, None, {"dp": 2}, setting, prompts=TINY_PROMPTS):
        assert_same_run(got, both)


def test_compiled_blocks_run_inside_the_cache_and_decide_as_one_eager_process(pools):
    # the decision stays on the host around each block; only the block's own forward is compiled
    for setting in (FB, "taylor:interval=3,warmup=2"):
        ref = reference(setting)
        for got in pools(2).run(cached_run, None, {"ulysses": 2}, setting, compile=True):
            assert_same_run(got, ref)


@pytest.mark.parametrize("setting", ["static:skip=3-4+6-7", "taylor:interval=3,warmup=2"])
def test_step_scheduled_policies_replay_one_whole_call_graph_per_path(pools, setting):
    from cases_cache import path_graphed_cached_run

    ref = reference(setting)
    one = path_graphed_cached_run({}, setting)
    for latents, history, entries in [one] + pools(2).run(path_graphed_cached_run, {"ulysses": 2}, setting):
        assert_same_run((latents, history, None), ref)
        # one graph per path: computed or skipped (taylor's factor is a tensor the replay reads, so every factor
        # shares the skip path); each path that came back after its capture was replayed
        skips = [h["skip"] for h in ref[1]["transformer"]]
        assert {path[0] for _, path in entries} == {False, True}
        assert len(entries) == 2, entries
        assert entries[(0, (False, False))] == (True, skips.count(False) - 2)
        assert entries[(0, (True, not setting.startswith("static")))] == (True, skips.count(True) - 2)


def test_path_graphs_are_kept_per_cfg_branch():
    # true CFG calls the transformer twice per step with equal shapes; each branch keeps its own residuals, so a
    # graph captured on one branch's buffers must never replay for the other
    from cases_cache import path_graphed_cached_run

    setting = "static:skip=3-4+6-7"
    ref = reference(setting, cfg=True)
    latents, history, entries = path_graphed_cached_run({}, setting, cfg=True)
    assert_same_run((latents, history, None), ref)
    assert sorted(entries) == [(branch, (skip, False)) for branch in (0, 1) for skip in (False, True)]


def test_taylor_extrapolation_beats_replaying_the_last_residual():
    plain = reference(None, steps=28)[0]
    taylor = reference("taylor:interval=3,warmup=3", steps=28)
    replay = reference("static:skip=" + "+".join(str(h["step"]) for h in taylor[1]["transformer"] if h["skip"]),
                       steps=28)
    assert [h["skip"] for h in taylor[1]["transformer"]] == [h["skip"] for h in replay[1]["transformer"]]
    assert rel_err(taylor[0], plain) < rel_err(replay[0], plain)


def test_teacache_decides_as_one_process_under_every_axis(pools):
    import torch

    ref = reference(TC)
    calls = len(ref[1]["transformer"])
    skipped = sum(h["skip"] for h in ref[1]["transformer"])
    assert skipped >= 2
    for config in ({"ulysses": 2}, {"ring": 2}, {"tp": 2}):
        for got in pools(2).run(cached_run, None, config, TC):
            assert_same_run(got, ref)
            if config == {"ulysses": 2}:  # a skipped call runs no block: no all-to-all at all, one decision
                assert got[2]["all_to_all"] == 2 * 7 * (calls - skipped)
                assert got[2]["all_reduce"] == calls - 1
    assert_same_cfg_runs(pools(2).run(cached_run, None, {"cfg": 2}, TC, cfg=True), reference(TC, cfg=True))
    noise = torch.randn(2, 16, 64, generator=torch.Generator().manual_seed(3))
    ref = cached_run(None, {}, TC, prompts=TINY_PROMPTS, latents=noise)  # one process decides on the whole batch
    for got in pools(2).run(cached_run, None, {"dp": 2}, TC, prompts=TINY_PROMPTS, latents=noise):
        assert_same_run(got, ref)


def test_teacache_accumulates_rescaled_change_and_resets_when_it_computes():
    # the rule, written out again: after warm-up, add poly(rel) each step; skip while the sum stays under the
    # threshold; a computed step (and the last step) starts the sum afresh
    setting = "teacache:threshold=0.5,poly=2/0,max_skips=9"
    history = reference(setting)[1]["transformer"]
    acc, expected = 0.0, []
    for i, h in enumerate(history):
        allowed = h["rel"] is not None and h["step"] >= 1 and i < len(history) - 1
        acc = acc + 2 * h["rel"] if allowed else 0.0
        skip = allowed and acc < 0.5
        acc = acc if skip else 0.0
        expected.append(skip)
    assert [h["skip"] for h in history] == expected
    assert sum(expected) >= 2 and not all(expected[1:-1])  # it skipped, and it also had to compute again


def test_wan_teacache_reads_the_input_its_attention_reads_and_decides_as_one_process(pools, model_checkpoints):
    import torch
    from diffusers import DiffusionPipeline

    from ditmesh.hooks import bind_kwargs
    from ditmesh.models import adapter_for

    wan = model_checkpoints["wan2.2-tiny"]
    pipe = DiffusionPipeline.from_pretrained(wan, dtype=torch.float32)
    block = pipe.transformer.blocks[0]
    seen = {}

    def ours(module, args, kwargs):
        seen["ours"] = adapter_for(pipe.transformer).modulated_input(module, bind_kwargs(module.forward, args, kwargs))

    def attention(module, args):
        seen["attention"] = args[0]

    block.register_forward_pre_hook(ours, with_kwargs=True)
    block.attn1.register_forward_pre_hook(attention)
    pipe.set_progress_bar_config(disable=True)
    pipe("a cat", height=32, width=32, num_frames=5, num_inference_steps=1, max_sequence_length=16,
         output_type="latent")
    assert torch.equal(seen["ours"], seen["attention"])
    setting, kwargs = "teacache:threshold=0.3", dict(steps=6, size=32, num_frames=5, guidance_scale=5.0)
    ref = cached_run(wan, {}, setting, **kwargs)
    assert any(h["skip"] for h in ref[1]["transformer"])
    for got in pools(2).run(cached_run, wan, {"ulysses": 2}, setting, **kwargs):
        assert_same_run(got, ref)


def test_analyze_fits_the_teacache_rescaling_from_measured_change():
    from ditmesh.analyze import fit_teacache
    from ditmesh.options import CacheConfig

    xs = [0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6]
    records = {"transformer": {"call0": {"modulated": {"b.0": xs},
                                         "output": {"b.0": [0.0] * 7, "b.1": [2 * x + 0.01 for x in xs]}}}}
    fit = fit_teacache(records, degree=1)
    assert fit["pairs"] == 7 and abs(fit["poly"][0] - 2) < 1e-9 and abs(fit["poly"][1] - 0.01) < 1e-9
    assert CacheConfig.parse(fit["setting"]).poly == (2.0, 0.01)


def test_analyze_proposes_a_static_schedule_from_measured_change():
    from ditmesh.analyze import suggest_schedule
    from ditmesh.options import CacheConfig

    records = {"transformer": {"call0": {"output": {"b0": [0.5, 0.5, 0.5, 0.5, 0.5, 0.5],
                                                    "b1": [0.3, 0.05, 0.04, 0.03, 0.02, 0.3],
                                                    "b2": [0.3, 0.05, 0.04, 0.03, 0.02, 0.3]}}}}
    setting = suggest_schedule(records, 0.1)
    # steps 2-5 change little, but at most 3 steps in a row replay the last run (step 1): step 5 runs
    assert setting == "static:skip=2+3+4,first=1,last=0"
    assert CacheConfig.parse(setting).skip == (2, 3, 4)


def test_bad_cache_settings_are_refused_in_one_line():
    from ditmesh.options import CacheConfig
    from ditmesh.config import ConfigError

    assert CacheConfig.parse("default") == CacheConfig.parse("taylor:interval=4,warmup=3")
    for text, needle in [("magcache:0.1", "is not one of: off, dbcache, fbcache"),
                         ("teacache:poly=1/x", "coefficients like"), ("teacache:first=-1", "first >= 0"),
                         ("fbcache:abc", "is not a number"), ("dbcache:first=0", "first >= 1"),
                         ("dbcache:speed=2", "cache option 'speed'")]:
        with pytest.raises(ConfigError, match=needle):
            CacheConfig.parse(text)
