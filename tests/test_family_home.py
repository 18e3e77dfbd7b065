"""One home per family, hooks in an explicit order with a per-call context, and a remove() that gives back the
pipeline the user had. Parallel cases run on real gloo process groups against single-process runs."""

from __future__ import annotations

import pytest
import torch

from cases_hooks import (cache_with_an_empty_dp_chunk_case, failed_parallelize_case, remove_restores_case,
                         remove_sharded_load_case, renamed_attention_case, step_index_case, two_transformers_case)
from ditmesh.testing import rel_err


# -- the hook registry ------------------------------------------------------------------------------------------
class _Tagger(torch.nn.Module):
    def forward(self, x):
        return x


def _tag_hook(name: str, trail: list):
    from ditmesh.hooks import Hook

    class Tag(Hook):
        def __call__(self, owner, call_next, args, kwargs):
            trail.append(name)
            return call_next(args, kwargs)

    hook = Tag()
    hook.name = name
    return hook


def test_hooks_run_in_the_declared_order_whatever_order_they_were_added():
    from ditmesh.hooks import ORDER, add_hook

    module, trail = _Tagger(), []
    names = ["sequence", "context", "batch", "consistency"]
    removers = {name: add_hook(module, _tag_hook(name, trail)) for name in names}
    module(torch.ones(1))
    assert trail == [n for n in ORDER if n in names]  # context, consistency, batch, sequence
    trail.clear()
    removers["batch"]()  # a middle hook goes; the rest keep their places
    module(torch.ones(1))
    assert trail == ["context", "consistency", "sequence"]


def test_removing_the_last_hook_gives_back_the_plain_method():
    from ditmesh.hooks import add_hook, find_hook

    module, trail = _Tagger(), []
    remover = add_hook(module, _tag_hook("batch", trail))
    assert "forward" in vars(module) and find_hook(module, "batch") is not None
    remover()
    assert "forward" not in vars(module) and find_hook(module, "batch") is None
    with pytest.raises(ValueError, match="no place in the order"):
        add_hook(module, _tag_hook("mystery", trail))


def test_a_method_that_was_an_instance_attribute_is_put_back_and_a_foreign_wrapper_stays():
    from ditmesh.hooks import add_hook

    module, trail = _Tagger(), []
    own = lambda x: x + 1  # noqa: E731  (a forward set on the instance, as some wrappers do)
    module.forward = own
    remover = add_hook(module, _tag_hook("batch", trail))
    assert module(torch.ones(1)).item() == 2 and trail == ["batch"]
    remover()
    assert vars(module)["forward"] is own
    # someone wraps our wrapper after us: removing our last hook leaves their wrapper in place
    module = _Tagger()
    remover = add_hook(module, _tag_hook("batch", trail))
    ours = module.forward
    theirs = lambda x: ours(x) * 3  # noqa: E731
    module.forward = theirs
    remover()
    assert vars(module)["forward"] is theirs


def test_a_hook_replaces_the_sample_of_either_output_form_and_keeps_the_rest():
    from types import SimpleNamespace

    from ditmesh.hooks import output_sample, with_output_sample

    sample, other, new = torch.zeros(1), torch.ones(1), torch.full((1,), 2.0)
    out = with_output_sample((sample, other), new)
    assert isinstance(out, tuple) and len(out) == 2 and out[0] is new and out[1] is other
    assert with_output_sample((sample,), new) == (new,) and output_sample((new, other)) is new
    obj = SimpleNamespace(sample=sample)
    assert with_output_sample(obj, new) is obj and output_sample(obj) is new


def test_step_index_comes_from_the_scheduler_not_from_counting_calls(flux_tiny):
    # true CFG calls the transformer twice per step: both calls of a step share its index
    assert step_index_case(flux_tiny, {}) == [(0, 0), (0, 1), (1, 0), (1, 1), (2, 0), (2, 1)]


def test_step_index_under_cfg_parallelism(pools, flux_tiny):
    for seen in pools(2).run(step_index_case, flux_tiny, {"cfg": 2}):
        assert seen == [(0, 0), (0, 1), (1, 0), (1, 1), (2, 0), (2, 1)]


def test_every_pipeline_run_starts_its_steps_afresh(pools, flux_tiny):
    # a 1-step run ends at step 0, and the next run's step 0 is a new run (new timesteps), not a third call
    expected = [(0, 0), (0, 1), (0, 0), (0, 1), (0, 0), (0, 1), (1, 0), (1, 1)]
    assert step_index_case(flux_tiny, {}, runs=(1, 1, 2)) == expected
    for seen in pools(2).run(step_index_case, flux_tiny, {"cfg": 2}, runs=(1, 1, 2)):
        assert seen == expected


