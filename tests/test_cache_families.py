"""The step caches on every family that offers them (but the twelve whose pipelines run them in their own test files,
:data:`THROUGH_PIPELINES`), on its synthetic transformer's own block structure: four calls
of a run (inputs A, A, B, B), each cache on one process and under a sequence-parallel axis (ulysses 2, or ring 2 where
the tiny heads do not divide), which takes the one process's decisions and gives its outputs (rel. err <= 1e-5).

What it shows of each family's block lists (``ModelAdapter.blocks``): a skipped call whose inputs equal the previous
call's gives that call's output, so the lists carry every stream the skipped blocks change and replay it where it
belongs; the skipped blocks' own forwards do not run; a skip on changed inputs changes the output (the cache
approximates; it is not silently exact); teacache reads the family's modulated input where it names one."""

from __future__ import annotations

import pytest

from cases_cache import FAMILY_CALLS, family_cached_runs, family_inputs
from ditmesh.testing import rel_err

#: dbcache decides on the first block's residual: 0 between equal calls (skip), large between A and B (compute)
DBCACHE = "dbcache:threshold=0.01"
#: static skips the middle blocks at the changed call B (step 2)
STATIC = "static:skip=2"
#: teacache skips every block between equal calls; the run's last step always runs
TEACACHE = "teacache:threshold=0.01"
SKIPS = {DBCACHE: [False, True, False, True], STATIC: [False, False, True, False],
         TEACACHE: [False, True, False, False]}
#: families whose own test files run the caches through their pipelines under ulysses (and cfg), against one process
THROUGH_PIPELINES = {"flux": "test_cache", "flux2": "test_flux2", "chroma": "test_chroma", "qwenimage": "test_qwenimage",
                     "hidream": "test_hidream", "sd3": "test_cache", "pixart": "test_pixart", "wan": "test_cache",
                     "hunyuan-video": "test_hunyuan_video", "cogvideox": "test_cogvideox", "ltx-video": "test_ltx",
                     "allegro": "test_allegro"}
#: block counts in place of the tiny architectures': a list of one block gets two (a cache computes the first block and
#: skips the rest), and where a family has two lists the first gets two, so that the skipped middle starts in it and
#: carries its streams into the second (joined into one sequence where the list ``joins`` them)
LAYERS = {"dit-tiny": {"num_layers": 2}, "ernie-image-tiny": {"num_layers": 2},
          "auraflow-tiny": {"num_mmdit_layers": 2}, "bria-fibo-tiny": {"num_layers": 2}, "bria-tiny": {"num_layers": 2},
          "hunyuan-video-framepack-tiny": {"num_layers": 2}, "longcat-image-tiny": {"num_layers": 2},
          "ovis-image-tiny": {"num_layers": 2},
          # Sana-WM: both blocks gated delta nets, so that each all-reduces alike (its QK-norms' sums of squares; the
          # softmax block would not, and the count below is per block); its own test file runs the softmax block
          "sana-wm-tiny": {"softmax_every_n": 0}}


def _offering_caches() -> list[str]:
    """The first tiny synthetic architecture of every family whose table row offers the step caches, but those
    :data:`THROUGH_PIPELINES`."""
    from ditmesh.models import adapters
    from ditmesh.runtime.generality import axes

    archs = {}
    for adapter in adapters():
        tiny = [arch.name for arch in adapter.synth_archs if arch.name.endswith("-tiny")]
        if axes(adapter)["step cache"] and tiny and adapter.name not in THROUGH_PIPELINES:
            archs.setdefault(adapter.name, tiny[0])
    return sorted(archs.values())


ARCHS = _offering_caches()


def _settings(arch: str) -> list[str]:
    from ditmesh.models import adapter_for_class
    from ditmesh.synth import get_arch

    teacache = adapter_for_class(get_arch(arch).transformer_class).modulated_input is not None
    return [DBCACHE, STATIC] + ([TEACACHE] if teacache else [])


def test_every_family_offering_a_step_cache_is_walked_here():
    from ditmesh.models import adapters
    from ditmesh.runtime.generality import axes

    offering = {a.name for a in adapters() if axes(a)["step cache"]}
    assert set(THROUGH_PIPELINES) <= offering
    assert len(ARCHS) + len(THROUGH_PIPELINES) == len(offering) >= 50, (sorted(offering), ARCHS)


@pytest.mark.parametrize("arch", ARCHS)
def test_step_caches_replay_skip_and_decide_as_one_process(pools, arch):
    from cases_cache import family_model
    from ditmesh.models import adapter_for

    layers = LAYERS.get(arch)
    model = family_model(arch, layers)
    first_list = model.get_submodule(adapter_for(model).blocks[0].path)
    assert len(first_list) >= 2 or len(adapter_for(model).blocks) == 1  # the skipped middle starts in the first list
    inputs, config = family_inputs(arch, layers)
    settings = _settings(arch)
    ref = family_cached_runs(arch, {}, settings, inputs, layers)
    computed = ref[DBCACHE][0][2]  # call B computed in full (dbcache's first change)
    for setting, (outs, skips, runs, _) in ref.items():
        assert skips == SKIPS[setting], setting
        first = 0 if setting == TEACACHE else 1  # blocks run at every call; the others only at the computed ones
        assert runs == [4] * first + [4 - sum(skips)] * (len(runs) - first), (setting, runs)
        for step, skipped in enumerate(skips):
            if skipped and FAMILY_CALLS[step] == FAMILY_CALLS[step - 1]:  # the replay of an equal call is exact
                assert rel_err(outs[step], outs[step - 1]) <= 1e-5, (setting, step)
        assert rel_err(outs[3 if setting == STATIC else 2], computed) <= 1e-5, setting
    assert rel_err(ref[STATIC][0][2], computed) > 1e-3  # the skip at call B replays A's residual: not exact
    for got in pools(2).run(family_cached_runs, arch, config, [None, *settings], inputs, layers):
        # the uncached calls' all-reduces are the blocks' own (Sana's linear attention sums its keys over the ranks)
        _, _, runs, counts = got.pop(None)
        per_block = counts.get("all_reduce", 0) / sum(runs)
        for setting, (outs, skips, runs, counts) in got.items():
            assert skips == SKIPS[setting], (setting, config)
            assert max(rel_err(o, r) for o, r in zip(outs, ref[setting][0])) <= 1e-5, (setting, config)
            # dbcache and teacache: one decision all-reduce a call after the first; static decides by the step alone
            decisions = 0 if setting == STATIC else len(inputs) - 1
            assert counts.get("all_reduce", 0) == decisions + per_block * sum(runs), (setting, counts)
