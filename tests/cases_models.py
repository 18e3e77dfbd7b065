"""Functions run on every rank of a gloo worker pool for the SD3 and Wan sequence-parallel tests.

Each takes the parallel configuration as a dict of degrees (``{"ulysses": 2}``, ``{"ring": 2}``,
``{"ring": 2, "ulysses": 2}``), so the test matrix grows by adding parameters, not functions.
"""

from __future__ import annotations

import inspect
import math
from pathlib import Path

import torch

#: two prompts of different lengths (a pipeline that pads to the longest pads the first)
PROMPTS = ["a red circle", "a big blue square on a green field under a yellow sun at noon"]
#: a joint text + image family's tiny sizes: image tokens (H/16 * W/16) and text tokens (max_sequence_length where
#: the pipeline pads to it): 16 + 32 divide 2 and 4; 9 + 15 divide neither
JOINT_SHAPES = {"even": dict(height=64, width=64, max_sequence_length=32),
                "uneven": dict(height=48, width=48, max_sequence_length=15)}


#: the parallel configurations of a family's pipeline test: every axis at degree 2 (ring x ulysses at 4)
EVERY_AXIS = [{"ulysses": 2}, {"ring": 2}, {"ring": 2, "ulysses": 2}, {"tp": 2}, {"cfg": 2}, {"dp": 2}]


def axis_id(config: dict) -> str:
    """A test id of a configuration: ``ring2-ulysses2``."""
    return "-".join(f"{k}{v}" for k, v in config.items())


#: the sequence-parallel configurations of a family's transformer test: ulysses 2, ring 2, ring 2 x ulysses 2 (USP)
SP_AXES = [{"ulysses": 2}, {"ring": 2}, {"ring": 2, "ulysses": 2}]


def case_id(value) -> str:
    """A test id of a (configuration, case name) parameter: :func:`axis_id` of a configuration, the name as is."""
    return axis_id(value) if isinstance(value, dict) else value


def sequence_counts(config: dict, layers: int, calls: int) -> dict:
    """Collectives of a sequence-parallel pipeline call whose ``layers`` attentions each run over the split joint
    sequence: per layer 2 all-to-alls under Ulysses and ``ring - 1`` exchange rounds under ring; one all-gather of the
    output per transformer call."""
    per_layer = {"all_to_all": 2 if "ulysses" in config else 0, "ring_p2p": config.get("ring", 1) - 1}
    return {**{kind: n * layers * calls for kind, n in per_layer.items() if n}, "all_gather": calls}


def whole_audio_counts(config: dict, blocks: int, audio: bool = True) -> dict:
    """Collectives of one call of a family that splits its video and keeps its audio whole (LTX-2, Kandinsky 6): per
    block the video self-attention's 2 all-to-alls (Ulysses) or ``ring - 1`` rounds and, with audio, one all-gather of
    the audio queries' partial results over the video keys; one all-gather of the video output."""
    counts = {"all_gather": 1 + (blocks if audio else 0)}
    if "ulysses" in config:
        counts["all_to_all"] = 2 * blocks
    if "ring" in config:
        counts["ring_p2p"] = (config["ring"] - 1) * blocks
    return counts


def call_counts(config: dict, layers: int, all_reduces: int) -> dict:
    """Collectives of ONE transformer call of a family whose ``layers`` attentions run over the split joint sequence:
    per layer 2 all-to-alls under Ulysses and ``ring - 1`` exchange rounds under ring, one all-gather of the output;
    under tp the plan's ``all_reduces``."""
    counts = {"all_reduce": all_reduces} if config.get("tp", 1) > 1 else {}
    if config.get("ulysses", 1) > 1:
        counts["all_to_all"] = 2 * layers
    if config.get("ring", 1) > 1:
        counts["ring_p2p"] = (config["ring"] - 1) * layers
    if config.get("ulysses", 1) * config.get("ring", 1) > 1:
        counts["all_gather"] = 1
    return counts


