"""Displaced attention (``displaced=True`` over the ulysses axis): exact where it should be (warm-up over every step
equals one process), the stale schedule equal to its single-process emulation, the gathers of every step counted
(synchronous in exact steps, started a step ahead in stale ones, none in the last step), and the settings checked."""

from __future__ import annotations

import pytest

from cases_pipefusion import flux_stale_emulation, pipeline_run
from test_pipefusion import STEPS, TRUE_CFG, family_case, pool_run, reference
from ditmesh.config import ConfigError, ParallelConfig
from ditmesh.options import RunOptions
from ditmesh.testing import rel_err

#: self-attention layers of each tiny family's transformer (FLUX: 2 double + 2 single blocks; SD3: 3 joint blocks and
#: block 0's image-only attn2; Wan: 2 blocks' attn1, cross-attention runs locally)
LAYERS = {"flux": 4, "sd3": 4, "wan": 2}


def per_step_counts(family: str, exact_steps: int, calls: int = 1, steps: int = STEPS) -> list[dict]:
    """Collectives of each step: per call and attention layer one all-gather, synchronous in an exact step and
    started (``kv_async``) in a stale one but the last; and the exit's gather."""
    layers = LAYERS[family] * calls
    out = []
    for step in range(steps):
        if step < exact_steps:
            out.append({"all_gather": layers + calls})
        elif step < steps - 1:
            out.append({"all_gather": calls, "kv_async": layers})
        else:
            out.append({"all_gather": calls})
    return out


# -- settings ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("config, warmup, message", [
    ({"ulysses": 2}, 0, "displaced_warmup=0 must be >= 1"),
    ({"ulysses": 2}, 1.5, "displaced_warmup=1.5 is not an integer"),
    ({"pp": 2, "ulysses": 2}, 1, r"displaced attention and PipeFusion \(pp=2\) are two stale-K/V schemes; use one"),
    ({"ring": 2, "ulysses": 2}, 1, "ring=2 is set: use ring=1 and ulysses=4"),
    ({"ring": 2}, 1, "ring=2 is set: use ring=1 and ulysses=2"),
    ({"cfg": 2}, 1, "displaced attention needs ulysses > 1"),
])
def test_bad_displaced_settings_are_refused_in_one_line(config, warmup, message):
    with pytest.raises(ConfigError, match=message) as err:
        RunOptions.create(ParallelConfig(**config), displaced=True, displaced_warmup=warmup)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("option, message", [({"cache": "fbcache:0.1"}, "step caching does not run with displaced"),
                                             ({"fuse_qkv": True}, "fuse_qkv does not run with displaced")])
def test_parallelize_refuses_what_displaced_does_not_run_with(flux_tiny, option, message):
    from diffusers import DiffusionPipeline

    from ditmesh import parallelize

    pipe = DiffusionPipeline.from_pretrained(flux_tiny)
    with pytest.raises(ConfigError, match=message):
        parallelize(pipe, ParallelConfig(), displaced=True, **option)


def test_cuda_graphs_run_with_displaced_but_not_with_pipefusion():
    RunOptions.create(ParallelConfig(ulysses=2), cuda_graph=True, displaced=True)
    with pytest.raises(ConfigError, match=r"CUDA graphs does not run with PipeFusion \(pp=2\) yet; drop it or use "
                                          "pp=1"):
        RunOptions.create(ParallelConfig(pp=2), cuda_graph=True)


def test_a_family_with_a_token_grid_is_refused():
    from ditmesh import parallelize
    from ditmesh.synth import build_transformer

    class Pipe:
        transformer = build_transformer("sana-tiny", seed=0)

    with pytest.raises(NotImplementedError, match="displaced attention does not run sana"):
        parallelize(Pipe, ParallelConfig(ulysses=2), displaced=True)  # refused before any process group is needed


# -- exact: warm-up over every step ----------------------------------------------------------------------------
@pytest.mark.parametrize("family", ["flux", "sd3", "wan"])
def test_warmup_over_every_step_matches_single_process(pools, model_checkpoints, flux_tiny, family):
    path, call = family_case(family, model_checkpoints, flux_tiny)
    ref = reference(path, **call)
    results = pools(2).run(pipeline_run, path, {"ulysses": 2}, steps=STEPS, per_step=True, displaced=True,
                           displaced_warmup=STEPS, **call)
    calls = 2 if family == "wan" else 1  # Wan's CFG calls the transformer twice a step; SD3 batches it
    for latents, _, per_step, _, _ in results:
        assert rel_err(latents, ref) <= 1e-5
        assert per_step == per_step_counts(family, STEPS, calls)


