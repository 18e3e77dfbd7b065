"""8-bit linears on a GPU with fp8 (skipped elsewhere): the float32 emulation the CPU tests run against torchao's
kernels. torchao's 8-bit weights and scales are the emulation's bit for bit; the products differ by their
accumulation (and, in ``fp8``, by the activations' rounding done on bf16 values)."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9),
                                reason="needs a CUDA GPU with fp8 (compute capability 8.9+)")

MODES = ("fp8", "fp8-weight", "int8-weight")


def _block(seed: int = 0) -> torch.nn.Sequential:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.GELU(), torch.nn.Linear(1024, 256)).cuda().bfloat16()


class _Adapter:
    """The smallest adapter :func:`ditmesh.parallel.quant.apply` reads: one block list holding the Sequential."""

    name = "test"
    blocks = (None,)

    def __init__(self, holder):
        self.holder = holder

    def block_modules(self, model):
        return [model[0]]


@pytest.mark.parametrize("mode", MODES)
def test_emulation_equals_torchao(mode):
    from ditmesh.parallel.quant import QuantLinear, apply

    x = torch.randn(4, 300, 256, device="cuda", dtype=torch.bfloat16)
    real, emulated = torch.nn.Sequential(_block()), torch.nn.Sequential(_block())
    apply(real, _Adapter(real), mode, backend="torchao")
    apply(emulated, _Adapter(emulated), mode, backend="emulated")
    for i in (0, 2):
        weight, mine = real[0][i].weight, emulated[0][i]
        assert isinstance(mine, QuantLinear)
        assert torch.equal(weight.qdata.view(torch.uint8) if mode != "int8-weight" else weight.qdata,
                           mine.qweight.view(torch.uint8) if mode != "int8-weight" else mine.qweight), mode
        assert torch.allclose(weight.scale.float().reshape(-1), mine.scale.reshape(-1), rtol=1e-6, atol=0), mode
    err = lambda a, b: float((a - b).norm() / b.norm())  # noqa: E731
    with torch.no_grad():
        ref = _block()(x).float()
        out_real, out_emulated = real(x).float(), emulated(x).float()
        # each layer on the same input: the products differ by their accumulation and the output's bf16 rounding
        hidden = real[0][1](real[0][0](x))
        layers = [err(real[0][0](x).float(), emulated[0][0](x).float()),
                  err(real[0][2](hidden).float(), emulated[0][2](hidden).float())]
    block, to_bf16 = err(out_real, out_emulated), min(err(out_real, ref), err(out_emulated, ref))
    print(f"{mode}: torchao vs emulation per layer {layers[0]:.2e} / {layers[1]:.2e}, block {block:.2e}; each vs "
          f"bf16 {err(out_real, ref):.2e} / {err(out_emulated, ref):.2e}")
    assert max(layers) <= 1e-2
    # Through the block, fp8 rounds the second layer's activations: an input that differs by the first layer's
    # accumulation flips some codes (1.8e-2 on an H200), which stays well inside the rounding's own error.
    assert block <= (0.5 * to_bf16 if mode == "fp8" else 1e-2)
    assert err(out_real, ref) <= 6e-2


def test_scaled_mm_row_parallel_path_equals_emulation():
    """:class:`QuantLinear`'s own fp8 product (``torch._scaled_mm``, what tp's row-parallel shards run) against its
    emulation on one GPU (no group)."""
    from ditmesh.parallel.quant import QuantLinear

    torch.manual_seed(1)
    linear = torch.nn.Linear(512, 384).cuda().bfloat16()
    x = torch.randn(2, 200, 512, device="cuda", dtype=torch.bfloat16)
    a, b = QuantLinear(linear, "fp8", scaled_mm=True), QuantLinear(linear, "fp8")
    with torch.no_grad():
        ra, rb = a(x).float(), b(x).float()
    assert float((ra - rb).norm() / rb.norm()) <= 1e-2
