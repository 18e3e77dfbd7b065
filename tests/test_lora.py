"""LoRA adapters on parallelized pipelines: loaded before or after parallelize, fused or not, several with weights
and switched between calls, each run equal to one process with the same LoRA."""

from __future__ import annotations

import pytest
import torch

from cases_lora import ATTENTION_FFN_TARGETS, hook_on_row_parallel_case, lora_case, make_lora, switch_case
from ditmesh.testing import rel_err

#: every call of a plan against one process
TOLERANCE = 1e-5
#: set_adapters switches between calls, then a fused pair, unfused, and off
PLAN = [("adapters", ["style"], [1.0]), ("adapters", ["style", "detail"], [0.7, -0.5]), ("fuse", 0.8), ("unfuse",),
        ("disable",)]
#: FLUX flux-tiny (2 double, 2 single blocks) under tp=2: the row-parallel linears' all-reduces per transformer call,
#: and the adapted row-parallel layers (attention out and FFN down of the double blocks, proj_out of the single
#: blocks), each of which adds one all-reduce (of its rank-wide A product) per active adapter
BASE_ALL_REDUCES, ADAPTED_ROW_PARALLEL = 4 * 2 + 1 * 2, 2 * 2 + 2


@pytest.fixture(scope="module")
def flux_loras(flux_tiny, tmp_path_factory) -> list:
    root = tmp_path_factory.mktemp("lora")
    return [(make_lora(flux_tiny, str(root / name), seed), name) for seed, name in ((1, "style"), (2, "detail"))]


def _reference(model, loras, plan, **kwargs):
    return lora_case(model, {}, loras, plan, **kwargs)


def _assert_matches(results, ref):
    for r in results:
        for i, (out, want) in enumerate(zip(r["latents"], ref["latents"])):
            assert rel_err(out, want) <= TOLERANCE, (i, rel_err(out, want))


def test_lora_changes_the_output_and_each_switch_changes_it_again(flux_tiny, flux_loras):
    """The LoRAs are not zero (peft starts B at zero) and every step of the plan gives another result."""
    ref = _reference(flux_tiny, flux_loras, PLAN + [("enable",)])["latents"]
    off = ref[4]
    for i in range(4):
        assert rel_err(ref[i], off) > 0.05, i
    assert rel_err(ref[0], ref[1]) > 0.05
    assert rel_err(ref[2], ref[1]) > 0.05  # fused at scale 0.8 (diffusers keeps that scale after unfuse_lora)
    assert rel_err(ref[5], ref[3]) <= TOLERANCE  # enabled again


@pytest.mark.parametrize("before,prefuse", [(False, None), (True, None), (True, 0.6), (False, 0.6)],
                         ids=["after", "before", "fused-before", "fused-after"])
def test_flux_lora_tp2_matches_single_process(pools, flux_tiny, flux_loras, before, prefuse):
    """tp=2: A/B split like the layer they adapt; fused into the shards; one all-reduce per adapted row-parallel
    layer and active adapter, none while fused or disabled."""
    plan = ([("run",), ("unfuse",)] if prefuse else []) + PLAN
    ref = _reference(flux_tiny, flux_loras, plan, prefuse=prefuse)
    results = pools(2).run(lora_case, flux_tiny, {"tp": 2}, flux_loras, plan, before=before, prefuse=prefuse,
                           count=True)
    _assert_matches(results, ref)
    # active adapters per call: fused (none), unfused (the last one loaded), then PLAN's
    active = ([0, 1] if prefuse else []) + [1, 2, 0, 2, 0]
    for r in results:
        assert [c.get("all_reduce", 0) for c in r["counts"]] == \
            [2 * (BASE_ALL_REDUCES + n * ADAPTED_ROW_PARALLEL) for n in active]  # 2 steps
    assert torch.equal(results[0]["latents"][-1], results[1]["latents"][-1])


