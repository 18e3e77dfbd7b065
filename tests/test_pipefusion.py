"""PipeFusion (pp): exact where it should be (warm-up over every step equals one process), the stale schedule equal to
its single-process emulation, the point-to-point sends and broadcasts of every step counted, each rank holding only
its stage's blocks, and the settings checked."""

from __future__ import annotations

import math

import pytest
import torch

from cases_pipefusion import flux_stale_emulation, pipeline_run, stage_loaded_elsewhere, stage_weights
from ditmesh.config import ConfigError, ParallelConfig
from ditmesh.options import RunOptions
from ditmesh.parallel.pipefusion import split_stages
from ditmesh.testing import RankError, rel_err

STEPS = 3
#: flux-tiny at 64x64 with 16 text tokens: 16 image tokens, 96 features per token (6 heads x 16), 64 out channels
FLUX_IMAGE, FLUX_TEXT, FLUX_WIDTH, FLUX_OUT = 16, 16, 96, 64

_REF: dict = {}


def reference_steps(path: str, steps: int) -> torch.Tensor:
    key = (path, "steps", steps)
    if key not in _REF:
        _REF[key] = pipeline_run(path, {}, steps=steps)[0]
    return _REF[key]


def pool_run(pools, path: str, config: dict, **kwargs) -> list:
    """``pipeline_run`` on every rank of the session's pool for ``config``, run once per process: the cases that need
    the same run (a stale schedule checked against its emulation, and the eager reference of its compiled run) share
    it."""
    key = (path, repr(sorted(config.items())), repr(sorted(kwargs.items())))
    if key not in _REF:
        _REF[key] = pools(math.prod(config.values())).run(pipeline_run, path, config, **kwargs)
    return _REF[key]


def reference(path: str, **kwargs) -> torch.Tensor:
    key = (path, tuple(sorted((k, repr(v)) for k, v in kwargs.items())))
    if key not in _REF:
        _REF[key] = pipeline_run(path, {}, steps=STEPS, **kwargs)[0]
    return _REF[key]


def family_case(name: str, checkpoints: dict, flux_tiny: str) -> tuple[str, dict]:
    """(pipeline folder, pipeline-call options) of a family's tiny synthetic pipeline."""
    if name == "flux":
        return flux_tiny, {}
    if name == "sd3":
        return checkpoints["sd3-tiny"], {}
    return checkpoints["wan2.2-tiny"], {"frames": 5, "height": 32, "width": 32}


def sends_per_step(counts: list[dict], kind: str) -> list[int]:
    return [c.get(kind, 0) for c in counts]


# -- stages and settings ---------------------------------------------------------------------------------------
def test_stages_are_contiguous_and_balanced_by_block_cost():
    assert split_stages([3, 3, 1, 1], 2) == [range(0, 1), range(1, 4)]
    assert split_stages([1] * 6, 3) == [range(0, 2), range(2, 4), range(4, 6)]
    assert split_stages([1, 1, 1, 5], 2) == [range(0, 3), range(3, 4)]
    with pytest.raises(ConfigError, match="pp=5 exceeds the 4 transformer blocks"):
        split_stages([1] * 4, 5)


@pytest.mark.parametrize("args, message", [
    ((2, 1, 1, 64), "pp_patches=1 is fewer than the pp=2 stages"),
    ((2, None, 0, 64), "pp_warmup=0 must be >= 1"),
    ((2, None, -1, 64), "pp_warmup=-1 must be >= 1"),
    ((2, 2, 1, 0), "pp_chunk_bytes=0 must be a positive byte count"),
    ((2, 2.5, 1, 64), "pp_patches=2.5 is not an integer"),
])
def test_bad_pipefusion_settings_are_refused_in_one_line(args, message):
    with pytest.raises(ConfigError, match=message) as err:
        pp, patches, warmup, chunk_bytes = args
        RunOptions.create(ParallelConfig(pp=pp), pp_patches=patches, pp_warmup=warmup, pp_chunk_bytes=chunk_bytes)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("option, message", [({"fuse_qkv": True}, "fuse_qkv does not run with PipeFusion"),
                                             ({"cache": "fbcache:0.1"}, "cache dbcache does not run with PipeFusion"),
                                             ({"cache": "teacache:0.1"}, "cache teacache does not run with PipeFusion"),
                                             ({"pp_patches": 1}, "pp_patches=1 is fewer than the pp=2 stages")])
