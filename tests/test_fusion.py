"""Fused Q/K/V projections (``ditmesh.fusion``): same results as the separate projections, one GEMM, no extra memory."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from cases import flux_generate
from cases_models import pipeline_generate
from ditmesh.fusion import fuse_qkv
from ditmesh.models.base import adapter_for
from ditmesh.testing import rel_err


class CountMatmuls(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default):
            self.count += 1
        return func(*args, **(kwargs or {}))


@pytest.fixture(scope="module")
def wan_tiny(tmp_path_factory) -> str:
    from ditmesh.synth import write_checkpoint

    return str(write_checkpoint("wan-tiny", tmp_path_factory.mktemp("wan") / "wan-tiny", seed=0, device="cpu"))


def test_flux_pipeline_with_fused_qkv_matches_separate_projections(flux_tiny):
    fused, _ = flux_generate(flux_tiny, {}, 2, fuse_qkv=True)
    separate, _ = flux_generate(flux_tiny, {}, 2)
    assert rel_err(fused, separate) <= 1e-5


def test_wan_pipeline_with_fused_qkv_matches_separate_projections(wan_tiny):
    shape = dict(height=48, width=48, frames=5)
    fused = pipeline_generate(wan_tiny, {}, **shape, fuse_qkv=True)[0]
    separate = pipeline_generate(wan_tiny, {}, **shape)[0]
    assert rel_err(fused, separate) <= 1e-5


def test_fusion_runs_one_gemm_per_stream_with_no_extra_weight_memory_and_undoes(flux_tiny):
    from diffusers import FluxTransformer2DModel

    model = FluxTransformer2DModel.from_pretrained(flux_tiny, subfolder="transformer", dtype=torch.float32)
    adapter = adapter_for(model)
    inputs = adapter.example_inputs(model, height=48, width=48, batch=1, text_len=8,
                                    generator=torch.Generator().manual_seed(0), device="cpu", dtype=torch.float32)

    def run():
        with torch.no_grad(), CountMatmuls() as mm:
            out = model(**inputs)[0]
        return out, mm.count

    def weight_bytes():
        storages = {p.untyped_storage().data_ptr(): p.untyped_storage().nbytes() for p in model.parameters()}
        return sum(storages.values())

    before, before_bytes = run(), weight_bytes()
    undo = fuse_qkv(model, adapter)
    after = run()
    attn = model.transformer_blocks[0].attn
    assert attn.fused_projections and attn.to_q.weight.data_ptr() == attn.to_qkv.weight.data_ptr()
    assert weight_bytes() == before_bytes  # the separate weights are views of the fused ones
    # 2 double blocks x (image + text stream) + 2 single blocks: each fusion saves 2 of its 3 products
    assert before[1] - after[1] == 2 * (2 * 2 + 2)
    assert rel_err(after[0], before[0]) <= 1e-5
    for fn in undo:
        fn()
    assert not attn.fused_projections and not hasattr(attn, "to_qkv")
    again = run()
    assert again[1] == before[1] and rel_err(again[0], before[0]) <= 1e-5


def test_fused_qkv_under_ulysses_and_tensor_parallel_match_separate_single_process(pools, flux_tiny):
    ref, _ = flux_generate(flux_tiny, {}, 2, 48, 48)
    for config in ({"ulysses": 2}, {"tp": 2}):
        for latents, _ in pools(2).run(flux_generate, flux_tiny, config, 2, 48, 48, fuse_qkv=True):
            assert rel_err(latents, ref) <= 1e-5
