"""``ditmesh generate`` on one rank: load, parallelize, run, report.

Every rank runs this same function with the same arguments. Rank 0 shows the progress bar and writes
the outputs (image, JSON report, optional latents); every rank contributes its latency and memory.
"""

from __future__ import annotations

import contextlib
import inspect
import io
import itertools
import math
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from ..config import ConfigError, ParallelConfig
from ..options import RunOptions, displaced_refusal, family_allows, pipefusion_refusal, resolved_quant_backend
from ..shared import DTYPE_NAMES, atomic_write_bytes, freeze_heap, write_json
from ..timeline import phase, timeline
from .image import check_image_args, choose_image_pipeline, image_args_given, image_call_kwargs, image_report
from .models import (checkpoint_options, local_model_path, read_adapter, read_defaults, read_family_facts,
                     read_model_json, read_pipeline_class, read_quant_manifest, read_transformer_config, resolve_model,
                     transformer_class)


def validate(args, world_size: int) -> tuple["RunOptions", str]:
    """Check everything that can be checked before any process starts; raises ConfigError with one line. Returns
    the run's options (:class:`~ditmesh.options.RunOptions`, from the command line) and the model to load.

    The checks that need only the arguments come first (:func:`validate_arguments`) and import neither torch nor
    diffusers, so a mistyped value is answered at once; those that read the model's family (heads, frames,
    guidance) come after.
    """
    options, model = validate_arguments(args, world_size)
    validate_family(args, options, model)
    return options, model


def validate_arguments(args, world_size: int) -> tuple["RunOptions", str]:
    """The checks of :func:`validate` that need no model (values, paths, the model's name or folder): torch-free.
    Returns the run's options and the model to load."""
    options = RunOptions.from_args(args)
    config = options.config
    config.check_world_size(world_size)
    check_size(args)
    if args.steps < 1:
        raise ConfigError(f"--steps {args.steps} must be >= 1")
    for flag, value in (("--guidance", args.guidance), ("--true-cfg-scale", args.true_cfg_scale)):
        if not math.isfinite(value):
            raise ConfigError(f"{flag} {value} is not a finite number; give one like 3.5")
    if args.dtype not in DTYPE_NAMES and args.dtype != "auto":
        raise ConfigError(f"--dtype {args.dtype} is not one of: auto, {', '.join(sorted(DTYPE_NAMES))}")
    if args.max_sequence_length is not None and args.max_sequence_length < 1:
        raise ConfigError(f"--max-sequence-length {args.max_sequence_length} must be >= 1 (e.g. 512)")
    check_image_args(args)
    check_output_paths(args)
    model = resolve_model(args.model)
    return checkpoint_options(options, model), model


def validate_heads(options: "RunOptions", model: str) -> None:
    """The transformer's class (:func:`~ditmesh.runtime.models.check_transformer_class`) and the check of the degrees
    that split attention heads (``check_heads``, as :func:`validate_family` runs it), torch-free: the heads from a
    folder's transformer config or the registry's table of synthetic architectures (a hub id's are checked by the
    ranks). The local launcher runs it before starting any rank."""
    from ..models.registry import HEADS, SYNTH

    try:
        name = transformer_class(model)  # no transformer, or one without an adapter: refused before any rank starts
    except ConfigError:
        raise
    except (OSError, ValueError):
        return  # the ranks report an unreadable config with its cause
    if model in SYNTH:
        heads = HEADS.get(model)
    else:
        try:
            tcfg = read_transformer_config(model) or {}  # a folder's JSON (None for a hub id)
        except (OSError, ValueError):
            return  # the ranks report an unreadable config with its cause
        heads, name = tcfg.get("num_attention_heads"), tcfg.get("_class_name", "the transformer")
    if isinstance(heads, int):
        options.config.check_heads(heads, name)


def validate_family_early(args, options: "RunOptions", model: str) -> None:
    """The checks of :func:`validate_family` that need neither torch nor the family's module, run before any rank
    starts (and, in one process, before torch loads): ``--frames`` against the family's frame rule, ``--cfg 2``
    against its CFG switch (both from the registry's :class:`~ditmesh.models.registry.FamilyFacts`), and the
    options' device checks (``--cuda-graph``, ``--attention fp8``, ``--transport symm``) where this machine
    certainly has no CUDA device; a hub id's model index is fetched (no weights), so that an unknown or unreachable
    id is one line naming it."""
    from ..models.registry import ARCHS
    from ..shared import hub_config_folder, no_cuda_here
    from .video import validate_frames

    if model not in ARCHS and not Path(model).is_dir():  # a hub id: its model index (no weights), or one line
        try:
            hub_config_folder(model, ("model_index.json",))
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
    facts = read_family_facts(model)
    if facts is not None and getattr(args, "frames", None) is not None:
        validate_frames(facts, args.frames)
    if options.config.cfg > 1 and facts is not None:
        check_guidance_on(facts, args)
    if no_cuda_here():
        options.validate(device="cpu", cli=True)


