"""The boundaries of every limit: for each option or request field with a least (or most) value, that value is
accepted and the next one past it is refused with a one-line message naming it. Torch-free and fast: the mutation
check (scripts/mutate.py) runs these first for options.py and the service's request checks."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from ditmesh import ConfigError, ParallelConfig, RunOptions
from ditmesh.options import CacheConfig
from ditmesh.serve.requests import MAX_PROMPT_CHARS, MAX_SEED, BadRequest, Limits, check_options, native_options, \
    openai_options

# (degrees, option values at the boundary, the same one step past it, the refusal's text)
RUN_OPTION_LIMITS = [
    ({"pp": 2}, {"pp_warmup": 1}, {"pp_warmup": 0}, "pp_warmup=0 must be >= 1"),
    ({"ulysses": 2}, {"displaced": True, "displaced_warmup": 1}, {"displaced": True, "displaced_warmup": 0},
     "displaced_warmup=0 must be >= 1"),
    ({"pp": 2}, {"pp_patches": 2}, {"pp_patches": 1}, "pp_patches=1 is fewer than the pp=2 stages"),
    ({"pp": 3}, {"pp_patches": 3}, {"pp_patches": 2}, "pp_patches=2 is fewer than the pp=3 stages"),
    ({"pp": 2}, {"pp_chunk_bytes": 1}, {"pp_chunk_bytes": 0}, "pp_chunk_bytes=0 must be a positive byte count"),
    ({}, {"ulysses_chunks": 1}, {"ulysses_chunks": 0}, "ulysses_chunks=0 must be >= 1"),
    ({}, {"chunk_tokens": 1}, {"chunk_tokens": 0},
     r"^chunk_tokens=0 is not a token count; give a positive integer \(e.g. 4096\) or auto$"),
    ({}, {"chunk_tokens": "1"}, {"chunk_tokens": "0"}, "chunk_tokens='0' is not a token count"),
    ({}, {"vae_chunk": 1}, {"vae_chunk": 0}, r"^vae_chunk=0 is not a row count; give a positive integer \(e.g. 256\) "
                                             r"or auto$"),
    ({}, {"displaced_warmup": 1}, {"displaced_warmup": 2}, "displaced_warmup=2 is given without displaced"),
]


@pytest.mark.parametrize("degrees, ok, past, message", RUN_OPTION_LIMITS,
                         ids=[f"{next(iter(p))}={list(p.values())[-1]!r}" for _, _, p, _ in RUN_OPTION_LIMITS])
def test_run_option_limits_accept_the_boundary_and_refuse_one_past_it(degrees, ok, past, message):
    config = ParallelConfig(**degrees)
    options = RunOptions.create(config, **ok)
    for name, value in ok.items():
        assert getattr(options, name) == (int(value) if isinstance(value, str) else value)
    with pytest.raises(ConfigError, match=message) as error:
        RunOptions.create(config, **past)
    assert "\n" not in str(error.value)


# (cache text at the boundary, one past it, the rule the refusal states); teacache's ``first`` may be 0, every
# other policy's starts at 1
CACHE_LIMITS = [
    ("dbcache:threshold=0", "dbcache:threshold=-0.001", "threshold >= 0"),
    ("dbcache:first=1", "dbcache:first=0", "first >= 1"),
    ("teacache:first=0", "teacache:first=-1", "first >= 0"),
    ("dbcache:last=0", "dbcache:last=-1", "last >= 0"),
    ("dbcache:warmup=0", "dbcache:warmup=-1", "warmup >= 0"),
    ("dbcache:max_skips=1", "dbcache:max_skips=0", "max_skips >= 1"),
    ("taylor:interval=2", "taylor:interval=1", "interval >= 2"),
    ("static:skip=0", "static:skip=x", "skip='x' is not a number"),
]


@pytest.mark.parametrize("ok, past, rule", CACHE_LIMITS, ids=[p for _, p, _ in CACHE_LIMITS])
def test_cache_knob_limits_accept_the_boundary_and_refuse_one_past_it(ok, past, rule):
    config = CacheConfig.parse(ok)
    key, _, value = ok.partition(":")[2].partition("=")
    assert getattr(config, key) == (float(value) if key == "threshold" else (int(value),) if key == "skip"
                                    else int(value))
    assert CacheConfig.parse(config.describe()) == config  # the text form reads back
    with pytest.raises(ConfigError) as error:
        CacheConfig.parse(past)
    message = str(error.value)
    assert "\n" not in message and rule in message and (repr(past) in message or key in message), message


def test_cache_defaults_by_policy_and_the_step_lists():
    assert CacheConfig.parse("teacache:0.3").first == 0 and CacheConfig.parse("dbcache:0.3").first == 1
    assert CacheConfig.parse("fbcache:0.1") == CacheConfig("dbcache", 0.1)
    assert CacheConfig.parse("static:skip=3-5+8+10-10").skip == (3, 4, 5, 8, 10)
    assert CacheConfig.parse("static:skip=none").skip == ()
    assert CacheConfig.parse("default") == CacheConfig.parse("taylor:interval=4,warmup=3")
    assert not CacheConfig.parse("off").on and CacheConfig.parse("static:skip=1").on


@pytest.mark.parametrize("axis", ["dp", "pp", "ring", "ulysses", "tp"])
def test_degree_limits(axis):
    assert getattr(ParallelConfig(**{axis: 1}), axis) == 1
    with pytest.raises(ConfigError, match=f"{axis}=0 must be >= 1"):
        ParallelConfig(**{axis: 0})
    assert ParallelConfig(cfg=2).cfg == 2
    with pytest.raises(ConfigError, match="cfg=3 is not supported"):
        ParallelConfig(cfg=3)


# -- a request's limits (serve) ---------------------------------------------------------------------------------
LIMITS = Limits(max_pixels=64 * 48, max_steps=8, max_frames=9, max_n=3)
DEFAULTS = SimpleNamespace(prompt=["a"], steps=4, seed=0, height=64, width=48, frames=None, images_per_prompt=1,
                           guidance=3.5)

# (field, the values at its boundaries, the values one past them, each one's status: 400 for a value no server takes,
# 422 for one over this server's limits)
REQUEST_LIMITS = [
    ("steps", [1, 8], [0, 9], [400, 422]),
    ("n", [1, 3], [0, 4], [400, 422]),
    ("seed", [0, MAX_SEED], [-1, MAX_SEED + 1], [400, 400]),
    ("guidance", [0.0], [-0.5], [400]),
    ("height", [16, 64], [0, 8, 80], [400, 400, 422]),  # 80 * 48 pixels is over the limit; 0 and 8 are not sizes
    ("width", [16, 48], [-16, 40, 64], [400, 400, 422]),
    ("prompt", ["x" * MAX_PROMPT_CHARS], ["x" * (MAX_PROMPT_CHARS + 1), "  "], [400, 400]),
]


@pytest.mark.parametrize("name, ok, past, statuses", REQUEST_LIMITS, ids=[r[0] for r in REQUEST_LIMITS])
def test_request_limits_accept_the_boundaries_and_refuse_one_past_them(name, ok, past, statuses):
    for value in ok:
        options = native_options({name: value}, LIMITS, DEFAULTS)
        assert options[{"n": "images_per_prompt"}.get(name, name)] == value
    for value, status in zip(past, statuses, strict=True):
        with pytest.raises(BadRequest) as error:
            native_options({name: value}, LIMITS, DEFAULTS)
        assert "\n" not in str(error.value)
        assert error.value.status == status, (name, value, str(error.value))
        shown = str(value) if name != "prompt" else ("characters" if value.strip() else "empty")
        assert shown in str(error.value), (name, value, str(error.value))


def test_the_pixel_limit_is_inclusive_and_counts_both_sides():
    assert openai_options({"prompt": "p", "size": "48x64"}, LIMITS, DEFAULTS)["height"] == 64
    with pytest.raises(BadRequest, match="64x64 is 4096 pixels; this server allows at most 3072") as error:
        openai_options({"prompt": "p", "size": "64x64"}, LIMITS, DEFAULTS)
    assert error.value.status == 422
    # the server's defaults fill the side a request leaves out
    with pytest.raises(BadRequest, match="48x80 is 3840 pixels"):
        check_options({"height": 80}, LIMITS, DEFAULTS)


def test_frames_limits():
    video = SimpleNamespace(**{**vars(DEFAULTS), "frames": 5})
    for frames in (1, 9):
        check_options({"frames": frames}, LIMITS, video)
    for frames, status, said in ((0, 400, "frames 0 must be >= 1"), (10, 422, "frames 10 is over this server's limit")):
        with pytest.raises(BadRequest, match=said) as error:
            check_options({"frames": frames}, LIMITS, video)
        assert error.value.status == status


def test_a_command_line_reads_the_pp_message_size_in_mib_and_names_its_flags():
    from argparse import Namespace

    options = RunOptions.from_args(Namespace(pp=2, pp_chunk_mb=3, pp_warmup=2, chunk="auto"))
    assert options.config.pp == 2 and options.pp_chunk_bytes == 3 << 20 and options.pp_warmup == 2
    assert options.chunk_tokens == "auto"
    with pytest.raises(ConfigError, match="^--pp-warmup 0 must be >= 1"):
        RunOptions.from_args(Namespace(pp=2, pp_warmup=0))


@pytest.mark.parametrize("ulysses, local_world, fits", [(2, 2, True), (2, 4, True), (4, 4, True), (2, 3, False),
                                                        (4, 2, False), (4, 6, False)])
def test_the_copy_engine_transport_needs_each_ulysses_group_on_one_host(ulysses, local_world, fits):
    options = RunOptions.create(ParallelConfig(ulysses=ulysses), transport="symm")
    if fits:
        assert options.validate(device="cuda:0", local_world=local_world) is options
    else:
        with pytest.raises(ConfigError, match=f"transport=symm needs each ulysses={ulysses} group on one host, but a "
                                              f"host runs {local_world} processes"):
            options.validate(device="cuda:0", local_world=local_world)
    with pytest.raises(ConfigError, match="transport=symm needs CUDA GPUs"):
        options.validate(device="cpu", local_world=local_world)


@pytest.mark.parametrize("frames, refusal", [(9, None), (10, "frames 10")])
def test_the_servers_own_frames_are_checked_against_its_limits(frames, refusal):
    # serve --frames N: the server's default frame count at --max-frames and one past it (no model: a hub id's
    # family is not inspected before loading)
    from ditmesh.serve.cli import _check_limits

    args = SimpleNamespace(**{**vars(DEFAULTS), "frames": frames, "warmup_sizes": None})
    if refusal is None:
        _check_limits(LIMITS, args, None)
        assert args.warmup_sizes == []
        return
    with pytest.raises(ConfigError) as error:
        _check_limits(LIMITS, args, None)
    assert str(error.value).startswith(f"the server's own defaults break its limits: {refusal}"), str(error.value)
    assert "--max-frames" in str(error.value)
