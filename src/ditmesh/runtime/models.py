"""Resolving ``--model``: a pipeline folder, a synthetic architecture name, a hub id, or the embedded default."""

from __future__ import annotations

import json
from pathlib import Path

from ..config import ConfigError, cache_dir
from ..options import modulation_flag


def default_model() -> str:
    """The model used when ``--model`` is omitted: the shipped tiny trained pipeline, else synthetic flux-tiny."""
    try:
        from ..tiny import default_model_path

        path = default_model_path()
        if path and (Path(path) / "model_index.json").is_file():
            return str(path)
    except ImportError:
        pass
    return "flux-tiny"


def synthesized_path(arch_name: str, seed: int = 0) -> Path:
    """Where :func:`synthesize_cached` keeps the checkpoint of ``arch_name`` (written or not)."""
    return cache_dir() / f"{arch_name}-seed{seed}"


def synthesize_cached(arch_name: str, seed: int = 0) -> str:
    """Path of the cached synthetic checkpoint of ``arch_name``, writing it on first use.

    Safe when several ranks call it at once: the checkpoint is written to a temporary folder and renamed.
    """
    from ..synth import write_checkpoint

    path = synthesized_path(arch_name, seed)
    if (path / "model_index.json").is_file():
        return str(path)
    try:
        write_checkpoint(arch_name, path, seed=seed)
    except (FileExistsError, OSError):
        if not (path / "model_index.json").is_file():
            raise
    return str(path)


def resolve_model(model: str | None) -> str:
    """Turn the user's ``--model`` into something ``from_pretrained`` loads; raises ConfigError if it can't be
    (:func:`ditmesh.shared.model_source` says what a value names)."""
    from ..shared import model_source

    model = model or default_model()
    try:
        kind = model_source(model, _arch_names)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    if kind == "folder":
        return str(Path(model).expanduser())
    return model  # an architecture is synthesized lazily by local_model_path, once per machine; a hub id as given


def _arch_names():
    from ..models.registry import ARCHS  # the names alone: no family, no torch

    return ARCHS


def local_model_path(model: str) -> str:
    """Folder (or hub id) to load: synthesizes an architecture name into the cache."""
    from ..models.registry import ARCHS

    return synthesize_cached(model) if model in ARCHS else model


def read_model_json(path: Path):
    """A JSON file of a model folder (model_index.json, a component's config.json, ditmesh's own files); one line
    naming the file when it cannot be read or is not JSON (ConfigError)."""
    try:
        return json.loads(Path(path).read_text())
    except OSError as exc:
        raise ConfigError(f"{path}: cannot be read ({exc.strerror or exc})") from None
    except ValueError as exc:  # not JSON (json.JSONDecodeError), or not text (UnicodeDecodeError)
        raise ConfigError(f"{path} is not valid JSON ({exc}); restore the file (or download the pipeline "
                          "again)") from None


def read_transformer_config(model: str) -> dict | None:
    """The transformer's config.json of a local pipeline folder or synthetic architecture (None for hub ids)."""
    from ..models.registry import ARCHS

    if model in ARCHS:
        return dict(ARCHS[model].transformer, _class_name=ARCHS[model].transformer_class)
    cfg = Path(model) / "transformer" / "config.json"
    return read_model_json(cfg) if cfg.is_file() else None


def read_pipeline_class(model: str) -> str | None:
    """The pipeline class a local folder or synthetic architecture was saved as (``model_index.json``), or None."""
    from ..models.registry import ARCHS

    if model in ARCHS:
        return ARCHS[model].pipeline
    index = Path(model) / "model_index.json"
    return read_model_json(index).get("_class_name") if index.is_file() else None


def check_transformer_class(model: str) -> str | None:
    """The class name of a local folder's transformer, checked without torch: a pipeline without a transformer, or
    a transformer class ditmesh has no adapter for, is a ConfigError (the local launcher refuses it before any rank
    starts). None where no folder says (a hub id; a synthetic architecture, whose class the registry has)."""
    from ..models.registry import SYNTH, refusal, supported_classes

    if model in SYNTH:
        return None
    index = Path(model) / "model_index.json"
    entries = read_model_json(index) if index.is_file() else None
    if entries is not None and not any(k.startswith("transformer") for k in entries):
        kind = entries.get("_class_name", "this")
        raise ConfigError(f"--model {model}: {kind} has no transformer; ditmesh parallelizes DiT pipelines "
                          f"(transformers: {', '.join(supported_classes())})")
    for name, entry in (entries or {}).items():  # every component model_index.json names has its folder
        if isinstance(entry, list) and len(entry) == 2 and all(entry) and not (Path(model) / name).is_dir():
            raise ConfigError(f"--model {model}: {index} names the component {name} ({entry[1]}), but the folder "
                              f"{Path(model) / name} is missing; restore it (or download the pipeline again)")
    config = read_transformer_config(model)
    if not config or "_class_name" not in config:
        return None
    if (why := refusal(config["_class_name"])) is not None:
        raise ConfigError(f"--model {model}: {why}")
    return config["_class_name"]