def validate_family(args, options: "RunOptions", model: str) -> None:
    """The checks of :func:`validate` that read the model's family (heads, frames, guidance, pipelines, the mode's
    refusals, every option's check in ``options.validate``)."""
    config = options.config
    tcfg = read_transformer_config(model)
    adapter = read_adapter(model)  # ConfigError for a pipeline ditmesh cannot run, before any weight is read
    if getattr(args, "frames", None) is not None:
        from .video import validate_frames

        validate_frames(adapter, args.frames)
    if config.cfg > 1:
        check_guidance_on(adapter, args)
    if adapter is not None and image_args_given(args):
        image_pipeline_class(args, model, adapter, tcfg, config)
    elif adapter is not None:  # a checkpoint whose own pipeline needs an image (ChronoEdit, Framepack, FLUX Fill)
        checkpoint = read_pipeline_class(model)
        own = next((p for p in adapter.image_pipelines if p.pipeline == checkpoint), None)
        if own is not None and (own.mask or needs_argument(checkpoint, "image")):  # not Kontext's: an image optional
            raise ConfigError(f"--model {model}: {checkpoint} generates from an image; give --image PATH"
                              + (" and --mask PATH" if own.mask else ""))
    from ..mesh import default_device

    heads = int(tcfg["num_attention_heads"]) if tcfg and "num_attention_heads" in tcfg else None
    device = default_device()
    try:
        options.validate(device=device, adapters=[adapter] if adapter is not None else [], heads=heads,
                         model_name=(tcfg or {}).get("_class_name", "the transformer"), cli=True)
    except NotImplementedError as exc:  # the family's own refusal, before any rank starts
        raise ConfigError(str(exc)) from None
    from .fit import check_fit

    # the weights against the memory, before any is built (on CPU every rank of this host shares its memory)
    replicas = 1 if getattr(args, "ray", None) else getattr(args, "replicas", 1)  # a Ray replica has a node of its own
    local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", config.world_size)) * replicas
    check_fit(model, options, device, run_dtype(args, device).itemsize, local_ranks)


def ran_options(options: RunOptions, device, world: int) -> dict:
    """The report's ``options``: as given, but the transport and the 8-bit backend as they ran here (``nccl`` names
    the collective path, which is gloo on CPU; ``auto`` is, on CUDA, ditmesh's own layer with ``torch._scaled_mm`` for
    fp8 and torchao for the weight-only modes, and ditmesh's own layer elsewhere)."""
    out = options.as_dict()
    if device.type != "cuda" and out["transport"] == "nccl":
        out["transport"] = "gloo" if world > 1 else None
    if out["quant"] == "off":
        out["quant_backend"] = None
    elif out["quant_backend"] == "auto":
        # ditmesh's own layer off CUDA (the report has always named it so)
        resolved = resolved_quant_backend("auto", out["quant"], device.type)
        out["quant_backend"] = "ditmesh" if resolved == "emulated" else resolved
    return out


def run_dtype(args, device):
    """The dtype a run loads its weights in: ``--dtype``, else bfloat16 on CUDA and float32 elsewhere."""
    import torch

    from ..shared import DTYPES

    return DTYPES.get(args.dtype) or (torch.bfloat16 if device.type == "cuda" else torch.float32)


def check_size(args) -> None:
    """Raise ConfigError unless ``--height`` and ``--width`` (where given) are positive multiples of 16."""
    for name in ("height", "width"):
        value = getattr(args, name)
        if value is not None and (value <= 0 or value % 16):
            raise ConfigError(f"--{name} {value} must be a positive multiple of 16 (e.g. {max(16, (value // 16) * 16 or 16)})")


def needs_argument(pipeline: str, name: str) -> bool:
    """Whether the diffusers pipeline class ``pipeline`` takes ``name`` without a default (ChronoEdit's ``image``)."""
    import diffusers

    parameter = inspect.signature(getattr(diffusers, pipeline).__call__).parameters.get(name)
    return parameter is not None and parameter.default is inspect.Parameter.empty


def image_pipeline_class(args, model: str, adapter=None, transformer_config: dict | None = None,
                         config: ParallelConfig | None = None):
    """The diffusers pipeline class an ``--image`` run loads (``runtime.image``); reads a hub id's configs when the
    family was not known before loading. ``--cfg 2`` needs a pipeline with true CFG (a negative prompt)."""
    import diffusers

    checkpoint = read_pipeline_class(model)
    if adapter is None:  # a hub id: its model index and transformer config (small files) name the family
        from ..models import adapter_for_class

        index = diffusers.DiffusionPipeline.load_config(model)
        checkpoint = index.get("_class_name")
        transformer_class = index["transformer"][1]
        adapter = adapter_for_class(transformer_class)
        transformer_config = getattr(diffusers, transformer_class).load_config(model, subfolder="transformer")
    chosen = choose_image_pipeline(args, adapter, checkpoint, transformer_config)
    if chosen.processor is not None:
        check_image_processor(model, chosen)
    cls = getattr(diffusers, chosen.pipeline)
    if config is not None and config.cfg > 1 and "negative_prompt" not in inspect.signature(cls.__call__).parameters:
        raise ConfigError(f"--cfg {config.cfg}: {chosen.pipeline} has no negative prompt (no true CFG); use --cfg 1")
    return cls


def check_image_processor(model: str, chosen) -> None:
    """Refuse in one line a run whose checkpoint cannot put the image in the prompt: a folder whose ``processor`` is not
    the class ``chosen`` (an ImagePipeline) reads the image through (a synthetic one written where torchvision does not
    import holds a tokenizer there), or an architecture's name where torchvision does not import (the processor it
    would build needs it)."""
    from ..models.base import torchvision_error
    from ..models.registry import ARCHS

    why = f"--image: {chosen.pipeline} puts the image in the prompt through a {chosen.processor}"
    if model in ARCHS:
        error = torchvision_error()
        if error is not None:
            raise ConfigError(f"{why}, whose video processor needs torchvision, and torchvision does not import here "
                              f"({error}): pip install torchvision (the release built for your torch)")
        return
    index = Path(model) / "model_index.json"
    entry = read_model_json(index).get("processor") if index.is_file() else None
    if entry and entry[-1] != chosen.processor:
        raise ConfigError(f"{why}, and --model {model} holds a {entry[-1]} in its place; give a checkpoint with one "
                          "(ditmesh synth writes it where torchvision imports)")


IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".webp", ".bmp", ".tif", ".tiff")
VIDEO_SUFFIXES = (".mp4", ".gif", ".png")
AUDIO_SUFFIXES = (".wav",)  # the audio pipelines' (Stable Audio); runtime/audio.py


def check_output_paths(args) -> None:
    """Output paths must be writable files of a known kind, so a finished run never fails at the end."""
    out = getattr(args, "out", None)
    if out is not None:
        video = getattr(args, "frames", None) is not None
        allowed = VIDEO_SUFFIXES if video else IMAGE_SUFFIXES + AUDIO_SUFFIXES
        if Path(out).suffix.lower() not in allowed:
            kind = "video" if video else "image or audio"
            raise ConfigError(f"--out {out}: unknown {kind} format; use one of {', '.join(allowed)}")
    for flag, value in (("--out", out), ("--report", getattr(args, "report", None)),
                        ("--save-latents", getattr(args, "save_latents", None)), ("--trace", getattr(args, "trace", None))):
        if value is None:
            continue
        if Path(value).is_dir():
            raise ConfigError(f"{flag} {value} is a folder; give a file path, e.g. {Path(value) / 'result'}")
        why = unwritable(Path(value))
        if why:
            raise ConfigError(f"{flag} {value}: cannot write there ({why}); give a path in a folder you can write")


def unwritable(path: Path) -> str | None:
    """Why ``path`` could not be written (a probe file is created and removed in its nearest existing folder),
    or None when it can. Nothing is left behind."""
    import tempfile

    folder = path.parent
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    if not folder.is_dir():
        return f"{folder} is not a folder"
    if path.exists() and not os.access(path, os.W_OK):
        return "the file is read-only"
    try:
        with tempfile.NamedTemporaryFile(dir=folder, prefix=".ditmesh-probe-"):
            pass
    except OSError as exc:
        return exc.strerror or type(exc).__name__
    return None


def default_report_path(out: Path) -> str:
    """The report next to the output, named after all of it (``cat.gif`` -> ``cat.gif.json``), so outputs of
    one stem in two formats keep their own reports."""
    return str(out.with_name(out.name + ".json"))


def guidance_on(adapter, args) -> bool:
    """Whether the run has both CFG branches, by the family's rule (``ModelAdapter.cfg_on``; guidance > 1 when
    the family is not known before loading)."""
    if adapter is None:
        return args.guidance > 1
    return adapter.cfg_on(args.guidance, args.true_cfg_scale, args.negative_prompt)


def check_guidance_on(adapter, args) -> None:
    """``--cfg 2`` needs both CFG branches; say what to change when guidance is off."""
    if guidance_on(adapter, args):
        return
    hint = adapter.cfg_hint if adapter is not None else "--guidance > 1 (e.g. --guidance 5)"
    raise ConfigError(f"--cfg 2 needs classifier-free guidance, which this run turns off; turn it on with {hint}, "
                      "or use --cfg 1")


def apply_auto_plan(args, world_size: int) -> ParallelConfig:
    """``--plan auto``: set the degree options of ``args`` to the planner's choice for ``world_size`` processes
    (said on stderr) and return it."""
    chosen = planned_setting(args, world_size)
    config = chosen.config
    print(f"ditmesh: --plan auto picked {chosen.describe()} for {world_size} process(es)", file=sys.stderr)
    for axis, degree in config.degrees().items():
        setattr(args, axis, degree)
    args.displaced = chosen.displaced
    return config


def planned_config(args, world_size: int) -> ParallelConfig:
    """The degrees of :func:`planned_setting`."""
    return planned_setting(args, world_size).config


def planned_setting(args, world_size: int):
    """The planner's prediction of the configuration it recommends for this run (its ``displaced``: with displaced
    attention), restricted to what this build implements and to configurations predicted to fit in memory with the
    run's ``--chunk``, ``--vae-parallel`` and ``--vae-chunk`` (a ConfigError naming the largest size that fits
    otherwise). Approximate modes (PipeFusion, displaced attention) only with ``--allow-stale``."""
    from ..config import AXIS_ORDER
    from ..planner import PlannerError, recommend_prediction

    if any(getattr(args, a) != 1 for a in ("dp", "cfg", "pp", "ring", "ulysses", "tp")):
        raise ConfigError("--plan auto picks the degrees itself; leave --dp --cfg --pp --ring --ulysses --tp at 1")
    model = resolve_model(args.model)
    if model not in _archs() and not Path(model).is_dir():
        raise ConfigError(f"--plan auto needs a local pipeline folder or a synthetic architecture, not the hub id "
                          f"{model}; download it first or give the degrees yourself")
    # PipeFusion after its warm-up is approximate (one-step-stale K/V): picked only when the user allows it
    stale = getattr(args, "allow_stale", False)
    adapter = read_adapter(model)
    pp_runs, displaced_runs = stale, stale
    if stale and adapter is not None:  # the family's own refusals: never plan what parallelize would refuse
        pp_runs = family_allows(pipefusion_refusal, adapter)
        displaced_runs = family_allows(displaced_refusal, adapter)
    supported = set(AXIS_ORDER) - (set() if pp_runs else {"pp"})
    if adapter is not None and adapter.ring_refusal:  # Kandinsky 6 SR's NABLA: ulysses only
        supported.discard("ring")
    defaults = read_defaults(model)
    size = defaults.get("default_size") or [1024, 1024]
    cfg_on = guidance_on(adapter, args)
    prompts = len(args.prompt) if args.prompt else 1
    options = RunOptions.from_args(args)
    try:
        return recommend_prediction(model, args.height or size[0], args.width or size[1], world_size,
                                    displaced=displaced_runs, frames=getattr(args, "frames", None) or 1, cfg=cfg_on,
                                    batch=prompts * getattr(args, "images_per_prompt", 1), supported=supported,
                                    require_fit=True, options=options)
    except PlannerError as exc:
        raise ConfigError(f"--plan auto: {exc}") from None


