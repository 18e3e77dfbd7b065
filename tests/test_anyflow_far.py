"""AnyFlow-FAR (``models/anyflow.py``, ``ANYFLOW_FAR``) on real gloo process groups, against one process, across a
whole autoregressive rollout (``cases_anyflow_far.rollout``): per chunk a denoising call reading the K/V cache, then
the call writing it under the frame-causal ``BlockMask``, and last the training call over every frame. The first
chunk reads an empty cache; later ones the full past chunks; the last the compressed ones (the boundary where they
begin). At diffusers' test configuration (2 heads x 12, 4 one-frame chunks of 16 x 16 latents: 64 tokens a frame, 16
compressed, the last 3 chunks full) and at ours (3 heads: 2 + 1 over two ranks; chunks of 2, 1 and 2 frames of 6 x 6
latents: 9 tokens a frame, split 5 + 4, 1 compressed; the last 2 full; a batch of 2); tp 2 x ulysses 2 on 4 heads.
cfg 2 on the batch of 2 (each rank its sample's part of the cache). Every denoising output, the training output and
the K/V cache itself (each rank's heads and samples in their slots) are compared; ring, USP, dp over one sample,
displaced attention and PipeFusion are refused in one line."""

from __future__ import annotations

import math

import pytest
import torch

from cases_anyflow_far import SHAPES, refused_rollout, rollout, rollout_inputs
from cases_models import axis_id
from ditmesh.comm import offsets, split_sizes
from ditmesh.models.anyflow import far_partition
from ditmesh.testing import rel_err

ARCHS = {"diffusers": "anyflow-far-tiny", "odd": "anyflow-far-tiny3"}
LAYERS = 2


def own_samples(config: dict, rank: int, batch: int) -> slice:
    """The samples rank ``rank`` caches: all of them, or its cfg/dp share (a batched-CFG family splits the batch over
    dp x cfg, the tp and sequence ranks inside)."""
    degree = config.get("cfg", 1) * config.get("dp", 1)
    sizes = split_sizes(batch, degree)
    j = rank // (math.prod(config.values()) // degree)
    return slice(offsets(sizes)[j], offsets(sizes)[j] + sizes[j])


def own_heads(config: dict, rank: int, heads: int) -> slice:
    """The heads rank ``rank`` caches: its tp share, and in it its Ulysses share (ulysses is the outer axis)."""
    tp, ulysses = config.get("tp", 1), config.get("ulysses", 1)
    local = heads // tp
    first = (rank % tp) * local
    sizes = split_sizes(local, ulysses)
    u = rank // tp % ulysses  # the batch axes are outer
    return slice(first + offsets(sizes)[u], first + offsets(sizes)[u] + sizes[u])


def expected_counts(config: dict, chunks: int) -> dict:
    # every call runs both blocks: chunks denoising calls, chunks - 1 cache writes, one training call; the cache
    # writes return nothing, so only the others gather their output (its tokens, or its batch under cfg)
    calls = 2 * chunks
    if "cfg" in config:
        return {"all_gather": chunks + 1}
    if "tp" in config:  # Wan's plan: 3 row-parallel linears and 4 sharded QK-norms a block
        counts = {"all_reduce": 7 * LAYERS * calls}
        return counts if "ulysses" not in config else dict(counts, all_to_all=2 * LAYERS * calls, all_gather=chunks + 1)
    return {"all_to_all": 2 * LAYERS * calls, "all_gather": chunks + 1}


def four_heads():
    """anyflow-far-tiny with 4 heads of 12 (tp 2 x ulysses 2: one head a rank), at diffusers' inputs."""
    import dataclasses

    from ditmesh.synth import get_arch

    arch = get_arch(ARCHS["diffusers"])
    return dataclasses.replace(arch, transformer=dict(arch.transformer, num_attention_heads=4))


CASES = [({"ulysses": 2}, "diffusers"), ({"tp": 2}, "diffusers"), ({"ulysses": 2}, "odd"), ({"cfg": 2}, "odd"),
         ({"ulysses": 2, "tp": 2}, "four-heads")]


@pytest.mark.parametrize("config, case", CASES, ids=lambda v: axis_id(v) if isinstance(v, dict) else v)
def test_anyflow_far_rollout_matches_single_process(pools, config, case):
    arch, shape = (four_heads(), "diffusers") if case == "four-heads" else (ARCHS[case], case)
    inputs = rollout_inputs(shape)
    ref_outs, ref_cache, _ = rollout(arch, {}, inputs)
    _, batch, heads = ref_cache[0]["full_cache"].shape[:3]
    covered = torch.zeros(batch, heads, dtype=torch.bool)
    results = pools(math.prod(config.values())).run(rollout, arch, config, inputs)
    for rank, (outs, cache, counts) in enumerate(results):
        assert len(outs) == len(ref_outs)
        for out, ref in zip(outs, ref_outs):
            assert rel_err(out, ref) <= 1e-5
        samples, mine = own_samples(config, rank, batch), own_heads(config, rank, heads)
        covered[samples, mine] = True
        for block in ref_cache:
            for name, ref in ref_cache[block].items():
                assert rel_err(cache[block][name][:, samples, mine], ref[:, samples, mine]) <= 1e-5, (block, name)
        assert counts == expected_counts(config, len(SHAPES[shape][0]))
    assert covered.all()  # every sample's and head's cache written by a rank


