"""The 8-bit attention's run options (``attention``, ``attention_bf16_steps``, eval-tiny's ``--eight-sweep``) on its
float32 emulation (``fp8-emulated``), and the retired ``int8`` refused in one line. The fp8 kernel and its rounding:
tests/test_attention_fp8.py."""

from __future__ import annotations

import pytest
import torch

from cases import flux_generate
from ditmesh.testing import rel_err


def test_exact_steps_at_both_ends_of_the_run(flux_tiny):
    """attention_bf16_steps=W: the first and last W steps attend exactly; W covering every step is the exact run."""
    exact, _ = flux_generate(flux_tiny, {}, 3, 48, 48)
    every, _, _ = flux_generate(flux_tiny, {}, 3, 48, 48,
                                options={"attention": "fp8-emulated", "attention_bf16_steps": 2})
    assert rel_err(every, exact) <= 1e-6
    middle, _, _ = flux_generate(flux_tiny, {}, 3, 48, 48,
                                 options={"attention": "fp8-emulated", "attention_bf16_steps": 1})
    assert rel_err(middle, exact) > 1e-5


@pytest.mark.parametrize("config,options,message", [
    ({}, {"attention": "int4"}, "attention='int4' is not a attention kernel; use one of default, fp8, fp8-emulated"),
    ({}, {"attention": "int8"}, "attention=int8 was retired: it was slower than the exact attention on every shape "
                                "measured"),
    ({}, {"attention": "int8-emulated"}, "attention=int8-emulated was retired"),
    ({}, {"attention_bf16_steps": 2}, "attention_bf16_steps=2 keeps steps out of 8-bit attention, and the attention is "
                                      "the default one"),
    ({}, {"attention": "fp8-emulated", "attention_bf16_steps": -1}, "must be a step count >= 0"),
])
def test_bad_attention_option_is_refused_with_what_would_work(flux_tiny, config, options, message):
    from diffusers import FluxPipeline

    from ditmesh import ParallelConfig, parallelize
    from ditmesh.api import runtime_of
    from ditmesh.config import ConfigError

    pipe = FluxPipeline.from_pretrained(flux_tiny, dtype=torch.float32)
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        parallelize(pipe, ParallelConfig(**config), **options)
    assert runtime_of(pipe) is None


@pytest.mark.parametrize("config,options,message", [
    ({"ring": 2}, {"attention": "fp8-emulated"},
     "--attention fp8-emulated runs on one process or under ulysses alone, and ring=2 merges partial attention"),
    ({}, {"attention": "int8"}, "--attention int8 was retired: .* use the default attention, or --attention fp8"),
    ({"ulysses": 2}, {"attention": "fp8-emulated", "attention_bf16_steps": 1, "cuda_graph": True},
     "--attention-bf16-steps 1 switches attention per step on the host"),
    ({"ulysses": 2}, {"comm_dtype": "fp8", "displaced": True}, "--comm-dtype fp8 does not run with displaced attention"),
])
def test_eight_bit_options_are_refused_before_any_import(config, options, message):
    """The checks that need no model run in RunOptions.create, torch-free (the command line's messages)."""
    from ditmesh import ParallelConfig
    from ditmesh.config import ConfigError
    from ditmesh.options import RunOptions

    with pytest.raises(ConfigError, match=message):
        RunOptions.create(ParallelConfig(**config), cli=True, **options)


def test_eval_tiny_eight_sweep_settings_are_read_before_any_work():
    from ditmesh.config import ConfigError
    from ditmesh.tiny.evaluate import parse_eight_setting

    assert parse_eight_setting("comm=fp8,attention=fp8,exact-steps=2") == {"comm": "fp8", "attention": "fp8",
                                                                         "quant": "off", "exact_steps": 2}
    assert parse_eight_setting("attention=fp8,quant=fp8") == {"comm": "auto", "attention": "fp8", "quant": "fp8",
                                                              "exact_steps": 0}
    for text, needle in (("comm=fp16", "give comm=fp8, attention=fp8, quant=fp8 and exact-steps=W"),
                         ("attention=int8", "give comm=fp8, attention=fp8"),
                         ("exact-steps=2", "exact-steps keeps steps out of 8-bit attention; add attention=fp8"),
                         ("", "names no 8-bit mode")):
        with pytest.raises(ConfigError, match=needle):
            parse_eight_setting(text)