def _archs():
    from ..models.registry import ARCHS

    return ARCHS


class Rendezvous:
    """The process group's start (:func:`_init_distributed`) in a thread of its own, so that a rank loads its
    weights while the others finish their imports: every rank's first collective calls :meth:`join` (the load's
    gather of a synthesized folder, ``parallelize``'s mesh), which waits for it and raises what it raised."""

    def __init__(self, device):
        import threading

        import torch

        if device.type == "cuda":
            torch.cuda.set_device(device)  # this thread's device (the current device is a thread's own)
        self.error: BaseException | None = None
        self.thread = None
        if int(os.environ.get("WORLD_SIZE", "1")) > 1:
            self.thread = threading.Thread(target=self._run, args=(device, timeline().now()), name="ditmesh-rendezvous",
                                           daemon=True)
            self.thread.start()

    def _run(self, device, start: float) -> None:
        try:
            _init_distributed(device)
        except BaseException as exc:  # noqa: BLE001 (raised again by join, in the rank's own thread)
            self.error = exc
        finally:  # beside the main thread's phases, on a row of its own
            timeline().add("rendezvous", start, timeline().now(), depth=0, tid=1)

    def validate(self, args, world: int):
        """:func:`validate` while the group starts; a refusal (every rank finds it alike) is raised once the group
        has met."""
        try:
            return validate(args, world)
        except ConfigError:
            self.join()
            raise

    def join(self) -> None:
        if self.thread is not None:
            self.thread.join()
            self.thread = None
        if self.error is not None:
            raise self.error


def _init_distributed(device) -> None:
    import torch
    import torch.distributed as dist

    world = int(os.environ.get("WORLD_SIZE", "1"))
    if device.type == "cuda":
        torch.cuda.set_device(device)  # also for one process: memory statistics need the device set
    if world > 1 and not dist.is_initialized():
        from .launch import rank_store

        backend = "nccl" if device.type == "cuda" else "gloo"
        store = rank_store()  # the local launcher's run: rank 0 binds the store; else MASTER_ADDR/PORT (torchrun)
        extra = {} if store is None else {"store": store, "rank": int(os.environ["RANK"]), "world_size": world}
        dist.init_process_group(backend, device_id=device if device.type == "cuda" else None, **extra)


def _sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _call_kwargs(pipe, args, defaults: dict) -> dict:
    """Keyword arguments for ``pipe(...)`` from the CLI options, keeping only those the pipeline accepts."""
    import torch

    size = defaults.get("default_size") or [None, None]
    kwargs = dict(
        # a copy: ZImagePipeline writes its chat-templated prompts into the list it is given
        prompt=list(args.prompt) if len(args.prompt) > 1 else args.prompt[0],
        height=args.height or size[0],
        width=args.width or size[1],
        num_inference_steps=args.steps,
        guidance_scale=args.guidance,
        max_sequence_length=args.max_sequence_length or defaults.get("max_sequence_length"),
        generator=torch.Generator("cpu").manual_seed(args.seed),
        num_images_per_prompt=getattr(args, "images_per_prompt", 1),
        num_frames=getattr(args, "frames", None) or defaults.get("default_frames"),  # video pipelines only
        # PixArt, Sana and HunyuanDiT would otherwise draw the nearest of their trained sizes and resize the picture
        # to the one asked: the size asked is the size computed
        use_resolution_binning=False,
    )
    if args.negative_prompt is not None:
        kwargs["negative_prompt"] = args.negative_prompt
        kwargs["true_cfg_scale"] = args.true_cfg_scale
    if image_args_given(args):
        kwargs.update(image_call_kwargs(args, kwargs["height"], kwargs["width"]))
    accepted = inspect.signature(pipe.__call__).parameters
    if "num_frames" not in accepted and "frames" in accepted:  # SanaVideoPipeline names its frame count `frames`
        kwargs["frames"] = kwargs.pop("num_frames")
    kwargs = {k: v for k, v in kwargs.items() if v is not None}
    from ..api import transformers_of
    from ..models import adapter_for

    models = list(transformers_of(pipe).values())
    adapter = adapter_for(models[0]) if models else None
    if adapter is not None and adapter.call_arguments is not None:  # what the options do not name (DiT's classes)
        kwargs = adapter.call_arguments(pipe, kwargs)
    return {k: v for k, v in kwargs.items() if k in accepted}


@contextlib.contextmanager
def step_callback(pipe, on_step_end):
    """Pipeline-call kwargs that run ``on_step_end(pipe, i, t, {"latents": latents, ...})`` after every denoising step:
    ``callback_on_step_end`` where the pipeline takes it, else the older ``callback(i, t, latents)`` on every step
    (``callback_steps=1``; PixArt's pipelines). A pipeline that takes neither (HunyuanVideo15Pipeline) gets none: its
    scheduler's ``step`` ends each denoising step, and while the call runs (the context) a wrapper on that instance
    calls ``on_step_end`` with the step's output as the latents, then leaves."""
    accepted = inspect.signature(pipe.__call__).parameters
    if "callback_on_step_end" in accepted:
        yield {"callback_on_step_end": on_step_end}
    elif "callback" in accepted:
        yield {"callback": lambda i, t, latents: on_step_end(pipe, i, t, {"latents": latents}), "callback_steps": 1}
    else:
        scheduler, index = pipe.scheduler, itertools.count()

        def step(*args, **kwargs):
            out = type(scheduler).step(scheduler, *args, **kwargs)
            on_step_end(pipe, next(index), args[1] if len(args) > 1 else kwargs.get("timestep"),
                        {"latents": out[0] if isinstance(out, tuple) else out.prev_sample})
            return out

        scheduler.step = step
        try:
            yield {}
        finally:
            del scheduler.step