def test_anyflow_far_cache_and_compressed_frames_matter():
    # the cases above could not pass with a cache or a compressed context left out: the last chunk's output changes
    # when the cached chunks are others, and when the compressed past is dropped (a longer full window)
    inputs = rollout_inputs("odd")
    ref = rollout(ARCHS["odd"], {}, inputs)[0]
    other = dict(inputs, latents=inputs["latents"].clone())
    other["latents"][:, :2] += 1.0  # the first chunk: compressed by the time the last chunk reads it
    assert rel_err(rollout(ARCHS["odd"], {}, other)[0][2], ref[2]) > 1e-3
    assert rel_err(rollout(ARCHS["odd"], {}, inputs, model_config={"full_chunk_limit": 3})[0][2], ref[2]) > 1e-3


def test_anyflow_far_refuses_displaced_attention_and_pipefusion():
    from ditmesh import ParallelConfig
    from ditmesh.models import adapter_for_class
    from ditmesh.options import RunOptions

    far = adapter_for_class("AnyFlowFARTransformer3DModel")
    with pytest.raises(NotImplementedError, match="^displaced attention does not run anyflow-far: its K/V cache"):
        RunOptions.create(ParallelConfig(ulysses=2), displaced=True).validate(adapters=[far])
    with pytest.raises(NotImplementedError, match="^PipeFusion does not run anyflow-far yet: its blocks write"):
        RunOptions.create(ParallelConfig(pp=2)).validate(adapters=[far])


@pytest.mark.parametrize("config", [{"ring": 2}, {"dp": 2}], ids=axis_id)
def test_anyflow_far_refuses_ring_and_an_empty_batch_rank_in_one_line(pools, config):
    # ring (and USP) at parallelize; dp over diffusers' one sample would leave a rank without the K/V cache its calls
    # return, at the first call
    shape = "odd" if "ring" in config else "diffusers"
    for message in pools(2).run(refused_rollout, ARCHS[shape], config, rollout_inputs(shape)):
        if "ring" in config:
            assert message.startswith("ring=2 does not run anyflow-far: its K/V cache") and "use ring=1" in message
        else:
            assert message.startswith("a batch of 1 cannot give each of the 2 dp/cfg batch ranks an image, which "
                                      "anyflow-far needs (its calls return more than the sample)")
        assert "\n" not in message


def test_generate_runs_anyflow_far_as_one_process_does(tmp_path, tiny_checkpoints):
    # AnyFlowFARPipeline end to end on the synthetic checkpoint (UMT5, the Wan VAE of 4 channels), guidance on (its one
    # batched [uncond, cond] call a step, the cache holding both), under cfg 2 x ulysses 2: each cfg rank fills its
    # branch's part of the cache, each Ulysses rank its heads'. 17 frames are 5 latent frames, one
    # more than the checkpoint's 4 one-frame chunks: generate passes the pipeline 5 chunks of one, the last two reading
    # compressed ones, 4 x 4 latents. The step callback sees the chunk being denoised, so the latents saved are the last
    # chunk's, which attends to every earlier one through the cache: they equal the pipeline's own in one process
    from cases_models import generate_beside_pipeline

    got, want = generate_beside_pipeline(tmp_path, tiny_checkpoints(ARCHS["diffusers"]), frames=17, size=32,
                                         degrees={"cfg": 2, "ulysses": 2}, chunk_partition=[1] * 5)
    assert got.shape == (1, 1, 4, 4, 4)  # the last chunk, frames-first
    assert rel_err(got.permute(0, 2, 1, 3, 4), want[:, :, -1:]) <= 1e-5


def test_chunk_partition_of_a_frame_count():
    # the checkpoint's own where it covers the frames, else its first chunk, then its longest ones, the rest last
    released = {"chunk_partition": [1, 3, 3, 3, 3, 3, 3, 2], "full_chunk_limit": 3}
    assert far_partition(released, None) == far_partition(released, 81) == [1, 3, 3, 3, 3, 3, 3, 2]
    assert far_partition(released, 17) == [1, 3, 1] and far_partition(released, 5) == [1, 1]
    assert far_partition({"chunk_partition": [2, 1, 2], "full_chunk_limit": 2}, 21) == [2, 2, 2]
    assert far_partition({"chunk_partition": [2, 1, 2], "full_chunk_limit": 2}, 1) == [1]
    with pytest.raises(ValueError, match=r"^frames=9 makes 2 chunk\(s\) .* at least 3 .*; use --frames 17 or more$"):
        far_partition({"chunk_partition": [2, 2], "full_chunk_limit": 4}, 9)


def test_generate_refuses_too_few_chunks_in_one_line(tmp_path, tiny_checkpoints, capsys):
    # the pipeline's cache needs full_chunk_limit - 1 chunks (2 here): one frame makes one. The partition is the
    # checkpoint's, read when the pipeline is loaded: the refusal follows the loading's progress bars
    from ditmesh.cli import main

    code = main(["generate", "--model", tiny_checkpoints(ARCHS["diffusers"]), "--frames", "1", "--height", "32",
                 "--width", "32", "--steps", "1", "--out", str(tmp_path / "video.gif")])
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert code == 2 and line.startswith("ditmesh: error: frames=1 makes 1 chunk(s) of latent frames")
    assert line.endswith("use --frames 5 or more") and not (tmp_path / "video.gif").exists()