def test_parallelize_refuses_what_pipefusion_does_not_run_with(flux_tiny, option, message):
    from diffusers import DiffusionPipeline

    from ditmesh import parallelize

    pipe = DiffusionPipeline.from_pretrained(flux_tiny, dtype=torch.float32)
    with pytest.raises(ConfigError, match=message):
        parallelize(pipe, ParallelConfig(pp=2), **option)


def test_a_family_whose_block_lists_pass_different_activations_is_refused():
    from ditmesh import parallelize
    from ditmesh.synth import build_transformer

    class Pipe:  # parallelize() needs only `.transformer`
        transformer = build_transformer("chroma-tiny", seed=0, dtype=torch.float32)

    with pytest.raises(NotImplementedError, match="PipeFusion does not run chroma yet: its single_transformer_blocks "
                                                  "take hidden_states but its transformer_blocks return"):
        parallelize(Pipe, ParallelConfig(pp=2))


def test_a_family_pipefusion_was_not_built_for_is_refused():
    # its block lists declare no token streams: its attention may not read PipeFusion's K/V buffers
    from ditmesh import parallelize
    from ditmesh.synth import build_transformer

    class Pipe:
        transformer = build_transformer("qwenimage-tiny", seed=0, dtype=torch.float32)

    with pytest.raises(NotImplementedError, match=r"PipeFusion does not run qwenimage yet \(its transformer_blocks "
                                                  r"declare no token streams\); use pp=1"):
        parallelize(Pipe, ParallelConfig(pp=2))


@pytest.mark.parametrize("config", [{"pp": 4}, {"pp": 2, "ulysses": 2}], ids=["pp4", "pp2xulysses2"])
def test_stages_send_and_receive_on_their_own_two_rank_groups(pools, flux_tiny, config):
    # NCCL runs one group's operations in order: a send on the group of the receive posted before it would wait
    # for that receive; each neighbour pair has its own group, so a stage's receives and sends never share one
    from cases_pipefusion import neighbour_ranks

    results = pools(4).run(neighbour_ranks, flux_tiny, config)
    for rank, r in enumerate(results):
        stage, line = r["stage"], r["pp"]
        assert line[stage] == rank and len(line) == config["pp"]
        assert r["previous"] == (None if stage == 0 else line[stage - 1:stage + 1])
        assert r["next"] == (None if stage == config["pp"] - 1 else line[stage:stage + 2])
        # every message of the run (1 exact call, then a stale one of pp patches) on the pair's group, to the peer
        sends = [(r["next"], line[stage + 1])] * (1 + config["pp"]) if r["next"] else []
        receives = [(r["previous"], line[stage - 1])] * (1 + config["pp"]) if r["previous"] else []
        assert [(g, p) for kind, g, p in r["messages"] if kind == "send"] == sends
        assert [(g, p) for kind, g, p in r["messages"] if kind == "recv"] == receives


# -- exact: warm-up over every step ----------------------------------------------------------------------------
@pytest.mark.parametrize("patches", [None, 3], ids=["patches=pp", "patches=3"])
@pytest.mark.parametrize("family", ["flux", "sd3", "wan"])
def test_warmup_over_every_step_matches_single_process(pools, model_checkpoints, flux_tiny, family, patches):
    path, call = family_case(family, model_checkpoints, flux_tiny)
    ref = reference(path, **call)
    results = pools(2).run(pipeline_run, path, {"pp": 2}, steps=STEPS, per_step=True, pp_warmup=STEPS,
                           pp_patches=patches, **call)
    calls = 2 if family == "wan" else 1  # Wan's CFG calls the transformer twice a step; SD3 batches it
    for rank, (latents, _, per_step, _, _) in enumerate(results):
        assert rel_err(latents, ref) <= 1e-5
        # one patch per call, stage after stage: one message from stage 0 to stage 1, one broadcast of the output
        assert per_step == [{"pp_send" if rank == 0 else "pp_recv": calls, "broadcast": calls}] * STEPS