@dataclass
class LoadedPipeline:
    """A pipeline loaded on one rank and parallelized, with its LoRAs: what :func:`load_pipeline` returns."""

    pipe: object
    runtime: object  # what ``parallelize`` returned: the mesh, the caches, what was applied
    path: str  # the local folder (or hub id) it was loaded from
    dtype: object
    loras: list  # (path, scale) of each ``--lora``
    load_s: float


def load_pipeline(args, options: RunOptions, model: str, device, rank: int, world: int,
                  rendezvous: Rendezvous | None = None) -> LoadedPipeline:
    """Load ``model`` on this rank and parallelize it as ``options`` say, with their LoRA adapters (with
    ``fuse_lora``, fused into the weights and unloaded: ``parallel.lora.fuse``).

    Every rank calls it alike: rank 0 synthesizes a named architecture once and the others learn its folder
    through one gather, and ``parallelize`` builds the mesh (collectives on every rank, in this order). A folder's
    weights are read before the process group is needed: ``rendezvous`` (still starting) is joined first then.
    """
    from ..models.registry import SYNTH

    join = rendezvous.join if rendezvous is not None else (lambda: None)
    synthetic = model in SYNTH
    import torch
    from diffusers import DiffusionPipeline

    from ..api import parallelize
    from ..comm import all_gather_object
    from ..models import adapter_for
    config = options.config
    dtype = run_dtype(args, device)
    meanwhile = COMPILE_IMPORTS if options.compile else ()  # imported while the weights are copied to the device
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    t_load = time.perf_counter()
    path = local_model_path(model) if rank == 0 or not synthetic else None
    if world > 1 and synthetic:
        join()
        path = all_gather_object(path)[0]  # rank 0 synthesizes a named architecture once
    pipeline_class = (image_pipeline_class(args, path, read_adapter(path), read_transformer_config(path), config)
                      if image_args_given(args) else DiffusionPipeline)
    if read_quant_manifest(path) is not None:
        # written by `ditmesh quantize`: the 8-bit weights are read as stored (a tp rank its slices only)
        from ..parallel.quant import load_quantized_transformer

        names = transformer_components(path)
        pipe = _load_to(device, lambda: pipeline_class.from_pretrained(path, dtype=dtype, **dict.fromkeys(names)),
                       meanwhile)
        with phase("load quantized transformer"):
            pipe.register_modules(**{name: load_quantized_transformer(path, name, device, dtype, rank % config.tp,
                                                                      config.tp) for name in names})
    elif config.tp > 1:
        # Each rank materialises only its tensor-parallel shard of the transformer (tp is the innermost mesh axis).
        from ..parallel.tensor import load_sharded_transformer

        names = transformer_components(path)
        pipe = _load_to(device, lambda: pipeline_class.from_pretrained(path, dtype=dtype, **dict.fromkeys(names)),
                       meanwhile)
        with phase("load sharded transformer"):
            pipe.register_modules(**{name: load_sharded_transformer(path, rank % config.tp, config.tp, device, dtype,
                                                                    name) for name in names})
    elif config.pp > 1:
        # Each rank reads only its PipeFusion stage's block weights.
        from ..parallel.pipefusion import load_stage_transformer

        names = transformer_components(path)
        pipe = _load_to(device, lambda: pipeline_class.from_pretrained(path, dtype=dtype, **dict.fromkeys(names)),
                       meanwhile)
        stage = config.coordinate(rank, "pp")
        with phase("load stage transformer"):
            pipe.register_modules(**{name: load_stage_transformer(path, stage, config.pp, device, dtype, name)
                                     for name in names})
    else:
        pipe = _load_to(device, lambda: pipeline_class.from_pretrained(path, dtype=dtype), meanwhile)
    adapter = adapter_for(pipe.transformer)
    if adapter.vae_tiled_only:  # its VAE has no other decode (Allegro's)
        pipe.vae.enable_tiling()
    if adapter.pipeline_setup is not None:  # what its pipeline expects of the environment (WanVACEPipeline's ftfy)
        adapter.pipeline_setup()
    join()
    with phase("parallelize"):
        runtime = parallelize(pipe, options, device=device)  # loads the LoRAs last (fused with options.fuse_lora)
    loras = [(lora.path, lora.scale) for lora in options.loras]
    return LoadedPipeline(pipe, runtime, path, dtype, loras, time.perf_counter() - t_load)


#: what torch.compile imports on its first call (its backend, inductor, and dynamo's debugging hooks): about 1 s of the
#: first compiled step on the 2-core machine, imported instead while the weights are copied to the device
COMPILE_IMPORTS = ("torch._inductor.compile_fx", "torch._dynamo.repro.after_dynamo", "torch._inductor.fx_passes.post_grad",
                   "torch._inductor.fx_passes.joint_graph", "torch._inductor.async_compile")


def _load_to(device, load, meanwhile: tuple[str, ...] = ()):
    """``load()`` (a ``from_pretrained``), each component it loads a phase of the timeline, then moved to ``device``
    while a thread imports the modules ``meanwhile`` (a copy to the device lets go of the interpreter's lock; the
    copy imports nothing, so the two never wait for one module)."""
    from .trace import timed_component_loading

    with phase("load components"), timed_component_loading():
        pipe = load()
    with phase("to device"), imported_meanwhile(meanwhile, device):
        return pipe.to(device)