def check_transformer(pools, arch, config: dict, inputs: dict, counts: dict) -> torch.Tensor:
    """The synthetic ``arch`` transformer's call on ``inputs`` under ``config`` on every rank of the pool of its world
    size, against one process: rel. err <= 1e-5 and the collectives ``counts`` on every rank. Returns the reference."""
    from ditmesh.testing import rel_err

    ref, _ = transformer_call(arch, {}, inputs)
    for out, got in pools(math.prod(config.values())).run(transformer_call, arch, config, inputs):
        assert rel_err(out, ref) <= 1e-5
        assert got == counts
    return ref


def example_inputs(arch, height: int, width: int, text: int, batch: int = 2, seed: int = 3) -> dict:
    """The synthetic ``arch`` transformer's adapter's ``example_inputs`` at that size (float32, CPU)."""
    from ditmesh.models import adapter_for
    from ditmesh.synth import build_transformer

    model = build_transformer(arch, dtype=torch.float32)
    return adapter_for(model).example_inputs(model, height, width, batch, text, torch.Generator().manual_seed(seed),
                                             "cpu", torch.float32)


def check_ranks(outs: list, ref: torch.Tensor, calls: int, counts: dict) -> None:
    """Every rank's :func:`pipeline_generate` result against the one-process latents ``ref``: rel. err <= 1e-5,
    ``calls`` transformer calls and the collectives ``counts``; every rank ends with the same latents."""
    from ditmesh.testing import rel_err

    for latents, got_counts, got_calls in outs:
        assert rel_err(latents, ref) <= 1e-5
        assert got_calls == calls
        assert got_counts == counts
    assert torch.equal(outs[0][0], outs[-1][0])


def pipeline_generate(model: str, config: dict, steps: int = 2, height: int = 64, width: int = 64, frames: int | None = None,
                      max_sequence_length: int = 32, guidance_scale: float = 5.0, prompt: str = "a red circle",
                      fuse_qkv: bool = False, chunk_tokens=None, extra: dict | None = None,
                      pipe_attrs: dict | None = None):
    """Run the pipeline in folder ``model`` with ditmesh ``config`` (and ``chunk_tokens``) on this rank (``extra``:
    more call kwargs; ``pipe_attrs``: attributes set on the loaded pipeline, such as HiDream's
    ``default_sample_size``, which fixes the image area whatever the size asked).

    Returns ``(final latents, collectives issued during the call, number of transformer calls)``. Works
    for image pipelines (SD3) and video pipelines (Wan, with ``frames``); a pipeline without
    ``callback_on_step_end`` (PixArt) returns its final latents as its output.
    """
    from diffusers import DiffusionPipeline

    from ditmesh import ParallelConfig, parallelize
    from ditmesh.comm import count_collectives

    torch.manual_seed(0)
    pipe = DiffusionPipeline.from_pretrained(model, dtype=torch.float32)
    pipe.set_progress_bar_config(disable=True)
    for name, value in (pipe_attrs or {}).items():
        setattr(pipe, name, value)
    parallelize(pipe, ParallelConfig(**config), fuse_qkv=fuse_qkv, chunk_tokens=chunk_tokens)
    calls = []
    pipe.transformer.register_forward_pre_hook(lambda module, args: calls.append(1))
    final = {}
    kwargs = dict(call_kwargs(final, steps, height, width, frames, max_sequence_length, guidance_scale), **(extra or {}))
    accepted = inspect.signature(pipe.__call__).parameters
    if "callback_on_step_end" not in accepted:
        del kwargs["callback_on_step_end"]
    if "max_sequence_length" not in accepted:  # HunyuanDiT: its text lengths are the model's
        del kwargs["max_sequence_length"]
    if isinstance(prompt, list):  # ZImagePipeline writes the chat-templated prompts into the list it is given
        prompt = list(prompt)
    with count_collectives() as counts:
        out = pipe(prompt=prompt, **kwargs)
    return final.get("latents", getattr(out, "images", None)), dict(counts), len(calls)


def generate_on(pools, path: str, config: dict, **kwargs) -> list:
    """:func:`pipeline_generate` of the folder ``path`` under ``config`` on every rank of the pool of its world size
    (``pools(n)``), or in this process when ``pools`` is None; a list of per-rank results either way."""
    if pools is None:
        return [pipeline_generate(path, config, **kwargs)]
    return pools(math.prod(config.values())).run(pipeline_generate, path, config, **kwargs)