def test_a_failed_parallelize_leaves_the_pipeline_as_it_was(pools, flux_tiny):
    for message, diffs in pools(2).run(failed_parallelize_case, flux_tiny):
        assert "bogus" in message and diffs == []


def test_a_cache_with_an_empty_dp_chunk_is_refused_on_every_rank(pools, flux_tiny):
    for message in pools(2).run(cache_with_an_empty_dp_chunk_case, flux_tiny):
        assert message is not None and "cannot give each of the 2 dp/cfg batch ranks an image" in message


def test_offloaded_models_are_refused_and_foreign_wrappers_survive_remove(flux_tiny):
    from accelerate.hooks import ModelHook, add_hook_to_module
    from diffusers import FluxPipeline

    from ditmesh import ConfigError, ParallelConfig, parallelize, remove

    pipe = FluxPipeline.from_pretrained(flux_tiny, dtype=torch.float32)
    add_hook_to_module(pipe.transformer, ModelHook())
    with pytest.raises(ConfigError, match="accelerate offload hooks"):
        parallelize(pipe, ParallelConfig())
    pipe = FluxPipeline.from_pretrained(flux_tiny, dtype=torch.float32)
    parallelize(pipe, ParallelConfig())
    add_hook_to_module(pipe.transformer, ModelHook())  # wraps our wrapper after parallelize
    theirs = pipe.transformer.forward
    with pytest.raises(ValueError, match="not parallelized"):
        remove(pipe)  # a wrapper that copied our attributes is not ours: we no longer own forward
    assert pipe.transformer.forward is theirs


def test_abbreviated_options_are_refused(capsys):
    from ditmesh.cli import main

    with pytest.raises(SystemExit) as exit_info:
        main(["generate", "--npro", "2"])
    assert exit_info.value.code == 2 and "--npro" in capsys.readouterr().err


# -- parallelize once, remove gives the pipeline back -----------------------------------------------------------
def test_parallelize_twice_is_refused_with_the_way_back(flux_tiny):
    from diffusers import FluxPipeline

    from ditmesh import ConfigError, ParallelConfig, parallelize, remove

    pipe = FluxPipeline.from_pretrained(flux_tiny, dtype=torch.float32)
    parallelize(pipe, ParallelConfig())
    with pytest.raises(ConfigError, match=r"already parallelized .*ditmesh\.remove\(pipe\)"):
        parallelize(pipe, ParallelConfig())
    remove(pipe)
    parallelize(pipe, ParallelConfig())  # accepted again after remove
    remove(pipe)
    with pytest.raises(ValueError, match="not parallelized"):
        remove(pipe)


def test_a_parallelized_pipeline_is_freed_with_its_last_reference(flux_tiny):
    import gc
    import weakref

    from diffusers import FluxPipeline

    from ditmesh import ParallelConfig, parallelize

    pipe = FluxPipeline.from_pretrained(flux_tiny, dtype=torch.float32)
    parallelize(pipe, ParallelConfig())
    transformer = weakref.ref(pipe.transformer)
    del pipe
    gc.collect()
    assert transformer() is None  # no registry, runtime or context keeps the model alive


@pytest.mark.parametrize("world, config, fuse", [
    (4, {"tp": 2, "ulysses": 2}, True),  # sharded weights, packed proj_out, fused Q/K/V, encoders broadcast
    (2, {"ring": 2}, False),
])
def test_remove_gives_back_a_flux_pipeline_equal_to_one_never_parallelized(pools, flux_tiny, world, config, fuse):
    for diffs, parallel_err, after_remove in pools(world).run(remove_restores_case, flux_tiny, config, fuse):
        assert diffs == []
        assert parallel_err <= 1e-5
        assert after_remove == 0.0


def test_remove_after_cfg_parallelism_gives_back_the_pipeline(pools, flux_tiny):
    extra = dict(negative_prompt="", true_cfg_scale=2.0)
    for diffs, parallel_err, after_remove in pools(2).run(remove_restores_case, flux_tiny, {"cfg": 2}, extra=extra):
        assert diffs == [] and parallel_err <= 1e-5 and after_remove == 0.0


def test_remove_after_pipefusion_gives_back_the_pipeline(pools, flux_tiny, model_checkpoints):
    # the other stages' blocks were emptied on each rank; remove() broadcasts them back from their owners
    for model, extra in ((flux_tiny, {}), (model_checkpoints["wan2.2-tiny"], {"num_frames": 5})):
        for diffs, parallel_err, after_remove in pools(2).run(remove_restores_case, model, {"pp": 2}, extra=extra,
                                                                 options={"pp_warmup": 2}):
            assert diffs == [], model
            assert parallel_err <= 1e-5, model  # every step exact
            assert after_remove == 0.0, model