# -- stale: the displaced schedule ----------------------------------------------------------------------------
@pytest.mark.parametrize("ranks", [2, 3])
def test_stale_schedule_matches_its_single_process_emulation(pools, flux_tiny, ranks):
    emulated = flux_stale_emulation(flux_tiny, ranks, warmup=1, steps=STEPS, displaced=True)
    assert rel_err(emulated, reference(flux_tiny)) > 1e-3  # the stale steps do differ from the exact run
    results = pool_run(pools, flux_tiny, {"ulysses": ranks}, steps=STEPS, per_step=True, displaced=True)
    for latents, _, per_step, _, _ in results:
        assert rel_err(latents, emulated) <= 1e-5  # at 3 ranks: 16 text and 16 image tokens as 6, 5, 5
        assert per_step == per_step_counts("flux", 1)


@pytest.mark.parametrize("family", ["sd3", "wan"])
def test_stale_schedule_runs_on_sd3_and_wan(pools, model_checkpoints, flux_tiny, family):
    path, call = family_case(family, model_checkpoints, flux_tiny)
    ref = reference(path, **call)
    results = pools(2).run(pipeline_run, path, {"ulysses": 2}, steps=STEPS, per_step=True, displaced=True, **call)
    assert rel_err(results[0][0], results[1][0]) == 0  # every rank steps on the same gathered prediction
    experts = results[0][4]
    for latents, _, per_step, _, _ in results:
        assert 1e-6 < rel_err(latents, ref) < 0.2
        if family == "sd3":
            assert per_step == per_step_counts(family, 1)
        else:
            # a step is exact in warm-up and where its transformer runs for the first time in the run (Wan 2.2's
            # low-noise expert takes over part-way); a transformer's last step starts no gather only at the run's end
            for step, counts in enumerate(per_step):
                fresh = step < 1 or experts[step] != experts[step - 1]
                assert counts.get("kv_async", 0) == (0 if fresh or step == STEPS - 1 else 2 * LAYERS[family]), per_step


# -- compositions ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("config, prompt, call", [
    ({"cfg": 2, "ulysses": 2}, "a red circle", TRUE_CFG),
    ({"dp": 2, "ulysses": 2}, ["a red circle", "a blue square"], {}),
    ({"ulysses": 2, "tp": 2}, "a red circle", {}),
], ids=["cfg2xulysses2", "dp2xulysses2", "ulysses2xtp2"])
def test_displaced_composes_with_cfg_dp_and_tp(pools, flux_tiny, config, prompt, call):
    ref = reference(flux_tiny, prompt=prompt, call=call)
    stale_ref = pools(2).run(pipeline_run, flux_tiny, {"ulysses": 2}, steps=STEPS, displaced=True, prompt=prompt,
                             call=call)[0][0]
    exact = pools(4).run(pipeline_run, flux_tiny, config, steps=STEPS, displaced=True, displaced_warmup=STEPS,
                         prompt=prompt, call=call)
    stale = pools(4).run(pipeline_run, flux_tiny, config, steps=STEPS, displaced=True, prompt=prompt, call=call)
    for rank in range(4):
        assert rel_err(exact[rank][0], ref) <= 1e-5
        # the same stale schedule as ulysses alone: each branch / prompt keeps its own K/V buffers
        assert rel_err(stale[rank][0], stale_ref) <= 1e-5


# -- compile ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("ranks", [2, 3])
def test_compiled_blocks_trace_once_for_every_layer_and_give_the_eager_run(pools, flux_tiny, ranks):
    from cases_displaced import compiled_run_graphs

    # 2 ranks: even chunks, the gather is the attention's K/V; 3: uneven (6, 5, 5 tokens), trimmed into a copy
    # the run of test_stale_schedule_matches_its_single_process_emulation[ranks]
    eager = pool_run(pools, flux_tiny, {"ulysses": ranks}, steps=STEPS, per_step=True, displaced=True)
    compiled = pools(ranks).run(compiled_run_graphs, flux_tiny, {"ulysses": ranks}, steps=STEPS, displaced=True)
    for (latents, per_step, entries, failures, breaks), (ref, _, _, _, _) in zip(compiled, eager):
        assert rel_err(latents, ref) <= 1e-5
        assert per_step == per_step_counts("flux", 1)  # the exchange runs eagerly inside its operator: counted
        # the exchange is one opaque operator and the layer is counted at run time: no graph break, no guard on a
        # layer. Each block type's forward is compiled once for all of its layers: the first single block receives
        # its inputs as slices of one tensor, as the later ones do (``BlockList.packed``), so no stride recompiles it
        assert breaks == 0, failures
        assert entries == {"FluxTransformerBlock": 1, "FluxSingleTransformerBlock": 1}
        assert not failures, failures