def call_kwargs(final: dict, steps: int, height: int, width: int, frames: int | None, max_sequence_length: int,
                guidance_scale: float) -> dict:
    """Pipeline-call kwargs of the model tests (seed 42, latents out); the final latents land in ``final``."""

    def grab(p, i, t, kw):
        final["latents"] = kw["latents"].clone()
        return kw

    kwargs = dict(height=height, width=width, num_inference_steps=steps, guidance_scale=guidance_scale,
                  generator=torch.Generator().manual_seed(42), max_sequence_length=max_sequence_length,
                  output_type="latent", callback_on_step_end=grab)
    if frames is not None:
        kwargs["num_frames"] = frames
    return kwargs


def transformer_call(arch: str, config: dict, inputs: dict, model_config: dict | None = None, prepare=None,
                     outputs: int = 1):
    """One call of the synthetic ``arch`` transformer (seed 0) on ``inputs`` under ``config`` on this rank (``{}``:
    one process, not parallelized); ``model_config``: entries written into its config first (what a pipeline sets
    before its calls, e.g. SkyReels-V2's ``num_frame_per_block``); ``prepare``: a module-level function called on the
    model before it is parallelized (a test's hook). Returns (output sample, collectives of the call); with
    ``outputs`` > 1, the first ``outputs`` outputs as a tuple in place of the sample (LTX-2's video and audio)."""
    from ditmesh.synth import build_transformer

    model = build_transformer(arch, seed=0, dtype=torch.float32)
    model.register_to_config(**(model_config or {}))
    if prepare is not None:
        prepare(model)
    out, counts = model_call(model, config, inputs)
    return (out[0] if outputs == 1 else tuple(out[:outputs])), counts


def model_call(model, config: dict, inputs: dict):
    """``model`` parallelized by ``config`` on this rank (``{}``: left as it is), then called on ``inputs``. Returns
    (its whole output, the collectives of the call)."""
    from ditmesh import ParallelConfig, parallelize
    from ditmesh.comm import count_collectives

    if config:
        class Pipe:  # parallelize() needs only `.transformer`
            transformer = model

        parallelize(Pipe, ParallelConfig(**config))
    with torch.no_grad(), count_collectives() as counts:
        out = model(**inputs)
    return out, dict(counts)


def masks_dropped(model: str, mask_input: str, prompt, steps: int, height: int, width: int, max_sequence_length: int,
                  guidance_scale: float | None = 5.0, extra: dict | None = None):
    """One process, not parallelized: the pipeline in folder ``model`` with its transformer's ``mask_input`` replaced by
    None in every call. Returns (the masks the pipeline passed, one per call; the final latents)."""
    from diffusers import DiffusionPipeline

    pipe = DiffusionPipeline.from_pretrained(model, dtype=torch.float32)
    pipe.set_progress_bar_config(disable=True)
    seen = []

    def drop_mask(module, args, kwargs):
        seen.append(kwargs[mask_input])
        return args, dict(kwargs, **{mask_input: None})

    pipe.transformer.register_forward_pre_hook(drop_mask, with_kwargs=True)
    final = {}
    kwargs = call_kwargs(final, steps, height, width, None, max_sequence_length, guidance_scale)
    pipe(prompt=prompt, **{**kwargs, **(extra or {})})
    return seen, final["latents"]


def pipeline_counts(config: dict, steps: int, attention_layers: int, all_reduces_per_call: int,
                    calls_per_step: int = 2) -> dict:
    """The collectives of one pipeline call under ``config`` (a joint-attention image family, true CFG: two calls a
    step): cfg, one all-gather per step (the branches exchanged); dp, one per call (the prompts' outputs); tp,
    ``all_reduces_per_call``; ulysses and ring, 2 all-to-alls and ``ring - 1`` exchange rounds per attention layer and
    one all-gather per call (the output)."""
    calls = calls_per_step * steps
    if "cfg" in config:
        return {"all_gather": steps}
    if "dp" in config:
        return {"all_gather": calls}
    counts = {"all_reduce": all_reduces_per_call * calls} if "tp" in config else {}
    if "ulysses" in config or "ring" in config:
        per_layer = {"all_to_all": 2 if "ulysses" in config else 0, "ring_p2p": config.get("ring", 1) - 1}
        counts.update({kind: n * attention_layers * calls for kind, n in per_layer.items() if n}, all_gather=calls)
    return counts