def test_remove_after_tensor_parallel_sd3_and_wan(pools, model_checkpoints):
    for name in ("sd3-tiny", "wan2.2-tiny"):
        extra = {"num_frames": 5} if name.startswith("wan") else {}
        for diffs, parallel_err, after_remove in pools(2).run(remove_restores_case, model_checkpoints[name],
                                                                 {"tp": 2}, extra=extra):
            assert diffs == [], name
            assert parallel_err <= 1e-5, name
            assert after_remove == 0.0, name


def test_remove_of_a_shard_loaded_transformer_says_it_cannot_come_back_whole(pools, flux_tiny):
    for message in pools(2).run(remove_sharded_load_case, flux_tiny):
        assert message is not None and "loaded as tensor-parallel shard" in message and "load the model again" in message


# -- defects a new user met --------------------------------------------------------------------------------------
@pytest.mark.parametrize("selector, matched", [
    ({"class_names": ("RenamedAttention",)}, "matches 0 of the 4 attention layers"),
    ({"paths": ("transformer_blocks.*.attn",)}, "matches 2 of the 4 attention layers"),
])
def test_an_attention_selection_that_misses_layers_is_refused(pools, flux_tiny, selector, matched):
    # flux-tiny: 2 double + 2 single blocks, one FluxAttention each (4 layers)
    for message, hooked in pools(2).run(renamed_attention_case, flux_tiny, selector):
        assert message is not None and matched in message and "fix the adapter" in message
        assert not hooked  # nothing left on the model


@pytest.mark.parametrize("config", [{"ulysses": 2}, {"tp": 2}, {"cfg": 2}])
def test_both_transformers_of_a_two_transformer_pipeline_run_parallel(pools, model_checkpoints, config):
    ref, ref_calls = two_transformers_case(model_checkpoints["wan2.2-tiny"], {})
    assert ref_calls["transformer"]["calls"] > 0 and ref_calls["transformer_2"]["calls"] > 0
    kind = {"ulysses": "all_to_all", "tp": "all_reduce", "cfg": "all_gather"}[next(iter(config))]
    for latents, per_model in pools(2).run(two_transformers_case, model_checkpoints["wan2.2-tiny"], config):
        assert rel_err(latents, ref) <= 1e-5
        for name in ("transformer", "transformer_2"):
            assert per_model[name]["calls"] == ref_calls[name]["calls"]
            assert per_model[name]["counts"].get(kind, 0) > 0, (name, per_model[name]["counts"])


def test_sd3_compiles_its_blocks(model_checkpoints):
    from diffusers import DiffusionPipeline

    from ditmesh import ParallelConfig, parallelize, remove

    pipe = DiffusionPipeline.from_pretrained(model_checkpoints["sd3-tiny"], dtype=torch.float32)
    pipe.set_progress_bar_config(disable=True)
    kwargs = dict(height=32, width=32, num_inference_steps=1, max_sequence_length=32, output_type="latent")
    eager = pipe("a red circle", generator=torch.Generator().manual_seed(0), **kwargs).images
    runtime = parallelize(pipe, ParallelConfig(), compile=True)
    blocks = list(pipe.transformer.transformer_blocks)
    assert "compile(blocks)" in runtime.applied
    assert all(block._compiled_call_impl is not None for block in blocks)
    compiled = pipe("a red circle", generator=torch.Generator().manual_seed(0), **kwargs).images
    assert rel_err(compiled, eager) <= 1e-5
    remove(pipe)
    assert all(block._compiled_call_impl is None for block in blocks)


# -- the adapters' data matches the models ----------------------------------------------------------------------
def _tiny_models():
    from ditmesh.models import adapters

    return [(adapter, arch) for adapter in adapters() for arch in adapter.synth_archs
            if arch.name.endswith("-tiny")]


