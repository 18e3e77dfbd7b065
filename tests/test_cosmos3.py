"""Cosmos 3 Omni (``models/cosmos3.py``) under every axis it runs, on real gloo process groups, against one process:
diffusers' test configuration of the class at its dummy inputs (2 text tokens and 1 vision token: a rank with no
generation token) and at 3 x 5 latent cells; ours, 3 heads over 1 key-value head with the generation pathway's own
text-key norm, sound and action tokens, conditioning frames and steps, odd token counts (7 text, 20 generation) and
real mRoPE positions (diffusers' dummy positions are all zero, under which a wrong cut of the RoPE table would pass);
and the synthetic tiny architecture (4 heads over 2 key-value heads) under tp. The refusals, and the pipeline end to
end through ``ditmesh generate``."""

from __future__ import annotations

import math

import pytest
import torch

from cases_cosmos3 import cosmos3_call, counts_of
from cases_models import case_id
from ditmesh.testing import rel_err

CASES = [
    ("diffusers", "diffusers", {"ulysses": 2}),
    ("diffusers", "diffusers", {"ring": 2}),
    ("diffusers", "diffusers-3x5", {"ring": 2, "ulysses": 2}),
    ("odd", "odd", {"ulysses": 3}),
    ("odd", "odd", {"ring": 2}),
    ("odd", "odd", {"ring": 3}),
    ("tiny", "tiny", {"tp": 2}),
    ("tiny", "tiny", {"tp": 2, "ulysses": 2}),
    ("tiny", "tiny", {"ring": 2, "ulysses": 2}),
]


@pytest.mark.parametrize("model, case, config", CASES, ids=case_id)
def test_cosmos3_transformer_matches_single_process(pools, model, case, config):
    ref, _ = cosmos3_call(model, case, {})
    for out, counts in pools(math.prod(config.values())).run(cosmos3_call, model, case, config):
        assert rel_err(out, ref) <= 1e-5
        assert counts == counts_of(config)


@pytest.mark.parametrize("name", ["position_ids", "input_ids", "sound", "action"])
def test_cosmos3_inputs_the_split_cuts_change_the_output(name):
    # what the parallel runs cut or route (the RoPE table, the causal text, the sound and action tokens) must move the
    # predictions, or the comparisons above could not fail on them
    from cases_cosmos3 import build, inputs_of

    inputs = inputs_of(build("odd"), "odd")
    changed = {"position_ids": inputs["position_ids"] * 2, "input_ids": inputs["input_ids"].roll(1),
               "sound": [inputs["sound_tokens"][0] + 1], "action": [inputs["action_tokens"][0] + 1]}[name]
    key = {"sound": "sound_tokens", "action": "action_tokens"}.get(name, name)
    ref = cosmos3_call("odd", "odd", {})[0]
    assert rel_err(cosmos3_call("odd", "odd", {}, (key, changed))[0], ref) > 1e-3


def test_cosmos3_text_is_causal():
    # the understanding pathway is causal: changing the last text token leaves no trace in the text before it, which
    # the generation tokens read; changing the first one does
    from cases_cosmos3 import build, inputs_of

    model = build("odd")
    inputs = inputs_of(model, "odd")
    seen = []
    model.norm.register_forward_hook(lambda m, a, out: seen.append(out))
    for position in (6, 0):
        ids = inputs["input_ids"].clone()
        ids[position] = (ids[position] + 1) % model.config.vocab_size
        with torch.no_grad():
            model(**inputs)
            model(**dict(inputs, input_ids=ids))
    assert torch.equal(seen[0][:6], seen[1][:6]) and not torch.equal(seen[0][6], seen[1][6])
    assert not torch.equal(seen[2][1:], seen[3][1:])


@pytest.mark.parametrize("model, config, match", [
    ("diffusers", {"tp": 2}, "cannot shard Cosmos 3's 1 key/value heads"),
    ("tiny", {"cfg": 2}, "one packed, unbatched sample"),
    ("tiny", {"dp": 2}, "one packed, unbatched sample"),
])
def test_cosmos3_refusals_in_one_line(model, config, match):
    from cases_cosmos3 import build
    from ditmesh import ParallelConfig, parallelize

    class Pipe:
        transformer = build(model)

    with pytest.raises(Exception, match=match) as refused:
        parallelize(Pipe, ParallelConfig(**config))
    assert "\n" not in str(refused.value)


def test_generate_runs_cosmos3_as_one_process_does(tmp_path, tiny_checkpoints):
    # Cosmos3OmniPipeline end to end on the synthetic checkpoint (no guardrail: the folder turns its safety checker
    # off), guidance on (a cond and an uncond call a step, their text prefixes of different lengths), under ulysses 2
    # with the Wan 2.2 VAE split over the two ranks (3 latent rows: uneven): the latents equal the pipeline's own in one
    # process, and so do the decoded frames (to one level of 255)
    import json

    import diffusers
    import numpy as np
    from PIL import Image
    from safetensors.torch import load_file

    from cases_models import run_ranks

    path, out = tiny_checkpoints("cosmos3-omni-tiny"), tmp_path / "video.png"
    run_ranks(["generate", "--model", path, "--frames", "5", "--height", "48", "--width", "80", "--steps", "2",
               "--guidance", "4", "--out", str(out), "--save-latents", str(tmp_path / "latents.safetensors"),
               "--nproc", "2", "--ulysses", "2"])
    report = json.loads(out.with_name(out.name + ".json").read_text())
    assert report["vae_parallel"]["split"]
    pipe = diffusers.DiffusionPipeline.from_pretrained(path, dtype=torch.float32)
    pipe.set_progress_bar_config(disable=True)
    final = {}

    def grab(p, i, t, kw):
        final["latents"] = kw["latents"].clone()
        return kw

    frames = pipe(prompt=report["prompt"][0], num_inference_steps=2, guidance_scale=4.0, height=48, width=80,
                  num_frames=5, generator=torch.Generator("cpu").manual_seed(report["seed"]),
                  callback_on_step_end=grab).video
    got = load_file(str(tmp_path / "latents.safetensors"))["latents"]
    assert rel_err(got, final["latents"]) <= 1e-5
    written = sorted((tmp_path / "video_frames").glob("frame_*.png"))
    assert len(written) == len(frames) == 5
    for file, frame in zip(written, frames):
        diff = np.abs(np.asarray(Image.open(file), dtype=int) - np.asarray(frame.convert("RGB"), dtype=int))
        assert diff.max() <= 1


def test_bench_times_cosmos3_and_keeps_every_prediction():
    # bench compares each method's last output with one process's: the per-item prediction lists as one tensor
    from types import SimpleNamespace

    from cases_cosmos3 import build, flat, inputs_of
    from ditmesh.bench.worker import _timed

    model = build("odd")
    inputs = inputs_of(model, "odd")
    row = {}
    times, out = _timed(model, inputs, {"warmup": 0, "steps": 1}, SimpleNamespace(step_index=None),
                        torch.device("cpu"), row)
    with torch.no_grad():
        assert len(times) == 1 and "error" not in row and torch.equal(out, flat(model(**inputs)[:1]))


def test_generate_refuses_cfg_and_pipefusion_before_any_rank_starts(tiny_checkpoints):
    from cases_models import generate_refusal

    path = tiny_checkpoints("cosmos3-omni-tiny")
    assert "before the uncond call" in generate_refusal(path, "--cfg", "2", "--nproc", "2", "--guidance", "4")
    assert "PipeFusion does not run cosmos3-omni" in generate_refusal(path, "--pp", "2", "--nproc", "2")