@pytest.mark.parametrize("config,call", [
    ({"ulysses": 2}, None),
    ({"ring": 2}, None),
    ({"cfg": 2}, {"prompt": "a red circle", "negative_prompt": "a blue square", "true_cfg_scale": 4.0}),
    ({"dp": 2}, {"prompt": "a red circle", "num_images_per_prompt": 2}),
])
def test_flux_lora_sequence_and_batch_parallel_match_single_process(pools, flux_tiny, flux_loras, config, call):
    """LoRA loaded after parallelize (including on proj_out, where sequence parallelism gathers: the gather moves
    to the LoRA layer peft puts there)."""
    plan = PLAN[:3]
    ref = _reference(flux_tiny, flux_loras, plan, call=call)
    _assert_matches(pools(2).run(lora_case, flux_tiny, config, flux_loras, plan, call=call), ref)


def test_fused_and_unloaded_lora_equals_unfused_and_leaves_no_lora_layer(pools, flux_tiny, flux_loras):
    """generate's --fuse-lora (fuse_loras): two adapters with weights fused into the weights (the shards under tp 2)
    and peft's layers taken out. The output is the unfused adapters' on one process; no LoRA layer is left, and under
    tp 2 a call has the base model's all-reduces alone (the adapters' A all-reduces went with their layers)."""
    plan = [("adapters", ["style", "detail"], [0.7, -0.5]), ("fuse_unload",)]
    ref = _reference(flux_tiny, flux_loras, plan)
    assert ref["lora_layers"] == 0
    assert rel_err(ref["latents"][1], ref["latents"][0]) <= TOLERANCE
    for config in ({"tp": 2}, {"ulysses": 2}):
        for r in pools(2).run(lora_case, flux_tiny, config, flux_loras, plan, count=True):
            assert r["lora_layers"] == 0, config
            for out in r["latents"]:
                assert rel_err(out, ref["latents"][0]) <= TOLERANCE, config
            if config == {"tp": 2}:
                assert [c.get("all_reduce", 0) for c in r["counts"]] == \
                    [2 * (BASE_ALL_REDUCES + 2 * ADAPTED_ROW_PARALLEL), 2 * BASE_ALL_REDUCES]  # 2 steps


def test_flux_lora_tp2_fused_qkv(pools, flux_tiny, tmp_path):
    """With fuse_qkv, attention layers with an adapted projection stay separate and the others are fused (exact);
    a LoRA loaded after the fusion would be bypassed, so that load is refused with what to do."""
    from ditmesh.testing import RankError

    targets = ["transformer_blocks.0.attn.to_q", "ff.net.0.proj", "ff.net.2", "proj_mlp"]
    loras = [(make_lora(flux_tiny, str(tmp_path / "partial"), 5, targets=targets), "partial")]
    plan = [("run",), ("fuse", 1.0)]
    ref = _reference(flux_tiny, loras, plan)
    for r in pools(2).run(lora_case, flux_tiny, {"tp": 2}, loras, plan, before=True, fuse_qkv=True):
        assert r["fused"] == 3  # block 1 and both single blocks; block 0's to_q is adapted
        for out, want in zip(r["latents"], ref["latents"]):
            assert rel_err(out, want) <= TOLERANCE
    with pytest.raises(RankError, match="load the LoRA before parallelize, or parallelize without fuse_qkv"):
        pools(2).run(lora_case, flux_tiny, {"tp": 2}, loras, plan, fuse_qkv=True)


def test_remove_gives_back_the_pipeline_with_its_whole_lora(pools, flux_tiny, flux_loras):
    """remove() gathers the adapters' shards back: the state dict and the output are those of one process."""
    plan = [("adapters", ["style", "detail"], [0.7, -0.5]), ("remove",)]
    ref = _reference(flux_tiny, flux_loras, plan[:1])
    for r in pools(2).run(lora_case, flux_tiny, {"tp": 2}, flux_loras, plan):
        assert r["state"].keys() == ref["state"].keys()
        assert all(torch.equal(r["state"][k], ref["state"][k]) for k in ref["state"])
        assert rel_err(r["latents"][1], ref["latents"][0]) <= TOLERANCE