# -- CUDA graphs (emulated on CPU) --------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def fresh_pools():
    """Pools of workers that ran nothing before: in full-suite runs (CI once, one local run of two) a worker of the
    session's pools, after many other cases had run in it, ended with SIGSEGV in this test's true-CFG case; never
    when run alone or with its file (cause not found; the pool's report now keeps the crashed rank's stacks).
    ``fresh_pools(n)``; closed at the module's end."""
    from conftest import new_pool

    made: dict = {}

    def get(n: int):
        if n not in made or made[n].closed:
            made[n] = new_pool(n)
        return made[n]

    yield get
    for pool in made.values():
        pool.close()


@pytest.mark.parametrize("ranks, call", [(2, {}), (3, {}), (2, TRUE_CFG)], ids=["2", "3", "2-true-cfg"])
def test_graphed_steps_are_captured_once_per_plan_replayed_and_give_the_ungraphed_run(fresh_pools, flux_tiny, ranks,
                                                                                      call):
    from cases_displaced import graphed_runs
    from test_pipefusion import reference_steps

    pools = fresh_pools

    # 6 steps a run: 0 exact, 1-4 stale of parity 1, 0, 1, 0, 5 stale without a gather; 3 runs, all alike
    steps, runs = 6, 3
    # 2 ranks: even chunks, the buffer is the attention's K/V; 3: uneven (6, 5, 5 tokens), trimmed into a copy; true
    # CFG: two calls a step, each with its own buffers and graphs
    ungraphed = pools(ranks).run(graphed_runs, flux_tiny, {"ulysses": ranks}, steps, 1, graphed=False, call=call)
    if not call:
        assert rel_err(ungraphed[0][0][0], reference_steps(flux_tiny, steps)) > 1e-3  # stale steps differ from exact
    calls = 2 if call else 1
    counts = per_step_counts("flux", 1, calls, steps)
    for (latents, per_step, entries), (ref, ref_steps, _) in zip(
            pools(ranks).run(graphed_runs, flux_tiny, {"ulysses": ranks}, steps, runs, call=call), ungraphed):
        assert ref_steps == counts
        for run in latents:
            assert rel_err(run, ref[0]) <= 1e-5
        assert per_step == counts * runs  # a replay issues the collectives of its captured call
        # a graph per planned call (call in step, exact, step parity, last step), captured at its second call (the
        # first runs without a graph) and replayed from then on: the stale steps from run 2's, exact and last in run 3
        assert entries == {key: value for c in range(calls) for key, value in (
            ((c, True, 0, False), (True, 1)), ((c, False, 1, False), (True, 4)), ((c, False, 0, False), (True, 4)),
            ((c, False, 1, True), (True, 1)))}


# -- quality on the tiny trained pipeline (eval-tiny --pp-sweep) -------------------------------------------------
# the sweep's displaced rows are scored with PipeFusion's, in one sweep:
# test_pipefusion.py::test_pp_sweep_scores_pp_and_displaced_settings_against_the_exact_images
@pytest.mark.parametrize("text", ["displaced=2,patches=2", "displaced=x"])
def test_bad_displaced_sweep_settings_are_refused_in_one_line(text):
    from ditmesh.tiny.evaluate import parse_pp_setting

    with pytest.raises(ConfigError, match="--pp-sweep setting"):
        parse_pp_setting(text)


