"""HiDream-I1 on real gloo process groups, against one process: image, T5 and Llama states split as streams of their
own, the heads and every SwiGLU of the MoE shard, mixed axes (tp x ulysses, tp x ring, tp 4), non-square latents padded
with their key mask, step caches deciding as one process, remove(), the planner's meta trace; the rest of the matrix
is in test_models_sp.py, test_tensor_parallel_models.py and test_batch_parallel_models.py.

HiDreamImagePipeline renders ``default_sample_size`` squared latent pixels whatever size is asked (it keeps only the
aspect ratio), so the tests set it on the loaded pipeline: 8 gives 64x64 images (16 image tokens), 6 gives 48x48 (9).
"""

from __future__ import annotations


import pytest
import torch

from cases_cache import assert_cache_decides_as_one_process
from cases_models import FamilyRuns, PROMPTS, axis_id, check_ranks, pipeline_counts, transformer_call
from ditmesh.testing import rel_err

#: image tokens (H/16 * W/16) and text tokens (T5 and Llama, each max_sequence_length): 16 + 32 + 2 x 32 divide 2 and
#: 4; 9 + 15 + 2 x 15 divide neither
SHAPES = {"even": dict(height=64, width=64, max_sequence_length=32, pipe_attrs={"default_sample_size": 8}),
          "uneven": dict(height=48, width=48, max_sequence_length=15, pipe_attrs={"default_sample_size": 6})}
STEPS = 2
#: attention layers per call: 2 double + 2 single blocks
LAYERS = 4
#: all-reduces of one call under tp: double block: to_out, to_out_t, 4 sharded QK-norms, the text MLP, the shared
#: expert and the 4 routed experts (each chosen by some token) = 12; single block: to_out, 2 QK-norms, the shared
#: expert and 4 routed experts = 8
TP_ALL_REDUCES = 2 * 12 + 2 * 8


@pytest.fixture(scope="module")
def hidream_tiny(tiny_checkpoints) -> str:
    return tiny_checkpoints("hidream-tiny")


#: the pipeline runs of this file and their one-process references
RUNS = FamilyRuns(SHAPES, steps=STEPS, guidance_scale=5.0)
reference = RUNS.reference


# ulysses 4, ring 2 and 4 and ring 2 x ulysses 2, even and uneven: tests/test_models_sp.py; tp 2 (alone, x ulysses 2,
# x ring 2, sharded loading) with the all-reduces of each block: tests/test_tensor_parallel_models.py; cfg 2 (alone and
# x ulysses 2) and dp 2 over 3 prompts: tests/test_batch_parallel_models.py
@pytest.mark.parametrize("config, shape", [
    ({"ulysses": 2}, "even"), ({"tp": 4}, "even"),
    ({"ulysses": 2}, "uneven"), ({"tp": 2, "ulysses": 2}, "uneven"), ({"tp": 2, "ring": 2}, "uneven"),
], ids=lambda c: axis_id(c) if isinstance(c, dict) else c)
def test_hidream_pipeline_matches_single_process(pools, hidream_tiny, config, shape):
    ref = reference(hidream_tiny, shape)
    outs = RUNS.generate(hidream_tiny, config, shape, pools=pools)
    # batched CFG: one transformer call per step
    check_ranks(outs, ref, STEPS, pipeline_counts(config, STEPS, LAYERS, TP_ALL_REDUCES, calls_per_step=1))


def _non_square_inputs() -> dict:
    """One step's inputs at a 64 x 32 image: 4 x 2 = 8 image tokens, padded to max_seq = 16 x 16 / 4 = 64 by the
    model with ``hidden_states_masks`` over them; 7 T5 and 5 Llama tokens."""
    from ditmesh.models.base import adapter_for
    from ditmesh.synth import build_transformer

    model = build_transformer("hidream-tiny", dtype=torch.float32)
    inputs = adapter_for(model).example_inputs(model, height=64, width=32, batch=2, text_len=7, device="cpu",
                                               dtype=torch.float32, generator=torch.Generator().manual_seed(3))
    inputs["encoder_hidden_states_llama3"] = inputs["encoder_hidden_states_llama3"][:, :, :5]
    return inputs


@pytest.mark.parametrize("config", [{"ulysses": 2}, {"ring": 2}, {"ring": 2, "ulysses": 2}], ids=axis_id)
def test_hidream_non_square_latents_with_their_key_mask_match_single_process(pools, config):
    inputs = _non_square_inputs()
    ref, _ = transformer_call("hidream-tiny", {}, inputs)
    assert ref.shape == (2, 4, 8, 4)
    ulysses, ring = config.get("ulysses", 1), config.get("ring", 1)
    expected = {"all_gather": 1, **({"all_to_all": 2 * LAYERS} if ulysses > 1 else {}),
                **({"ring_p2p": (ring - 1) * LAYERS} if ring > 1 else {})}
    for out, counts in pools(ulysses * ring).run(transformer_call, "hidream-tiny", config, inputs):
        assert rel_err(out, ref) <= 1e-5
        assert counts == expected