def test_sd3_lora_tp2_before_and_after_match_single_process(pools, model_checkpoints, tmp_path):
    sd3 = model_checkpoints["sd3-tiny"]
    loras = [(make_lora(sd3, str(tmp_path / n), seed, targets=ATTENTION_FFN_TARGETS), n)
             for seed, n in ((3, "style"), (4, "detail"))]
    plan = PLAN[:4]
    ref = _reference(sd3, loras, plan)
    for before in (False, True):
        _assert_matches(pools(2).run(lora_case, sd3, {"tp": 2}, loras, plan, before=before), ref)


def test_generate_lora_option_tp2_matches_single_process(tmp_path, flux_tiny, flux_loras):
    """`generate --lora PATH:SCALE` (repeated): the adapters are loaded after parallelizing, with their scales; with
    --fuse-lora they are fused into each tp rank's shards and unloaded, and the result is the same."""
    from test_generate_cli import generate

    (style, _), (detail, _) = flux_loras
    opts = ["--model", flux_tiny, "--lora", f"{style}:0.7", "--lora", f"{detail}:-0.5"]
    one, latents_one, _ = generate(tmp_path, "one", *opts, "--nproc", "1")
    tp2, latents_tp2, _ = generate(tmp_path, "tp2", *opts, "--nproc", "2", "--tp", "2")
    fused, latents_fused, _ = generate(tmp_path, "fused", *opts, "--fuse-lora", "--nproc", "2", "--tp", "2")
    _, latents_none, _ = generate(tmp_path, "none", "--model", flux_tiny, "--nproc", "1")
    assert rel_err(latents_tp2, latents_one) <= TOLERANCE
    assert rel_err(latents_fused, latents_one) <= TOLERANCE
    assert rel_err(latents_one, latents_none) > 0.05
    assert tp2["loras"] == fused["loras"] == [{"path": style, "scale": 0.7}, {"path": detail, "scale": -0.5}]
    assert (one["lora_fused"], tp2["lora_fused"], fused["lora_fused"]) == (False, False, True)


@pytest.mark.parametrize("command", ["generate", "serve"])
def test_fuse_lora_without_lora_is_one_line_error(command, capsys):
    from ditmesh.cli import main

    assert main([command, "--fuse-lora"]) == 2
    err = capsys.readouterr().err.strip()
    assert "--fuse-lora is given without --lora" in err and len(err.splitlines()) == 1


@pytest.mark.parametrize("value,needle", [
    ("/no/such/lora.safetensors", "--lora /no/such/lora.safetensors: no such file or folder"),
    ("{lora}:strong", "scale 'strong' is not a number; give PATH or PATH:SCALE"),
    ("{lora}:nan", "scale nan is not a finite number"),
    ("{empty}", "has no .safetensors file"),
])
def test_generate_lora_bad_path_or_scale_is_one_line_error(value, needle, tmp_path, capsys, monkeypatch):
    from ditmesh.cli import main

    monkeypatch.chdir(tmp_path)
    (tmp_path / "lora.safetensors").write_bytes(b"")
    (tmp_path / "empty").mkdir()
    value = value.format(lora=tmp_path / "lora.safetensors", empty=tmp_path / "empty")
    assert main(["generate", "--lora", value]) == 2
    err = capsys.readouterr().err.strip()
    assert needle in err and len(err.splitlines()) == 1


def test_hook_on_a_swapped_linear_keeps_running(pools, flux_tiny):
    """Row-parallel linears are swapped modules sharing the original's hook tables: a hook registered before
    parallelize runs on the whole output while swapped and after remove, and its handle still removes it."""
    for r in pools(2).run(hook_on_row_parallel_case, flux_tiny):
        assert r["during"] == [r["width"]] and r["after"] == [r["width"]] and r["removed"] == []