# -- command line ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("argv, needle", [
    (["--nproc", "4", "--ulysses", "2", "--ring", "2", "--displaced"], "ring=2 is set: use ring=1 and ulysses=4"),
    (["--nproc", "4", "--ulysses", "2", "--pp", "2", "--displaced"], "displaced attention and PipeFusion (pp=2)"),
    (["--nproc", "2", "--ulysses", "2", "--displaced", "--cache", "fbcache:0.1"],
     "step caching does not run with displaced attention yet; drop it or drop displaced"),
    (["--nproc", "2", "--ulysses", "2", "--displaced", "--displaced-warmup", "0"], "--displaced-warmup 0 must be >= 1"),
    (["--nproc", "2", "--ulysses", "2", "--displaced-warmup", "2"], "--displaced-warmup 2 is given without --displaced"),
    (["--nproc", "2", "--cfg", "2", "--displaced"], "displaced attention needs ulysses > 1"),
])
def test_bad_displaced_command_lines_fail_in_one_line_with_exit_2(argv, needle, capsys, tmp_path, monkeypatch):
    from ditmesh.cli import main

    monkeypatch.chdir(tmp_path)
    assert main(["generate", "--model", "flux-tiny", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert needle in err and len(err.splitlines()) == 1
    assert list(tmp_path.iterdir()) == []


# -- the planner ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("ranks", [2, 3])
def test_plan_predicts_the_kv_buffer_bytes_a_run_holds(pools, flux_tiny, ranks):
    from cases_displaced import buffer_bytes_after_first_step
    from ditmesh.planner import model_stats, resolve_model
    from ditmesh.planner.cost import displaced_kv_bytes

    stats = model_stats(resolve_model(flux_tiny), 64, 64)
    text = stats.layout.text_tokens  # the planner's text length (32), run below; 16 image tokens
    predicted = displaced_kv_bytes(stats, ParallelConfig(ulysses=ranks), samples=1) / stats.bytes_per_element * 4
    for held in pools(ranks).run(buffer_bytes_after_first_step, flux_tiny, {"ulysses": ranks},
                                 max_sequence_length=text):
        # float32 here; after every step but the last, one pending gather per layer; none once the run is done
        assert held == [predicted] * (STEPS - 1) + [0]


def test_plan_ranks_displaced_only_when_asked_with_two_buffer_sets_under_cuda_graphs():
    from ditmesh.planner import plan, recommend_prediction

    exact = plan("flux-dev", 1024, 1024, 4).predictions
    assert not any(p.displaced for p in exact)
    stale = plan("flux-dev", 1024, 1024, 4, displaced=True).predictions
    shown = {p.describe(): p for p in stale}
    displaced, ulysses = shown["ulysses4 displaced"], shown["ulysses4"]
    assert displaced.comm_bytes["by_collective"]["kv_async"] > 0 and "all_to_all" not in displaced.comm_bytes["by_collective"]
    assert displaced.comm_ms < ulysses.comm_ms and displaced.memory["kv_cache"] > 0 == ulysses.memory["kv_cache"]
    graphed = {p.describe(): p for p in plan("flux-dev", 1024, 1024, 4, displaced=True, cuda_graph=True).predictions}
    # one buffer set per step parity at fixed addresses: twice the K/V an ungraphed run keeps between steps
    assert graphed["ulysses4 displaced"].memory["kv_cache"] == 2 * displaced.memory["kv_cache"]
    assert recommend_prediction("flux-dev", 1024, 1024, 4, displaced=True).displaced  # hidden gathers win here


def test_plan_command_lists_displaced_rows(capsys):
    from ditmesh.cli import main

    assert main(["plan", "--model", "flux-dev", "--gpus", "4", "--displaced", "--top", "0"]) == 0
    out = capsys.readouterr().out
    assert "ulysses4 displaced" in out and "--ulysses 4 --displaced" in out


def test_generate_displaced_with_every_step_exact_matches_single_process(tmp_path, flux_tiny):
    from test_generate_cli import generate

    _, single, _ = generate(tmp_path, "single", "--model", flux_tiny, "--nproc", "1")
    report, latents, _ = generate(tmp_path, "displaced", "--model", flux_tiny, "--nproc", "2", "--ulysses", "2",
                                  "--displaced", "--displaced-warmup", "3")
    assert rel_err(latents, single) <= 1e-5
    assert report["config"]["ulysses"] == 2 and report["displaced"] == {"warmup": 3}
    _, stale, _ = generate(tmp_path, "stale", "--model", flux_tiny, "--nproc", "2", "--ulysses", "2", "--displaced")
    assert 1e-6 < rel_err(stale, single) < 0.2


def test_plan_auto_runs_the_displaced_choice(monkeypatch):
    import ditmesh.planner
    import ditmesh.runtime.launch
    from ditmesh.cli import main
    from ditmesh.planner import Prediction

    chosen = Prediction(ParallelConfig(ulysses=2), 1.0, 1.0, 0.0, 0.0, {}, {}, "yes", displaced=True)
    monkeypatch.setattr(ditmesh.planner, "recommend_prediction", lambda *a, **k: chosen)
    launched = []
    monkeypatch.setattr(ditmesh.runtime.launch, "launch", lambda nproc, argv, **kw: launched.append(argv) or 0)
    assert main(["generate", "--model", "flux-tiny", "--nproc", "2", "--plan", "auto", "--allow-stale"]) == 0
    # the ranks are started with the planner's degrees and its displaced choice
    assert "--ulysses=2" in launched[0] and "--displaced" in launched[0] and "--plan" not in launched[0]