def transformer_class(model: str) -> str | None:
    """The transformer class of a local folder (checked: :func:`check_transformer_class`) or synthetic architecture,
    torch-free; None for a hub id."""
    from ..models.registry import CLASSES, SYNTH

    if model in SYNTH:
        return next(cls for cls, module in CLASSES.items() if module == SYNTH[model][0])
    return check_transformer_class(model)


def read_family_facts(model: str):
    """The family's torch-free rules (:class:`~ditmesh.models.registry.FamilyFacts`: CFG switch, frame rule) of a local
    folder or synthetic architecture; None for a hub id or a folder whose configs do not say (or cannot be read)."""
    from ..models.registry import family_facts

    try:
        name = transformer_class(model)
    except ConfigError:
        raise
    except (OSError, ValueError):
        return None  # an unreadable config: the ranks report it with its cause
    return family_facts(name) if name else None


def read_adapter(model: str):
    """The model adapter of a local folder's or synthetic architecture's transformer (None for hub ids).

    Raises ConfigError for a transformer class ditmesh has no adapter for, before any weight is loaded.
    """
    from ..models import adapter_for_class

    name = check_transformer_class(model)  # a folder's class, checked
    if name is None:  # a synthetic architecture's (None for a hub id)
        name = (read_transformer_config(model) or {}).get("_class_name")
    if name is None:
        return None
    try:
        return adapter_for_class(name)
    except NotImplementedError as exc:
        raise ConfigError(f"--model {model}: {exc}") from None


def read_defaults(model: str) -> dict:
    """Per-checkpoint defaults ditmesh stored next to the pipeline (size, text length)."""
    from ..models.registry import ARCHS

    if model in ARCHS:
        a = ARCHS[model]
        defaults = {"default_size": list(a.default_size), "max_sequence_length": a.max_sequence_length}
        if a.default_frames:
            defaults["default_frames"] = a.default_frames
        return defaults
    for name in ("ditmesh_tiny.json", "ditmesh_synth.json"):
        f = Path(model) / name
        if f.is_file():
            return read_model_json(f)
    return {}


def read_quant_manifest(model: str) -> dict | None:
    """What ``ditmesh quantize`` wrote in a local pipeline folder's transformer (its mode, whether the modulation
    is quantized, each linear's mode), or None for any other model. Torch-free."""
    from ..options import QUANT_MANIFEST

    folder = Path(model)
    for component in sorted(folder.glob("transformer*")) if folder.is_dir() else ():
        manifest = component / QUANT_MANIFEST
        if manifest.is_file():
            return read_model_json(manifest)
    return None


def checkpoint_options(options, model: str, flag=lambda name: f"--{name.replace('_', '-')} "):
    """``options`` for a run of ``model``: a checkpoint written by ``ditmesh quantize`` runs in its own mode
    (``--quant`` left off takes it; another mode is refused), and without what needs the weights in the model's
    dtype (LoRAs, fused projections, PipeFusion's stage loading). Torch-free."""
    manifest = read_quant_manifest(model)
    if manifest is None:
        return options
    mode, modulation = manifest["mode"], manifest["quant_modulation"]
    written = f"{model} was written by `ditmesh quantize` in {mode}"
    if options.quant not in ("off", mode):
        raise ConfigError(f"{flag('quant')}{options.quant}: {written}; drop {flag('quant').strip()} or give {mode}")
    if options.quant == mode and options.quant_modulation not in (None, modulation):
        given = modulation_flag(options.quant_modulation, flag("quant").startswith("--"))
        raise ConfigError(f"{given}: {written} with the modulation {'quantized' if modulation else 'kept'}; run it "
                          "as written")
    refused = [(bool(options.loras), f"{flag('lora').strip()} adapters do not load"),
               (options.fuse_qkv, "fused projections (fuse_qkv) do not run"),
               (options.config.pp > 1, f"PipeFusion (pp={options.config.pp}) does not load its stages")]
    for on, what in refused:
        if on:
            raise ConfigError(f"{what} on a checkpoint of 8-bit weights: {written}; use the original checkpoint "
                              f"with {flag('quant')}{mode}")
    return options.replace(quant=mode, quant_modulation=modulation)