def refused_call(arch, config: dict, inputs: dict) -> str | None:
    """``transformer_call``'s call, returning the one-line message of the error it raises on this rank (None: none)."""
    try:
        transformer_call(arch, config, inputs)
    except (NotImplementedError, ValueError) as error:
        return str(error)
    return None


def cross_attention_counts(config: dict, self_attentions: int, calls: int, all_reduces: int) -> dict:
    """Collectives of ``calls`` transformer calls of a family whose split tokens attend to themselves in
    ``self_attentions`` layers and to a whole, replicated text otherwise (PixArt-like video and image families):
    ``all_reduces`` per call under tp; per self-attention 2 all-to-alls under Ulysses and ``ring - 1`` exchange rounds
    under ring, the cross-attentions moving nothing; one all-gather per call of the split tokens, and one of the batch
    chunks under cfg or dp."""
    counts = {}
    if config.get("tp", 1) > 1:
        counts["all_reduce"] = all_reduces * calls
    if config.get("ulysses", 1) > 1:
        counts["all_to_all"] = 2 * self_attentions * calls
    if config.get("ring", 1) > 1:
        counts["ring_p2p"] = (config["ring"] - 1) * self_attentions * calls
    gathers = calls if config.get("ulysses", 1) * config.get("ring", 1) > 1 else 0
    gathers += calls if config.get("cfg", 1) * config.get("dp", 1) > 1 else 0
    if gathers:
        counts["all_gather"] = gathers
    return counts


def first_modulated_inputs(path: str, **call) -> tuple[torch.Tensor, torch.Tensor]:
    """One process: the pipeline in folder ``path`` called with ``call``; returns the adapter's ``modulated_input`` of
    the first block at its first call and what that block's ``attn1`` read then (they must be equal)."""
    from diffusers import DiffusionPipeline

    from ditmesh.hooks import bind_kwargs
    from ditmesh.models import adapter_for

    pipe = DiffusionPipeline.from_pretrained(path, dtype=torch.float32)
    pipe.set_progress_bar_config(disable=True)
    block, seen = pipe.transformer.transformer_blocks[0], {}
    modulated_input = adapter_for(pipe.transformer).modulated_input

    def ours(module, args, kwargs):
        seen.setdefault("ours", modulated_input(module, bind_kwargs(module.forward, args, kwargs)))

    def attention_input(module, args, kwargs):
        seen.setdefault("attention", bind_kwargs(module.forward, args, kwargs)["hidden_states"])

    block.register_forward_pre_hook(ours, with_kwargs=True)
    block.attn1.register_forward_pre_hook(attention_input, with_kwargs=True)
    pipe(**call)
    return seen["ours"], seen["attention"]


class FamilyRuns:
    """A family test file's pipeline runs at its ``shapes`` (name -> pipeline sizes): one-process references, computed
    once per folder, shape and prompts, and the same call under a parallel configuration on every rank of a pool."""

    def __init__(self, shapes: dict, steps: int = 2, guidance_scale: float = 3.0, extra: dict | None = None):
        self.shapes, self.steps, self.guidance_scale, self.extra = shapes, steps, guidance_scale, extra
        self._references: dict = {}

    def generate(self, path: str, config: dict, shape: str, prompt=PROMPTS, pools=None) -> list:
        """:func:`generate_on` of the folder ``path`` at ``shape`` with ``prompt``."""
        return generate_on(pools, path, config, steps=self.steps, prompt=prompt, guidance_scale=self.guidance_scale,
                           extra=self.extra, **self.shapes[shape])

    def reference(self, path: str, shape: str, prompt=tuple(PROMPTS)) -> torch.Tensor:
        """The one-process final latents of ``path`` at ``shape``."""
        key = (path, shape, tuple(prompt))
        if key not in self._references:
            self._references[key] = self.generate(path, {}, shape, list(prompt))[0][0]
        return self._references[key]

    def check(self, pools, path: str, config: dict, shape: str, calls: int, counts: dict, prompt=PROMPTS) -> None:
        """Every rank's run under ``config`` against the reference (:func:`check_ranks`); ``prompt`` as a list."""
        ref = self.reference(path, shape, tuple(prompt))
        check_ranks(self.generate(path, config, shape, list(prompt), pools=pools), ref, calls, counts)