def test_unload_after_parallelize_then_remove_gives_back_the_plain_pipeline(pools, flux_tiny, flux_loras):
    """unload_lora_weights puts peft's base layers back (our row-parallel swap included); remove() still finds
    and undoes everything."""
    plan = [("adapters", ["style", "detail"], [0.7, -0.5]), ("unload",), ("remove",)]
    ref = _reference(flux_tiny, [], [("run",)])
    for r in pools(2).run(lora_case, flux_tiny, {"tp": 2}, flux_loras, plan):
        assert rel_err(r["latents"][1], ref["latents"][0]) <= TOLERANCE
        assert rel_err(r["latents"][2], ref["latents"][0]) <= TOLERANCE
        assert r["state"].keys() == ref["state"].keys()
        assert all(torch.equal(r["state"][k], ref["state"][k]) for k in ref["state"])


def test_dora_under_tp_is_refused_before_loading(pools, flux_tiny, tmp_path):
    from ditmesh.testing import RankError

    loras = [(make_lora(flux_tiny, str(tmp_path / "dora"), 6, targets=["to_q", "ff.net.2"], use_dora=True), "dora")]
    with pytest.raises(RankError, match="DoRA adapter .* cannot be split over tensor-parallel ranks"):
        pools(2).run(lora_case, flux_tiny, {"tp": 2}, loras, [("run",)])


def test_lora_with_bias_tp2_matches_single_process(pools, flux_tiny, tmp_path):
    """B's bias (peft's lora_bias): split with the rows of a column-parallel layer, whole (added once, after A's
    all-reduce) for a row-parallel one; fused into the bias shards."""
    loras = [(make_lora(flux_tiny, str(tmp_path / "biased"), 7, lora_bias=True), "biased")]
    plan = [("run",), ("fuse", 0.5), ("unfuse",)]
    ref = _reference(flux_tiny, loras, plan)
    for before in (False, True):
        _assert_matches(pools(2).run(lora_case, flux_tiny, {"tp": 2}, loras, plan, before=before), ref)


def test_wan22_lora_into_both_transformers_tp2_matches_single_process(pools, model_checkpoints, tmp_path):
    """Wan 2.2 (two transformers): one LoRA loaded into both, after and before parallelize."""
    wan = model_checkpoints["wan2.2-tiny"]
    loras = [(make_lora(wan, str(tmp_path / "wan"), 8, targets=ATTENTION_FFN_TARGETS), "style")]
    plan = [("run",), ("fuse", 0.5)]
    kwargs = dict(call={"num_frames": 5}, load={"load_into_transformer_2": True})
    ref = _reference(wan, loras, plan, **kwargs)
    off = _reference(wan, [], [("run",)], call={"num_frames": 5})
    assert rel_err(ref["latents"][0], off["latents"][0]) > 0.05
    for before in (False, True):
        _assert_matches(pools(2).run(lora_case, wan, {"tp": 2}, loras, plan, before=before, **kwargs), ref)


