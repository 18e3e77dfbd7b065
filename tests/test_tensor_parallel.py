"""Tensor parallelism (alone and on a 2-D mesh with sequence parallelism) against single-process results."""

from __future__ import annotations

import pytest
import torch

from cases import flux_generate
from cases_tp import packed_proj_out_case, sharded_load_case, tp_pipeline_case
from test_generate_cli import generate
from ditmesh.testing import rel_err

#: all-reduces per block under tp > 1: a FLUX double block has 4 row-parallel linears (attention out, text
#: attention out, FFN down, text FFN down), a single block 1 (the packed proj_out)
DOUBLE_BLOCK_ALL_REDUCES, SINGLE_BLOCK_ALL_REDUCES = 4, 1


@pytest.fixture(scope="session")
def flux_tiny_tp(tmp_path_factory) -> str:
    """Path of a flux-tiny-tp synthetic pipeline (4 heads, so tp 4 divides them)."""
    from ditmesh.synth import write_checkpoint

    path = tmp_path_factory.mktemp("ckpt") / "flux-tiny-tp"
    write_checkpoint("flux-tiny-tp", path, seed=0, device="cpu")
    return str(path)


def test_packed_proj_out_split_is_exact_and_a_contiguous_split_is_wrong(pools, flux_tiny):
    for packed, contiguous in pools(2).run(packed_proj_out_case, flux_tiny):
        assert packed <= 1e-6
        assert contiguous > 0.1  # no error raised, just a wrong block output


def expected_collectives(config: dict, double: int = 2, single: int = 2) -> dict:
    """Collectives of one flux transformer call."""
    out = {}
    if config.get("tp", 1) > 1:
        out["all_reduce"] = DOUBLE_BLOCK_ALL_REDUCES * double + SINGLE_BLOCK_ALL_REDUCES * single
    if config.get("ulysses", 1) > 1:
        out["all_to_all"] = 2 * (double + single)
        out["all_gather"] = 1
    return out


@pytest.mark.parametrize("model,config", [
    ("flux_tiny", {"tp": 2}),
    ("flux_tiny_tp", {"tp": 4}),
    ("flux_tiny", {"tp": 2, "ulysses": 2}),
])
def test_flux_tp_matches_single_process(pools, request, model, config):
    path = request.getfixturevalue(model)
    world = config.get("tp", 1) * config.get("ulysses", 1)
    ref, _ = flux_generate(path, {}, 2)
    results = pools(world).run(tp_pipeline_case, path, config, 2)
    per_call = expected_collectives(config)
    for r in results:
        assert rel_err(r["latents"], ref) <= 1e-5
        assert r["param_bytes"] == r["expected_bytes"]  # replicated + sharded / tp, exactly
        blocks = r["per_block"]
        for name, counts in blocks.items():
            if name.startswith("transformer_blocks."):
                assert counts["all_reduce"] == DOUBLE_BLOCK_ALL_REDUCES, name
            elif name.startswith("single_transformer_blocks."):
                assert counts["all_reduce"] == SINGLE_BLOCK_ALL_REDUCES, name
        assert blocks["transformer"] == per_call
        assert r["counts"] == {k: 2 * v for k, v in per_call.items()}  # 2 steps, nothing else
    assert torch.equal(results[0]["latents"], results[-1]["latents"])


def test_flux_tp2_ring2_matches_single_process(pools, flux_tiny):
    ref, _ = flux_generate(flux_tiny, {}, 2)
    for r in pools(4).run(tp_pipeline_case, flux_tiny, {"tp": 2, "ring": 2}, 2):
        assert rel_err(r["latents"], ref) <= 1e-5
        assert r["param_bytes"] == r["expected_bytes"]
        assert r["per_block"]["transformer"]["all_reduce"] == expected_collectives({"tp": 2})["all_reduce"]


def test_sharded_load_reads_only_the_shard_and_equals_slicing_the_full_model(pools, flux_tiny):
    for same, heads, meta_left in pools(2).run(sharded_load_case, flux_tiny, 2):
        assert same and heads == {3} and not meta_left


def test_sharded_load_casts_to_the_asked_dtype(flux_tiny):
    """A float32 checkpoint loaded sharded in bf16 holds bf16 shards (as from_pretrained(torch_dtype=...) would),
    not the stored dtype."""
    from ditmesh.parallel import tensor

    model = tensor.load_sharded_transformer(flux_tiny, 0, 2, "cpu", torch.bfloat16)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}


def test_sharded_load_with_broadcast_text_encoders_matches_single_process(pools, flux_tiny):
    ref, _ = flux_generate(flux_tiny, {}, 2)
    results = pools(2).run(tp_pipeline_case, flux_tiny, {"tp": 2}, 2, text_encoders="broadcast", sharded_load=True)
    assert [r["has_text_encoders"] for r in results] == [True, False]  # only tp rank 0 keeps (and runs) them
    for r in results:
        assert rel_err(r["latents"], ref) <= 1e-5
        assert r["param_bytes"] == r["expected_bytes"]
        # one structure broadcast + 3 tensors (prompt_embeds, pooled_prompt_embeds, text_ids), once per call
        assert r["counts"]["broadcast"] == 4 and r["counts"]["all_reduce"] == 2 * expected_collectives({"tp": 2})["all_reduce"]


def test_remove_gathers_the_full_weights_back(pools, flux_tiny):
    for r in pools(2).run(tp_pipeline_case, flux_tiny, {"tp": 2}, 1, remove=True):
        assert r["restored"]


def test_tp_degree_that_does_not_divide_heads_is_refused():
    from ditmesh import ParallelConfig
    from ditmesh.config import ConfigError

    with pytest.raises(ConfigError, match="tp=4 does not divide the 6 attention heads"):
        ParallelConfig(tp=4).check_heads(6, "FluxTransformer2DModel")


def test_generate_cli_tp2_ulysses2_matches_single_process(tmp_path, flux_tiny):
    _, single, _ = generate(tmp_path, "single", "--model", flux_tiny, "--nproc", "1")
    report, latents, _ = generate(tmp_path, "tp2u2", "--model", flux_tiny, "--nproc", "4", "--tp", "2", "--ulysses", "2")
    assert rel_err(latents, single) <= 1e-5
    assert report["config"]["tp"] == 2 and report["config"]["ulysses"] == 2
    assert len(report["load_peak_memory_bytes"]) == 4 and all(m > 0 for m in report["load_peak_memory_bytes"])