@contextlib.contextmanager
def imported_meanwhile(modules: tuple[str, ...], device=None):
    """Import ``modules`` in a thread while the block runs (a phase ``imports meanwhile`` on a row of its own); wait
    for it at the block's end. A module that fails to import is left to whoever needs it (who then meets the
    error). The thread's CUDA device is ``device`` (a thread starts on device 0: what an import touched there would
    open a context on another rank's GPU)."""
    if not modules:
        yield
        return
    import importlib
    import threading

    def run(start: float) -> None:
        if device is not None and device.type == "cuda":
            import torch

            torch.cuda.set_device(device)
        for name in modules:
            try:
                importlib.import_module(name)
            except Exception:  # noqa: BLE001  (imported again, and its error raised, where it is needed)
                pass
        timeline().add("imports meanwhile", start, timeline().now(), depth=0, tid=2)

    thread = threading.Thread(target=run, args=(timeline().now(),), name="ditmesh-imports", daemon=True)
    thread.start()
    try:
        yield
    finally:
        thread.join()


def run(args) -> int:
    """Run one rank of ``ditmesh generate``; returns the exit code."""
    from PIL import Image

    from ..comm import all_gather_object
    from ..mesh import default_device
    from .report import device_name, peak_memory_bytes, versions

    device = default_device()
    rendezvous = Rendezvous(device)  # the process group starts while this rank checks and reads its weights
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    with phase("checks"):
        options, model = rendezvous.validate(args, world)
    config = options.config
    cpu = None
    if device.type == "cpu":  # what the CPU timing ran against: threads per rank, cores, the load before the run
        import torch

        from ..shared import cpu_load

        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))
        cpu = {"threads_per_rank": torch.get_num_threads(), **cpu_load(torch.get_num_threads() * local_world)}
    if rank != 0:
        import diffusers

        diffusers.utils.logging.disable_progress_bar()  # one loading bar, on rank 0
    with phase("load"):
        loaded = load_pipeline(args, options, model, device, rank, world, rendezvous)
        pipe, runtime, path, dtype, loras, load_s = (loaded.pipe, loaded.runtime, loaded.path, loaded.dtype,
                                                     loaded.loras, loaded.load_s)
        # the ranks meet here: a rank that loaded first waits for the slowest inside its load
        load_peaks = all_gather_object(peak_memory_bytes(device))
        placement = all_gather_object(rank_placement(rank, runtime.mesh.coords()))
    if not STAY_AFTER_RUN:  # the loaded pipeline lives to the end: the first step's full collections skip it
        freeze_heap()
    defaults = read_defaults(path)
    pipe.set_progress_bar_config(disable=rank != 0, desc=f"denoising ({config.describe()}, {world} proc)")

    marks: list[float] = []
    final: dict = {}

    def on_step_end(p, i, t, kw):
        _sync(device)
        marks.append(time.perf_counter())
        phases.step_end(marks[-1])  # the same reading: the trace's steps are the report's
        # the last step's latents are the result; a run that starts part-way (--strength) has fewer steps than
        # --steps, so every step's are kept (a reference: each step makes a new tensor) and the last one is saved
        final["latents"] = kw["latents"]
        return kw

    call = _call_kwargs(pipe, args, defaults)
    if getattr(args, "warmup_only", False):
        return warm_up(pipe, call, config, world, rank, device, load_s, getattr(args, "compile", False))
    _sync(device)
    from ..api import transformers_of
    from .trace import CallPhases

    phases = CallPhases(pipe, transformers_of(pipe), lambda: _sync(device), first_step_name(args))
    # what a pipeline draws from torch's global generator (JoyImageEditPipeline samples its reference image's latents
    # with none given) is drawn alike on every rank, and in every run: it is seeded from --seed, as the call's is
    import torch

    torch.manual_seed(args.seed)
    t0 = time.perf_counter()
    with phases:
        with step_callback(pipe, on_step_end) as callback:
            result = pipe(**call, **callback)
        _sync(device)
    total_s = time.perf_counter() - t0
    step_s = [b - a for a, b in zip([t0] + marks[:-1], marks)]
    with phase("gather statistics"):
        peaks = all_gather_object(peak_memory_bytes(device))
        devices = all_gather_object(device_name(device))
    timelines = all_gather_object(timeline().as_dict(rank))  # rank 0 adds its writing phases to its own below
    warmup_costs = compile_breakdown(runtime) if getattr(args, "compile", False) or getattr(args, "cuda_graph", False) else None

    if rank == 0:
        # a batch of videos (``frames``), one video unbatched (SanaWMPipeline's ``frames``: [T, H, W, C]), or one
        # video (``video``: a pipeline whose output holds its one sample, Cosmos 3 Omni's)
        videos = result.frames if hasattr(result, "frames") else [result.video] if hasattr(result, "video") else None
        if getattr(videos, "ndim", None) == 4:
            videos = [videos]
        is_video = videos is not None and not hasattr(result, "images")
        is_audio = hasattr(result, "audios") and not hasattr(result, "images")  # Stable Audio's AudioPipelineOutput
        out = Path(args.out or ("out/video.mp4" if is_video else "out/audio.wav" if is_audio else "out/image.png"))
        images = [] if is_video or is_audio else result.images
        paths = []
        if is_audio:
            from .audio import sampling_rate, write_audios

            with phase("write audio"):
                paths += write_audios(out, result.audios, sampling_rate(pipe))
        if is_video:
            from .video import write_video

            from ..models import adapter_for

            fps = adapter_for(next(iter(transformers_of(pipe).values()))).fps
            with phase("write videos"):
                for i, video in enumerate(videos):
                    target = out if len(videos) == 1 else out.with_name(f"{out.stem}_{i}{out.suffix}")
                    paths += write_video(target, video, fps=fps)
        encoded = []  # encode everything first: a format error must not leave some files written
        from .. import png

        with phase("encode images"):
            for i, image in enumerate(images):
                p = out if len(images) == 1 else out.with_name(f"{out.stem}_{i}{out.suffix}")
                fmt = Image.registered_extensions().get(p.suffix.lower(), "PNG")
                if fmt == "PNG":
                    encoded.append((p, png.encode(image)))
                    continue
                buf = io.BytesIO()
                image.save(buf, format=fmt)
                encoded.append((p, buf.getvalue()))
        with phase("write outputs"):
            for p, data in encoded:
                atomic_write_bytes(p, data)
                paths.append(str(p))
            if args.save_latents:
                from safetensors.torch import save as st_save

                atomic_write_bytes(args.save_latents,
                                   st_save({"latents": final["latents"].detach().float().cpu().contiguous()}))
        timelines[0] = timeline().as_dict(0)
        report = {
            "model": model,
            "config": config.as_dict(),
            "options": ran_options(options, device, world),
            "world_size": world,
            "devices": devices,
            "cpu": cpu,  # CPU runs: threads_per_rank, cores, load_1min before the run, threads, warning
            "dtype": str(dtype).replace("torch.", ""),
            "height": call.get("height"),
            "width": call.get("width"),
            "frames": call.get("num_frames"),
            "steps": args.steps,
            "guidance": args.guidance,
            "negative_prompt": args.negative_prompt,
            "true_cfg_scale": args.true_cfg_scale if args.negative_prompt is not None else None,
            "prompt": args.prompt,
            "seed": args.seed,
            "loras": [{"path": path, "scale": scale} for path, scale in loras],
            # --fuse-lora: the adapters were fused into the weights and peft's layers taken out
            "lora_fused": bool(loras) and getattr(args, "fuse_lora", False),
            # the pipeline class that ran, and for --image runs the condition files and the strength used
            **image_report(args, pipe, call),
            "versions": versions(),
            "load_s": round(load_s, 4),
            "load_peak_memory_bytes": load_peaks,
            "placement": placement,
            "step_latency_s": [round(s, 6) for s in step_s],
            # what the first step paid beyond a steady one: compilation, CUDA graph capture, first collectives
            # against the median later step (of 2 steps, the second: a median over both would be the first's own)
            "first_step_extra_s": round(step_s[0] - sorted(step_s[1:])[(len(step_s) - 1) // 2], 4)
            if len(step_s) > 1 else None,
            "compile_breakdown_s": warmup_costs,
            "compile_artifacts": artifact_stats() if getattr(args, "compile", False) else None,
            "cache": {name: {"setting": getattr(args, "cache", None), "calls": len(c.history),
                             "skipped": sum(h["skip"] for h in c.history)} for name, c in runtime.caches.items()},
            # whether the VAE ran split along height over the ranks (``--vae-parallel``)
            "vae_parallel": {"mode": getattr(args, "vae_parallel", "auto"),
                             "split": any(name.startswith("vae(") for name in runtime.applied)},
            # feed-forwards run on pieces of the sequence (``--chunk``): the setting, and whether it applied
            "chunk": {"setting": getattr(args, "chunk", None),
                      "applied": any(name.startswith("chunk(") for name in runtime.applied)},
            # the VAE's residual blocks and up-samplers run on pieces of rows (``--vae-chunk``)
            "vae_chunk": {"setting": getattr(args, "vae_chunk", None),
                          "applied": any(name.startswith("vae_chunk(") for name in runtime.applied)},
            # PipeFusion (``--pp``): its patches and exact warm-up steps (the steps after them are approximate)
            "pipefusion": ({"patches": getattr(args, "pp_patches", None) or config.pp,
                            "warmup": getattr(args, "pp_warmup", 1)} if config.pp > 1 else None),
            # displaced attention (``--displaced``): its exact warm-up steps (the steps after them are approximate)
            "displaced": ({"warmup": getattr(args, "displaced_warmup", 1)} if getattr(args, "displaced", False)
                          else None),
            "total_latency_s": round(total_s, 6),
            "peak_memory_bytes": peaks,
            "outputs": paths,
            # per rank: its phases in seconds after the command started (ditmesh.timeline); rank 0's up to the report
            "timeline": timelines,
        }
        report_path = args.report or default_report_path(out)
        with phase("write report"):
            write_json(report_path, report)
        if getattr(args, "trace", None):
            from .trace import write_trace

            timelines[0] = timeline().as_dict(0)
            write_trace(args.trace, timelines)
        written = [*paths, report_path] + ([args.trace] if getattr(args, "trace", None) else [])
        busy = (f"; a busy machine (1-minute load {cpu['load_1min']:.1f} on {cpu['cores']} cores): the time measures "
                "the contention more than the run" if cpu and cpu["warning"] else "")
        layout = config.describe() + (" with displaced attention" if options.displaced else "")
        from ..models.registry import SYNTH

        noise = ("; random weights (a synthetic architecture): the output is noise by design, its time and memory "
                 "are the real model's" if model in SYNTH or Path(model, "ditmesh_synth.json").is_file() else "")
        print(f"ditmesh: wrote {', '.join(written[:-1])} and {written[-1]} "
              f"({total_s:.2f} s, {world} process{'es' if world > 1 else ''}, {layout}{busy}{noise})", flush=True)
    finish_rank()
    return 0


#: where compiled kernels and graphs are kept between runs, under ``$DITMESH_CACHE`` (``~/.cache/ditmesh``)
COMPILE_CACHE_ENV = {"TORCHINDUCTOR_CACHE_DIR": "inductor", "TRITON_CACHE_DIR": "triton"}


def persist_compile_caches() -> dict:
    """Keep torch.compile's caches (inductor's FX graphs and AOT autograd results, triton kernels) in
    ``$DITMESH_CACHE/compile`` so that a later run of the same shape and configuration loads them instead of
    compiling. Variables the user set are left alone. Returns the folders used."""
    from .models import cache_dir

    used = {}
    for env, name in COMPILE_CACHE_ENV.items():
        if env not in os.environ:
            os.environ[env] = str(cache_dir() / "compile" / name)
        used[env] = os.environ[env]
    return used


def first_step_name(args) -> str:
    """The first step's phase name: what it pays beyond a steady step (compile, CUDA graph capture)."""
    paid = [what for flag, what in (("compile", "compile"), ("cuda_graph", "capture")) if getattr(args, flag, False)]
    return f"step 0 ({' + '.join(paid)})" if paid else "step 0"


def warm_up(pipe, call: dict, config, world: int, rank: int, device, load_s: float, compiled: bool) -> int:
    """``generate --warmup-only``: one denoising step at the run's shape fills the compile caches (and opens the
    collectives); nothing is written but the caches. Returns 0."""
    first_step_s = warm_up_call(pipe, call, device)
    if rank == 0:
        caches = ", ".join(os.environ[e] for e in COMPILE_CACHE_ENV) if compiled else ""
        saved = artifact_stats()["saved"] if compiled else []
        if saved:
            caches += "; compiled blocks saved: " + ", ".join(f"{name} ({s:.1f} s)" for name, s in saved)
        print(f"ditmesh: warmed up {config.describe()} on {world} process{'es' if world > 1 else ''} at "
              f"{call.get('height')}x{call.get('width')} (load {load_s:.1f} s, first step {first_step_s:.1f} s)"
              + (f"; caches in {caches}" if caches else ""), flush=True)
    finish_rank()
    return 0


def warm_up_call(pipe, call: dict, device, decode: bool = False) -> float:
    """One denoising step of ``call`` (latents out, no decode; ``decode``: decoded as ``call`` asks): compiles this
    shape and opens the collectives. Every rank calls it alike. Returns its seconds."""
    _sync(device)
    start = time.perf_counter()
    pipe(**dict(call, num_inference_steps=1, **({} if decode else {"output_type": "latent"})))
    _sync(device)
    return time.perf_counter() - start


def artifact_stats() -> dict:
    """This rank's compiled blocks kept between processes (``ditmesh.aot``): the classes loaded and saved (seconds)
    and those that fell back to the ordinary compile (why)."""
    from ..aot import STATS

    return {k: [[name, round(v, 3) if isinstance(v, float) else v] for name, v in entries]
            for k, entries in STATS.items()}


def compile_breakdown(runtime) -> dict:
    """Where this rank's one-time costs went (seconds, host time): torch.compile's phases (dynamo total, of it
    bytecode tracing and the backend, i.e. AOT autograd and inductor, cache hits included) and CUDA graph capture."""
    from torch._dynamo.utils import compile_times

    from ..hooks import find_hook

    names, values = compile_times(repr="csv", aggregate=True)
    phases = dict(zip(names, (float(v) for v in values)))
    graphs = [find_hook(m, "graph") for m in runtime.transformers.values()]
    capture = sum(e.capture_s for g in graphs if g is not None for e in g.graphed.entries.values())
    return {"dynamo": round(phases.get("_compile.compile_inner", 0.0), 3),
            "bytecode_tracing": round(phases.get("bytecode_tracing", 0.0), 3),
            "backend": round(phases.get("OutputGraph.call_user_compiler", 0.0), 3),
            "cuda_graph_capture": round(capture, 3)}


def rank_placement(rank: int, coords: dict) -> dict:
    """Where this rank runs: its host (torchrun's node rank and the host name), local rank, device and mesh
    coordinates. Ranks of one inner group (tp, ulysses) must share a host."""
    import socket

    return {"rank": rank, "node": int(os.environ.get("GROUP_RANK", 0)), "host": socket.gethostname(),
            "local_rank": int(os.environ.get("LOCAL_RANK", 0)), "coords": coords}


def transformer_components(path: str) -> list[str]:
    """The transformer components a pipeline folder (or hub id) has: ``transformer`` and any set ``transformer_*``."""
    index = Path(path) / "model_index.json"
    if not index.is_file():
        return ["transformer"]
    entries = read_model_json(index)
    return [name for name, value in sorted(entries.items())
            if name.startswith("transformer") and isinstance(value, list) and value[0] is not None]


#: set by the test suite's ``run_command`` (tests/cases_models.py): the command runs on a rank of a long-lived worker
#: pool, whose process (and process group) outlives it
STAY_AFTER_RUN = False


def finish_rank() -> None:
    """The end of every rank of a launched command: meet the others after the last collective, then leave (see
    :func:`end_rank_process`); nothing to do for one process."""
    import torch.distributed as dist

    if dist.is_initialized():
        dist.barrier()
        if not STAY_AFTER_RUN:
            end_rank_process(0)


def end_rank_process(code: int) -> None:
    """End a rank process right after its last collective.

    Destroying a gloo process group while its worker threads wind down can abort the interpreter
    ("terminate called without an active exception") and fail a finished run; all outputs are written
    and flushed by now, so the process leaves without running C++ destructors.
    """
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