def test_synth_lora_writes_the_benchs_adapter_as_a_file_the_pipeline_loads(flux_tiny, tmp_path, capsys):
    """`ditmesh synth --lora RANK --model DIR --out DIR`: the adapter `bench --lora` measures (every attention linear),
    in the file format `generate --lora` loads; loaded, every adapted linear holds the seeded A and B."""
    from diffusers import FluxPipeline
    from peft.tuners.lora import LoraLayer

    from ditmesh.cli import main
    from ditmesh.synth import attention_lora

    assert main(["synth", "--lora", "4", "--model", flux_tiny, "--out", str(tmp_path / "lora"), "--seed", "5"]) == 0
    assert "rank-4 LoRA on 22 attention linears" in capsys.readouterr().out  # flux-tiny: 2 x 8 + 2 x 3
    from ditmesh.shared import current_umask

    assert (tmp_path / "lora" / "lora.safetensors").stat().st_mode & 0o777 == 0o666 & ~current_umask()  # not 0600
    pipe = FluxPipeline.from_pretrained(flux_tiny, dtype=torch.float32)
    want = attention_lora(pipe.transformer, 4, seed=5)
    pipe.load_lora_weights(str(tmp_path / "lora" / "lora.safetensors"), adapter_name="synth")
    layers = {n: m for n, m in pipe.transformer.named_modules() if isinstance(m, LoraLayer)}
    assert len(layers) == 22 and len(want) == 44
    for key, value in want.items():
        name, factor = key.rsplit(".lora_", 1)
        got = getattr(layers[name], f"lora_{factor[0]}")["synth"].weight
        assert torch.equal(got, value), key
    assert all(layers[n].scaling["synth"] == 1.0 for n in layers)  # alpha = rank: the adapter at the bench's scale
    assert main(["synth", "--lora", "0", "--model", flux_tiny, "--out", str(tmp_path / "zero")]) == 2
    assert "--lora 0: give the adapter's rank" in capsys.readouterr().err and not (tmp_path / "zero").exists()


#: serve's per-request adapters: each call's choice, and the reference plan on one process that loads both adapters
#: and activates the chosen one alone with peft's set_adapters (disable_lora for none): the latents of entries 0, 1,
#: 3 and 4 are those of the choices
CHOICES = ["style", None, "detail", "style"]
CHOICE_PLAN = [("adapters", ["style"], [0.8]), ("disable",), ("enable",), ("adapters", ["detail"], [-0.5]),
               ("adapters", ["style"], [0.8])]
CFG_CALL = {"prompt": "a red circle", "negative_prompt": "a blue square", "true_cfg_scale": 4.0}


@pytest.mark.parametrize("config", [{"ulysses": 2}, {"tp": 2}, {"cfg": 2}], ids=["ulysses2", "tp2", "cfg2"])
def test_adapters_chosen_per_call_match_that_adapter_alone_on_one_process(pools, flux_tiny, flux_loras, config):
    """serve's ``--lora NAME=PATH:SCALE``: both adapters loaded, one chosen per call by writing the scale tensors
    (ditmesh.parallel.lora.Switch); each call equals one process with the chosen adapter alone active (none: the
    base model)."""
    loras = [(file, name, scale) for (file, name), scale in zip(flux_loras, (0.8, -0.5))]
    call = CFG_CALL if config == {"cfg": 2} else None
    ref = _reference(flux_tiny, flux_loras, CHOICE_PLAN, call=call)["latents"]
    want = [ref[0], ref[1], ref[3], ref[4]]
    assert rel_err(want[0], want[1]) > 0.05 and rel_err(want[0], want[2]) > 0.05  # each choice changes the picture
    for r in pools(2).run(switch_case, flux_tiny, config, loras, CHOICES, call=call):
        for i, (out, expected) in enumerate(zip(r["latents"], want)):
            assert rel_err(out, expected) <= TOLERANCE, (config, CHOICES[i], rel_err(out, expected))


def test_choosing_an_adapter_recompiles_nothing_and_costs_microseconds(flux_tiny, flux_loras):
    """Compiled blocks (dynamo) make their graphs in the first call; the switches after it make none, and the
    graphs read the scales at run time: each choice gives its own latents, the same choice the same ones."""
    loras = [(file, name, scale) for (file, name), scale in zip(flux_loras, (0.8, -0.5))]
    compiled = switch_case(flux_tiny, {}, loras, CHOICES, compile_blocks=True)
    assert compiled["graphs"][0] > 0 and compiled["graphs"] == [compiled["graphs"][0]] * len(CHOICES)
    latents = compiled["latents"]
    assert rel_err(latents[0], latents[1]) > 0.05 and rel_err(latents[2], latents[1]) > 0.05
    assert torch.equal(latents[0], latents[3])  # "style" again
    print(f"\nadapter switch: {1e6 * max(compiled['switch_s'][1:]):.0f} us at most (CPU, flux-tiny)")