# -- stale: the PipeFusion schedule --------------------------------------------------------------------------
@pytest.mark.parametrize("patches", [2, 3])
def test_stale_schedule_matches_its_single_process_emulation(pools, flux_tiny, patches):
    emulated = flux_stale_emulation(flux_tiny, patches, warmup=1, steps=STEPS)
    assert rel_err(emulated, reference(flux_tiny)) > 1e-3  # the stale steps do differ from the exact run
    results = pool_run(pools, flux_tiny, {"pp": 2}, steps=STEPS, per_step=True, pp_warmup=1, pp_patches=patches)
    for rank, (latents, _, per_step, _, _) in enumerate(results):
        assert rel_err(latents, emulated) <= 1e-5
        kind = "pp_send" if rank == 0 else "pp_recv"
        assert per_step == [{kind: 1, "broadcast": 1}] + [{kind: patches, "broadcast": 1}] * (STEPS - 1)


@pytest.mark.parametrize("family", ["sd3", "wan"])
def test_stale_schedule_runs_patch_by_patch_on_sd3_and_wan(pools, model_checkpoints, flux_tiny, family):
    path, call = family_case(family, model_checkpoints, flux_tiny)
    ref = reference(path, **call)
    results = pools(2).run(pipeline_run, path, {"pp": 2}, steps=STEPS, per_step=True, pp_warmup=1, pp_patches=3,
                           **call)
    calls = 2 if family == "wan" else 1
    assert rel_err(results[0][0], results[1][0]) == 0  # every rank steps on the same broadcast prediction
    # a step is exact in warm-up and where its transformer runs for the first time in the run (Wan 2.2's low-noise
    # expert takes over part-way, with empty K/V buffers); else 3 patches a call
    experts = results[0][4]
    exact = [step < 1 or experts[step] != experts[step - 1] for step in range(STEPS)]
    assert exact.count(False) >= 1, experts
    for rank, (latents, _, per_step, _, _) in enumerate(results):
        assert 1e-6 < rel_err(latents, ref) < 0.2
        kind = "pp_send" if rank == 0 else "pp_recv"
        assert per_step == [{kind: (1 if e else 3) * calls, "broadcast": calls} for e in exact]