def test_hidream_padded_keys_take_part_in_the_attention():
    # the mask zeroes the padded keys but keeps them (score 0, not -inf): a run without the 56 padded tokens differs,
    # so the split must keep them where one process has them
    from ditmesh.synth import build_transformer

    model = build_transformer("hidream-tiny", dtype=torch.float32)
    inputs = _non_square_inputs()
    with torch.no_grad():
        padded = model(**inputs)[0]
        hidden, masks, sizes, ids = model.patchify(inputs["hidden_states"])
        assert masks.shape == (2, 64) and masks.sum().item() == 2 * 8
        trimmed = model(**dict(inputs, hidden_states=hidden[:, :8], hidden_states_masks=masks[:, :8],
                               img_sizes=sizes, img_ids=ids[:, :8]))[0]
    assert rel_err(trimmed, padded) > 1e-3


# dbcache's middle (blocks 1-2) spans the last double block and the first single block: its residual is taken over
# the joined sequence; teacache reads the first double block's modulated image stream
@pytest.mark.parametrize("setting", ["dbcache:threshold=0.85,first=1,last=1", "teacache:threshold=1.0,warmup=1"])
def test_hidream_cache_decides_as_one_process_under_ulysses(pools, hidream_tiny, setting):
    assert_cache_decides_as_one_process(pools, hidream_tiny, {"ulysses": 2}, setting, steps=5, prompts=PROMPTS,
                                        size=64, max_sequence_length=32, pipe_attrs={"default_sample_size": 8})


def test_remove_after_tensor_and_sequence_parallel_hidream_gives_back_the_pipeline(pools, hidream_tiny):
    # sharded experts and QK-norms, the sequence processors and hooks: all undone
    from cases_hooks import remove_restores_case

    for diffs, parallel_err, after_remove in pools(4).run(remove_restores_case, hidream_tiny, {"tp": 2, "ulysses": 2},
                                                             pipe_attrs={"default_sample_size": 6}):
        assert diffs == []
        assert parallel_err <= 1e-5
        assert after_remove == 0.0


def test_hidream_cuda_graphs_are_refused_in_one_line():
    # the MoE reads its routing on the host in every call, which no CUDA graph can capture
    from ditmesh import ConfigError, ParallelConfig, parallelize
    from ditmesh.synth import build_transformer

    class Pipe:
        transformer = build_transformer("hidream-tiny", dtype=torch.float32)

    with pytest.raises(ConfigError, match="CUDA graphs do not run hidream: its MoE") as error:
        parallelize(Pipe, ParallelConfig(), cuda_graph=True)
    assert "\n" not in str(error.value)


def test_hidream_pipefusion_is_refused_in_one_line():
    from ditmesh.models import adapter_for_class
    from ditmesh.options import pipefusion_refusal

    with pytest.raises(NotImplementedError, match="use pp=1") as error:
        pipefusion_refusal(adapter_for_class("HiDreamImageTransformer2DModel"))
    assert "\n" not in str(error.value)


def test_hidream_real_size_matches_the_published_config():
    from ditmesh.models import adapter_for_class
    from ditmesh.synth import get_arch

    t = get_arch("hidream-i1").transformer
    assert (t["num_layers"], t["num_single_layers"], t["num_attention_heads"], t["attention_head_dim"]) == (16, 32, 20, 128)
    assert (t["num_routed_experts"], t["num_activated_experts"], len(t["llama_layers"])) == (4, 2, 48)
    assert t["llama_layers"][31:] == [31] * 17 and t["caption_channels"] == [4096, 4096]
    adapter = adapter_for_class("HiDreamImageTransformer2DModel")
    layout = adapter.layout(t, 1024, 1024, 1, 128)
    assert (layout.image_tokens, layout.text_tokens, layout.split_tokens) == (4096, 384, 4480)
    assert adapter.layout(t, 1024, 768, 1, 128).image_tokens == 4096  # non-square: padded to max_seq


def test_hidream_planner_trace_counts_the_flops_of_a_real_call():
    # the meta trace cannot route tokens (the MoE counts them per expert on the host); it runs num_activated_experts
    # experts on every token instead, which is what any routing costs: its GEMM FLOPs equal a real call's
    from torch.utils.flop_counter import FlopCounterMode

    from ditmesh.models.base import adapter_for
    from ditmesh.planner.stats import resolve_model, trace_stats
    from ditmesh.synth import build_transformer

    spec = resolve_model("hidream-tiny", "float32")
    stats = trace_stats(spec, 64, 64)
    model = build_transformer("hidream-tiny", dtype=torch.float32)
    inputs = adapter_for(model).example_inputs(model, height=64, width=64, batch=1, text_len=spec.text_tokens,
                                               generator=torch.Generator().manual_seed(0), device="cpu",
                                               dtype=torch.float32)
    counter = FlopCounterMode(display=False)
    with torch.no_grad(), counter:
        model(**inputs)
    real = counter.get_flop_counts()["Global"]
    assert stats.gemm_flops == sum(n for op, n in real.items() if str(op) in ("aten.mm", "aten.addmm")) > 0
    assert stats.attention_flops > 0