def generate_refusal(path: str, *args: str) -> str:
    """``ditmesh generate --model path *args`` (run in this process: its checks refuse before any rank starts),
    which must return exit code 2 with one line on stderr; returns that line."""
    import contextlib
    import io

    from ditmesh.cli import main

    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        code = main(["generate", "--model", path, *args])
    assert code == 2 and len(err.getvalue().strip().splitlines()) == 1, err.getvalue()[-2000:]
    return err.getvalue().strip()


def generate_beside_pipeline(folder, path: str, frames: int, size: int, degrees: dict | None = None, **call) -> tuple:
    """``generate`` of the synthetic video checkpoint ``path`` under ``degrees`` (default ulysses 2; ``frames`` frames
    of ``size`` x ``size``, 2 steps, guidance 4: batched CFG; the step callback's latents saved in ``folder``), and its
    pipeline called in one process at the run's prompt and seed (``call``: more of its arguments). Returns (the saved
    latents, the pipeline's latents)."""
    import json

    import diffusers
    from safetensors.torch import load_file

    from ditmesh.synth import ARCHS

    out, saved = folder / "video.gif", folder / "latents.safetensors"
    degrees = degrees or {"ulysses": 2}
    run_ranks(["generate", "--model", path, "--frames", str(frames), "--height", str(size), "--width", str(size),
               "--steps", "2", "--guidance", "4", "--out", str(out), "--save-latents", str(saved),
               "--nproc", str(math.prod(degrees.values())),
               *(arg for axis, degree in degrees.items() for arg in (f"--{axis}", str(degree)))])
    report = json.loads(out.with_name(out.name + ".json").read_text())
    arch = json.loads((Path(path) / "ditmesh_synth.json").read_text())["arch"]
    pipe = diffusers.DiffusionPipeline.from_pretrained(path, dtype=torch.float32)
    pipe.set_progress_bar_config(disable=True)
    want = pipe(prompt=report["prompt"][0], num_inference_steps=2, guidance_scale=4.0, height=size, width=size,
                num_frames=frames, generator=torch.Generator("cpu").manual_seed(report["seed"]),
                max_sequence_length=ARCHS[arch].max_sequence_length, output_type="latent", **call).frames
    return load_file(str(saved))["latents"], want


def run_ranks(argv: list[str]) -> None:
    """``ditmesh <argv>`` (``generate ... --nproc N``) on the N ranks of the session's gloo pool (N = 1: in this
    process), as the launcher's ranks run it but without starting processes (:func:`run_command`);
    tests/test_cli_launch.py keeps the launcher's own path under test. Asserts exit code 0 on every rank."""
    nproc = int(argv[argv.index("--nproc") + 1]) if "--nproc" in argv else 1
    from ditmesh.shared import strip_option

    argv = strip_option(argv, "--nproc")  # as the launcher strips it for its ranks
    if nproc == 1:
        from ditmesh.cli import main

        assert main(argv) == 0
        return
    from conftest import pool

    pool(nproc).run(run_command, argv)


def run_command(argv: list[str]) -> int:
    """``ditmesh <argv>`` on this rank of a pool (its process group is the run's), as a rank the launcher started
    would run it, without starting processes. Raises on a non-zero exit, so the pool stops the ranks left waiting."""
    from ditmesh import timeline
    from ditmesh.cli import main
    from ditmesh.runtime import generate

    generate.STAY_AFTER_RUN = True  # the worker (and its process group) outlives the command
    timeline._TIMELINE = None  # this command's timeline, not the worker's
    code = main(list(argv))
    if code:
        raise RuntimeError(f"ditmesh {' '.join(argv)} exited with {code}")
    return code