def test_messages_travel_in_pieces_of_at_most_the_chunk(pools, flux_tiny):
    chunk = 4096  # bytes: 1024 float32 values
    results = pools(2).run(pipeline_run, flux_tiny, {"pp": 2}, steps=STEPS, per_step=True, pp_warmup=1,
                           pp_chunk_bytes=chunk)
    # the default patches (pp = 2): the run of test_stale_schedule_matches_its_single_process_emulation[2]
    unchunked = pool_run(pools, flux_tiny, {"pp": 2}, steps=STEPS, per_step=True, pp_warmup=1, pp_patches=2)[0][0]
    pieces = lambda values: math.ceil(values * 4 / chunk)  # noqa: E731
    whole = pieces((FLUX_IMAGE + FLUX_TEXT) * FLUX_WIDTH)  # the warm-up step: every token, text and image
    # patch 0 carries the text and half the image, patch 1 the other half
    stale = pieces((FLUX_IMAGE // 2 + FLUX_TEXT) * FLUX_WIDTH) + pieces(FLUX_IMAGE // 2 * FLUX_WIDTH)
    out = pieces(FLUX_IMAGE * FLUX_OUT)
    assert (whole, stale, out) == (3, 4, 1)
    for rank, (latents, _, per_step, _, _) in enumerate(results):
        assert torch.equal(latents, unchunked)
        kind = "pp_send" if rank == 0 else "pp_recv"
        assert per_step == [{kind: whole, "broadcast": out}] + [{kind: stale, "broadcast": out}] * (STEPS - 1)


def test_patches_beyond_the_image_tokens_are_refused_at_the_call(pools, flux_tiny):
    with pytest.raises(RankError, match="pp_patches=17 exceeds the 16 image tokens of this call; use at most 16"):
        pools(2).run(pipeline_run, flux_tiny, {"pp": 2}, steps=1, pp_patches=17)


# -- memory and the way back ---------------------------------------------------------------------------------
@pytest.mark.parametrize("stage_load", [False, True], ids=["loaded-whole", "stage-loaded"])
def test_each_rank_holds_only_its_stage_blocks_and_remove_gives_them_back(pools, flux_tiny, stage_load):
    from diffusers import DiffusionPipeline

    held = pools(2).run(stage_weights, flux_tiny, {"pp": 2}, stage_load=stage_load)
    stages = held[0]["stages"]
    assert stages == [(0, 1), (1, 4)]  # 2 double blocks (334,720 parameters each), 2 single (139,328): 334,720 | 613,376
    for rank, h in enumerate(held):
        start, stop = stages[rank]
        assert h["held"] == [n if start <= i < stop else 0 for i, n in enumerate(h["full"])]
    original = DiffusionPipeline.from_pretrained(flux_tiny, dtype=torch.float32).transformer.state_dict()
    results = pools(2).run(pipeline_run, flux_tiny, {"pp": 2}, steps=STEPS, pp_warmup=STEPS, remove=True,
                           stage_load=stage_load)
    for latents, _, _, state, _ in results:
        assert rel_err(latents, reference(flux_tiny)) <= 1e-5
        assert state.keys() == original.keys()
        assert all(torch.equal(state[k], original[k]) for k in original)


def test_a_stage_loaded_transformer_on_another_stage_is_refused(pools, flux_tiny):
    with pytest.raises(RankError, match="loaded with the blocks of stage 0 of pp=2, but this rank is stage 1"):
        pools(2).run(stage_loaded_elsewhere, flux_tiny)


# -- compositions ---------------------------------------------------------------------------------------------
TRUE_CFG = {"negative_prompt": "", "true_cfg_scale": 2.0}


@pytest.mark.parametrize("config, prompt, call", [
    ({"cfg": 2, "pp": 2}, "a red circle", TRUE_CFG),
    ({"dp": 2, "pp": 2}, ["a red circle", "a blue square"], {}),
], ids=["cfg2xpp2", "dp2xpp2"])
def test_pp_composes_with_cfg_and_dp(pools, flux_tiny, config, prompt, call):
    ref = reference(flux_tiny, prompt=prompt, call=call)
    stale_ref = pools(2).run(pipeline_run, flux_tiny, {"pp": 2}, steps=STEPS, pp_warmup=1, prompt=prompt, call=call)[0][0]
    exact = pools(4).run(pipeline_run, flux_tiny, config, steps=STEPS, per_step=True, pp_warmup=STEPS, prompt=prompt,
                         call=call)
    stale = pools(4).run(pipeline_run, flux_tiny, config, steps=STEPS, pp_warmup=1, prompt=prompt, call=call)
    for rank in range(4):
        latents, _, per_step, _, _ = exact[rank]
        assert rel_err(latents, ref) <= 1e-5
        pp_rank = rank % 2  # the mesh is (dp or cfg, pp): pp is the inner axis here
        kind = "pp_send" if pp_rank == 0 else "pp_recv"
        # each rank computes one call a step (its CFG branch or its prompt) and joins one all-gather of the outputs
        assert per_step == [{kind: 1, "broadcast": 1, "all_gather": 1}] * STEPS
        # the same stale schedule as pp alone: each branch / prompt keeps its own K/V buffers
        assert rel_err(stale[rank][0], stale_ref) <= 1e-5


#: flux-tiny's stages at pp 2: block 0 (1 attention layer) | blocks 1-3 (3 attention layers)
FLUX_STAGE_ATTENTIONS = (1, 3)


#: flux-tiny's all-reduces per call under tp 2 in each stage at pp 2: double block 0's attention outputs and
#: feed-forwards (image and text: 4) | double block 1's 4 and the two single blocks' packed output projection (1 each)
FLUX_STAGE_TP_ALL_REDUCES = (4, 6)


def axis_per_call(axis: str, stage: int) -> dict:
    """Collectives of one patch's pass through flux-tiny's ``stage`` (of pp 2) under ``axis`` 2: Ulysses' two
    all-to-alls per attention layer and its gather at the exit; the ring group's one all-gather of K and V per layer
    and the exit's; tp's all-reduces (each tp rank keeps its heads' K/V buffers, the activations between stages are
    whole after the all-reduces)."""
    attentions = FLUX_STAGE_ATTENTIONS[stage]
    if axis == "ulysses":
        return {"all_to_all": 2 * attentions, "all_gather": 1}
    if axis == "ring":
        return {"all_gather": attentions + 1}
    return {"all_reduce": FLUX_STAGE_TP_ALL_REDUCES[stage]}


@pytest.mark.parametrize("axis", ["ulysses", "ring", "tp"])
@pytest.mark.parametrize("family", ["flux", "sd3", "wan"])
def test_pp2_x_axis2_with_every_step_exact_matches_single_process(pools, model_checkpoints, flux_tiny, family, axis):
    path, call = family_case(family, model_checkpoints, flux_tiny)
    ref = reference(path, **call)
    results = pools(4).run(pipeline_run, path, {"pp": 2, axis: 2}, steps=STEPS, per_step=True, pp_warmup=STEPS,
                           pp_patches=3, **call)
    for rank, (latents, _, per_step, _, _) in enumerate(results):
        assert rel_err(latents, ref) <= 1e-5
        if family == "flux":
            stage = rank // 2  # the mesh is (pp, axis)
            # per call: the axis' collectives in the stage, one message between the stages, one broadcast
            assert per_step == [{"pp_send" if stage == 0 else "pp_recv": 1, "broadcast": 1,
                                 **axis_per_call(axis, stage)}] * STEPS


@pytest.mark.parametrize("axis", ["ulysses", "ring", "tp"])
def test_pp2_x_axis2_stale_schedule_matches_its_single_process_emulation(pools, flux_tiny, axis):
    emulated = flux_stale_emulation(flux_tiny, 3, warmup=1, steps=STEPS)
    results = pools(4).run(pipeline_run, flux_tiny, {"pp": 2, axis: 2}, steps=STEPS, per_step=True, pp_warmup=1,
                           pp_patches=3)
    for rank, (latents, _, per_step, _, _) in enumerate(results):
        assert rel_err(latents, emulated) <= 1e-5  # the patches' uneven halves (6, 5, 5 tokens over 2 ranks) too
        stage = rank // 2
        per_patch = {"pp_send" if stage == 0 else "pp_recv": 1, **axis_per_call(axis, stage)}
        assert per_step == [dict(per_patch, broadcast=1)] + [
            {k: 3 * v for k, v in per_patch.items()} | {"broadcast": 1}] * (STEPS - 1)


# -- quality on the tiny trained pipeline (eval-tiny --pp-sweep) -------------------------------------------------
def test_pp_sweep_scores_pp_and_displaced_settings_against_the_exact_images():
    # one sweep for PipeFusion's and displaced attention's settings: one reference, one pool of 2 ranks for both
    from ditmesh.tiny.evaluate import eval_captions, parse_pp_setting, pp_sweep

    settings = [parse_pp_setting(text) for text in ("pp=2,patches=2,warmup=3", "pp=2,patches=4", "displaced=2,warmup=3",
                                                    "displaced=2")]
    assert settings[1] == {"pp": 2, "patches": 4, "warmup": 1} and settings[3] == {"displaced": 2, "warmup": 1}
    rows = pp_sweep(None, settings, eval_captions()[:1], steps=3, images_per_caption=2)
    assert [(r.get("pp"), r.get("patches"), r.get("displaced"), r["warmup"]) for r in rows] == [
        (1, 1, None, 3), (2, 2, None, 3), (2, 4, None, 1), (None, None, 2, 3), (None, None, 2, 1)]
    for exact, stale in ((rows[1], rows[2]), (rows[3], rows[4])):
        assert exact["psnr"] == math.inf and exact["lost"] == 0  # exact: the same images
        assert math.isfinite(stale["psnr"]) and stale["ssim"] < 1  # stale: close, not equal


@pytest.mark.parametrize("text", ["pp=2,patches=x", "patches=2", "pp=2,steps=3"])
def test_bad_pp_sweep_settings_are_refused_in_one_line(text):
    from ditmesh.tiny.evaluate import parse_pp_setting

    with pytest.raises(ConfigError, match="--pp-sweep setting"):
        parse_pp_setting(text)


def test_pp2_x_usp_with_every_step_exact_matches_single_process(pools, flux_tiny):
    # pp 2 x ring 2 x ulysses 2: the Ulysses all-to-all inside each ring rank, then the ring group's all-gather
    ref = reference(flux_tiny)
    results = pools(8).run(pipeline_run, flux_tiny, {"pp": 2, "ring": 2, "ulysses": 2}, steps=STEPS, per_step=True,
                           pp_warmup=STEPS, pp_patches=3)
    for rank, (latents, _, per_step, _, _) in enumerate(results):
        assert rel_err(latents, ref) <= 1e-5
        stage, attentions = rank // 4, FLUX_STAGE_ATTENTIONS[rank // 4]  # the mesh is (pp, ring, ulysses)
        assert per_step == [{"pp_send" if stage == 0 else "pp_recv": 1, "broadcast": 1, "all_to_all": 2 * attentions,
                             "all_gather": attentions + 1}] * STEPS


def test_pp2_with_compiled_blocks_matches_eager_and_traces_no_layer_or_patch(pools, flux_tiny):
    # each block's own forward is compiled inside its stage hook; the stage skip, sends and receives stay eager.
    # 3 patches (6, 5, 5 image tokens): patches 1 and 2 share an input layout, so a patch index reaching the
    # compiled blocks would show as a recompile; 2 patches (each of its own layout) would take the same path
    from cases_displaced import compiled_run_graphs

    patches = 3
    eager = pool_run(pools, flux_tiny, {"pp": 2}, steps=STEPS, per_step=True, pp_warmup=1, pp_patches=patches)
    compiled = pools(2).run(compiled_run_graphs, flux_tiny, {"pp": 2}, steps=STEPS, pp_warmup=1, pp_patches=patches)
    for rank, (latents, per_step, entries, failures, breaks) in enumerate(compiled):
        assert rel_err(latents, eager[rank][0]) <= 1e-5
        kind = "pp_send" if rank == 0 else "pp_recv"
        assert per_step == [{kind: 1, "broadcast": 1}] + [{kind: patches, "broadcast": 1}] * (STEPS - 1)
        # the buffer's part of the attention is one operator and the layer a tensor: the blocks recompile for their
        # inputs' shapes and strides (exact call, patch 0 with the text, the other patches), never for a layer or a
        # patch index, which would take a block class past dynamo's limit of 8 entries in a stage of FLUX.1-dev
        reasons = [r for rs in failures.values() for r in rs]
        assert breaks == 0 and not [r for r in reasons if "processor" in r or "ctx" in r], reasons
        assert all(n <= 6 for n in entries.values()), entries


def test_compiled_wan22_experts_share_their_block_graphs_under_pp(pools, model_checkpoints):
    # Wan 2.2's two transformers (high- and low-noise experts, the second from step 3 of 6 here) run the same block
    # class: a runtime or layer that reached the compiled blocks as a Python value would trace them once per expert
    from cases_displaced import compiled_run_graphs

    path, call = family_case("wan", model_checkpoints, "")
    eager = pools(2).run(pipeline_run, path, {"pp": 2}, steps=6, pp_warmup=1, keep=None, **call)
    compiled = pools(2).run(compiled_run_graphs, path, {"pp": 2}, steps=6, pp_warmup=1, **call)
    for (latents, _, entries, failures, breaks), (ref, *_) in zip(compiled, eager):
        assert rel_err(latents, ref) <= 1e-5
        reasons = [r for rs in failures.values() for r in rs]
        assert breaks == 0 and not [r for r in reasons if "processor" in r or "ctx" in r], reasons
        assert entries == {"WanTransformerBlock": 2}, (entries, reasons)


# -- step caching under PipeFusion (static and taylor: decided by the step on every stage) -----------------------
CACHES = ["static:skip=2,first=1", "taylor:interval=2,warmup=2"]
CACHE_STEPS = 5


@pytest.mark.parametrize("config", [{"pp": 2}, {"pp": 2, "ulysses": 2}], ids=["pp2", "pp2xulysses2"])
@pytest.mark.parametrize("setting", CACHES)
def test_cached_pp_with_every_step_exact_matches_the_cached_single_process_run(pools, flux_tiny, setting, config):
    # each stage keeps the residual of its part of the middle blocks; a skip adds it there, so the stages' parts add
    # up to the middle's residual of the single process (flux-tiny at pp 2: block 0 | blocks 1-3, middle 1-3)
    ref = pipeline_run(flux_tiny, {"ulysses": 1}, steps=CACHE_STEPS, cache=setting)[0]
    uncached = reference_steps(flux_tiny, CACHE_STEPS)
    assert rel_err(ref, uncached) > 1e-4  # the cache skipped something
    world = 2 * config.get("ulysses", 1)
    results = pools(world).run(pipeline_run, flux_tiny, config, steps=CACHE_STEPS, per_step=True,
                               pp_warmup=CACHE_STEPS, cache=setting)
    for rank, (latents, _, per_step, _, _) in enumerate(results):
        assert rel_err(latents, ref) <= 1e-5
        kind = "pp_send" if rank < world // 2 else "pp_recv"
        assert all(step[kind] == 1 for step in per_step)  # a skipped step still passes its activations on


@pytest.mark.parametrize("patches", [2, 3])
def test_cached_pp_stale_schedule_matches_its_single_process_emulation(pools, flux_tiny, patches):
    # static:skip=2 at pp 2 (block 0 | blocks 1-3): the stale step 2 runs block 0 per patch and replays each patch's
    # tokens of blocks 1-3's residual kept at step 1 (itself computed patch by patch)
    setting = "static:skip=2,first=1"
    emulated = flux_stale_emulation(flux_tiny, patches, warmup=1, steps=CACHE_STEPS, skipped=(2,))
    uncached = flux_stale_emulation(flux_tiny, patches, warmup=1, steps=CACHE_STEPS)
    assert rel_err(emulated, uncached) > 1e-4  # the emulated skip changes the result
    results = pools(2).run(pipeline_run, flux_tiny, {"pp": 2}, steps=CACHE_STEPS, per_step=True, pp_warmup=1,
                           pp_patches=patches, cache=setting)
    for rank, (latents, _, per_step, _, _) in enumerate(results):
        assert rel_err(latents, emulated) <= 1e-5
        kind = "pp_send" if rank == 0 else "pp_recv"
        assert [step[kind] for step in per_step] == [1] + [patches] * (CACHE_STEPS - 1)  # a skipped step passes on


def test_cached_pp_beside_sequence_parallelism_refuses_a_stale_step(flux_tiny):
    # only stage 1 (the middle blocks' residual) raises; stage 0 waits for it until the pool stops it: a pool of
    # its own, with a short grace for the other ranks' errors, rather than the session's (which would wait 10 s for
    # them and then be closed, so that the next case of 4 ranks starts a new one)
    import os

    from ditmesh.testing import ProcessPool

    pool = ProcessPool(4, float(os.environ.get("DITMESH_TEST_TIMEOUT_S", "300")), error_grace_s=2)
    try:
        with pytest.raises(RankError, match="runs only while every step is exact"):
            pool.run(pipeline_run, flux_tiny, {"pp": 2, "ulysses": 2}, steps=CACHE_STEPS, pp_warmup=1,
                     cache="static:skip=2,first=1")
    finally:
        if not pool.closed:
            pool.close()


# -- the planner ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("config", [{"pp": 2}, {"pp": 2, "ulysses": 2}, {"pp": 2, "ring": 2}])
def test_plan_predicts_the_kv_buffer_bytes_each_stage_holds(pools, flux_tiny, config):
    from cases_displaced import buffer_bytes_after_first_step
    from ditmesh.planner import model_stats, resolve_model
    from ditmesh.planner.cost import pipefusion_kv_bytes, pipefusion_stages

    stats = model_stats(resolve_model(flux_tiny), 64, 64)
    parallel = ParallelConfig(**config)
    stages = pipefusion_stages(stats, 2)
    # float32 here; per stage: its layers' K and V over the whole sequence, with 1/ulysses of the heads
    predicted = [pipefusion_kv_bytes(stats, parallel, 1, stage) / stats.bytes_per_element * 4 for stage in stages]
    assert predicted[0] != predicted[1]  # the stages hold different layers: the test tells them apart
    held = pools(parallel.world_size).run(buffer_bytes_after_first_step, flux_tiny, config, displaced=False,
                                          max_sequence_length=stats.layout.text_tokens)
    per_stage = parallel.world_size // 2  # pp is the outer axis: ranks [0, n/2) are stage 0
    for rank, steps in enumerate(held):
        # filled by the exact first step, kept (and rewritten in place) by the stale ones
        assert steps == [predicted[rank // per_stage]] * STEPS
