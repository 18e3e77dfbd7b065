"""Regional compilation (``api.compile_blocks``) on one process: every block list is traced once, the first block of
a list with packed inputs (``BlockList.packed``) included, and the compiled model gives the eager output."""

from __future__ import annotations

import pytest
import torch

from ditmesh.api import compile_blocks
from ditmesh.models.base import adapter_for
from ditmesh.synth import build_transformer


@pytest.mark.parametrize("arch", ["flux-tiny", "hunyuan-video-tiny"])
def test_each_block_class_is_traced_once_and_the_output_is_the_eager_one(arch):
    import torch._dynamo
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list
    from torch._dynamo.utils import guard_failures

    torch._dynamo.reset()
    guard_failures.clear()
    model = build_transformer(arch, dtype=torch.float32).eval()
    adapter = adapter_for(model)
    assert any(spec.packed for spec in adapter.blocks)
    inputs = adapter.example_inputs(model, 64, 64, 1, 32, torch.Generator().manual_seed(0), torch.device("cpu"),
                                    torch.float32, frames=5 if "video" in arch else None)
    inputs = {k: v for k, v in inputs.items() if k != "return_dict"}
    with torch.no_grad():
        eager = model(**inputs, return_dict=False)[0]
        undo = compile_blocks(model, adapter)
        compiled = [model(**inputs, return_dict=False)[0] for _ in range(2)]
    classes = {type(b) for b in adapter.block_modules(model)}
    assert {c.__name__: len(_debug_get_cache_entry_list(c.forward.__code__)) for c in classes} == {
        c.__name__: 1 for c in classes}
    assert not {code.co_qualname: r for code, r in guard_failures.items() if r}
    for out in compiled:
        assert float((out - eager).norm() / eager.norm()) <= 1e-5
    for fn in undo:
        fn()
    firsts = [model.get_submodule(spec.path)[0] for spec in adapter.blocks if spec.packed]
    assert firsts and not any(block._forward_pre_hooks for block in firsts)  # the undo removed the packing hook
