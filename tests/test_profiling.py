"""The profiler breakdown's interval arithmetic, on hand-made kernel records."""

from __future__ import annotations

import json

import pytest

from ditmesh.profiling import breakdown, kernels_from_trace, kind_of


def test_kind_of_kernel_names():
    assert kind_of("ncclDevKernel_SendRecv(ncclDevKernelArgsStorage<4096ul>)") == "comm"
    assert kind_of("void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<128>>") == "attention"
    assert kind_of("nvjet_hsh_256x128_64x4_1x2_h_bz_coopA_NTT") == "gemm"
    assert kind_of("triton_poi_fused_add_mul_0") == "other"
    assert kind_of("Memcpy DtoD (Device -> Device)") == "copy"


def test_breakdown_splits_compute_comm_and_idle():
    # compute 0-10 and 12-20 (us); comm 8-14 overlaps compute for 2+2 us, exposed 10-12; idle 20-25
    kernels = [("nvjet_gemm", 0, 10), ("triton_poi_x", 12, 8), ("ncclDevKernel_SendRecv", 8, 6),
               ("flash_fwd_kernel", 25, 5)]
    b = breakdown(kernels)
    assert b["span_ms"] == pytest.approx(0.030)
    assert b["compute_ms"] == pytest.approx(0.023)
    assert b["comm_ms"] == pytest.approx(0.006)
    assert b["comm_hidden_ms"] == pytest.approx(0.004)
    assert b["comm_exposed_ms"] == pytest.approx(0.002)
    assert b["idle_ms"] == pytest.approx(0.005)
    assert b["kernels_ms"] == {"gemm": 0.01, "attention": 0.005, "comm": 0.006, "copy": 0.0, "other": 0.008}
    assert b["top_kernels"][0] == ["nvjet_gemm", 0.01, 1]


def test_breakdown_ranks_kernels_by_summed_time():
    kernels = [("small", 0, 3), ("many", 3, 2), ("many", 5, 2), ("big", 7, 5)]
    assert breakdown(kernels, top=2)["top_kernels"] == [["big", 0.005, 1], ["many", 0.004, 2]]


def test_breakdown_rejects_an_empty_trace():
    with pytest.raises(ValueError, match="no GPU kernels"):
        breakdown([])


def test_kernels_from_trace_keeps_this_devices_kernels(tmp_path):
    trace = {"traceEvents": [
        {"cat": "kernel", "name": "a", "ts": 1.0, "dur": 2.0, "args": {"device": 0}},
        {"cat": "kernel", "name": "b", "ts": 3.0, "dur": 1.0, "args": {"device": 1}},
        {"cat": "gpu_memcpy", "name": "Memcpy DtoD (Device -> Device)", "ts": 5.0, "dur": 1.0, "args": {"device": 0}},
        {"cat": "cpu_op", "name": "aten::mm", "ts": 0.0, "dur": 9.0},
    ]}
    path = tmp_path / "t.json"
    path.write_text(json.dumps(trace))
    assert kernels_from_trace(str(path), 0) == [("a", 1.0, 2.0), ("Memcpy DtoD (Device -> Device)", 5.0, 1.0)]
    assert len(kernels_from_trace(str(path))) == 3