@pytest.mark.parametrize("adapter, arch", _tiny_models(), ids=lambda x: getattr(x, "name", ""))
def test_block_lists_name_what_flows_between_blocks(adapter, arch):
    from ditmesh.hooks import bind_kwargs
    from ditmesh.synth import build_transformer

    model = build_transformer(arch)
    frames = 1 + (adapter.frame_step or 4)  # two latent frames of a video family (Wan 5, Mochi 7)
    try:
        height, width = 32, 32
        layout = adapter.layout(dict(model.config), height, width, frames, 8)
    except ValueError:  # a family whose smallest size is larger (Kandinsky 6 SR: NABLA's 8 x 8 token blocks)
        height, width = arch.default_size
        layout = adapter.layout(dict(model.config), height, width, frames, 8)
    inputs = adapter.example_inputs(model, height=height, width=width, batch=1, text_len=8,
                                    generator=torch.Generator().manual_seed(0), device="cpu", dtype=torch.float32,
                                    frames=frames)
    seen = []
    tokens = {stream: layout.text_tokens if stream == "text" else layout.image_tokens
              for stream in adapter.sequence_plan.streams}

    def hook(module, args, kwargs, out, spec):
        named = bind_kwargs(module.forward, args, kwargs)
        outs = out if isinstance(out, tuple) else (out,)
        seen.append(spec.path)
        assert len(outs) == len(spec.returns), spec
        for name, tensor in zip(spec.returns, outs):
            if tensor is not None:  # SD3's last block (context_pre_only) returns no text stream
                assert tensor.shape == named[name].shape, (spec, name)
        assert all(name in named for name in spec.carries), spec
        if spec.streams:  # each carried input holds its stream's tokens along dim 1 (PipeFusion sizes patches by it)
            assert len(spec.streams) == len(spec.carries), spec
            assert [named[name].shape[1] for name in spec.carries] == [tokens[s] for s in spec.streams], spec

    handles = [block.register_forward_hook(lambda m, a, k, o, spec=spec: hook(m, a, k, o, spec), with_kwargs=True)
               for spec in adapter.blocks for block in model.get_submodule(spec.path)]
    with torch.no_grad():
        model(**inputs)
    for h in handles:
        h.remove()
    lists = [[spec.path] * len(model.get_submodule(spec.path)) for spec in adapter.blocks]
    if adapter.alternating_blocks:  # block i of each list in turn (Latte), which PipeFusion and the caches refuse
        assert adapter.pp_refusal and adapter.cache_refusal and len({len(paths) for paths in lists}) == 1
        lists = [list(paths) for paths in zip(*lists)]
    assert seen == [path for paths in lists for path in paths]
    assert adapter.block_modules(model) == [b for spec in adapter.blocks for b in model.get_submodule(spec.path)]


@pytest.mark.parametrize("adapter, arch", _tiny_models(), ids=lambda x: getattr(x, "name", ""))
def test_sequence_plans_start_from_diffusers_cp_plan(adapter, arch):
    import diffusers

    cp_plan = getattr(getattr(diffusers, arch.transformer_class), "_cp_plan", None)
    plan = adapter.sequence_plan
    if cp_plan is None:
        return  # the class has none (SD3): ours is the only plan
    from ditmesh.models.base import name_pattern

    for replaced in plan.replaces_cp_plan:  # each names entries the class's plan has
        assert any(name_pattern(replaced).match(path) for path in cp_plan), replaced
    for path, entry in cp_plan.items():
        if any(name_pattern(replaced).match(path) for replaced in plan.replaces_cp_plan):
            assert plan.differs_from_cp_plan, path
            continue  # split elsewhere, as the plan says
        if hasattr(entry, "gather_dim"):  # ContextParallelOutput
            assert plan.gathers[path].dim == entry.gather_dim, path
            continue
        for key, split in entry.items():
            if key in plan.whole:
                continue  # kept whole on every rank (a key mask, reordered like the keys)
            ours = (plan.outputs if split.split_output else plan.inputs)[path][key]
            dim = ours.dim + split.expected_dims if ours.dim < 0 and split.expected_dims else ours.dim  # from the end
            assert dim == split.split_dim, (path, key)
    assert plan.differs_from_cp_plan, "say where and why the plan goes beyond diffusers' own"


@pytest.mark.parametrize("adapter, arch", _tiny_models(), ids=lambda x: getattr(x, "name", ""))
def test_tensor_plans_agree_with_diffusers_tp_plan(adapter, arch):
    import diffusers

    tp_plan = getattr(getattr(diffusers, arch.transformer_class), "_tp_plan", None)
    plan = adapter.tensor_plan
    if tp_plan is None:
        return  # the class has none: ours is the only plan
    ours = {p.removesuffix("?"): "colwise" for p in plan.colwise}
    ours.update({p.removesuffix("?"): "rowwise" for p in plan.rowwise})
    ours.update({p: "packed_rowwise" for p in plan.packed_rowwise})
    ours.update({p: "packed_colwise" for p in plan.packed_colwise})
    theirs = {p: style if isinstance(style, str) else
              "packed_colwise" if "Colwise" in type(style).__name__ else "packed_rowwise" for p, style in tp_plan.items()}
    assert ours == theirs
