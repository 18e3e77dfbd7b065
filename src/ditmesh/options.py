"""``RunOptions``: one frozen, validated description of a run — the degrees and every option.

``generate``, ``serve``, ``bench``, ``plan`` and the Python API build it the same way (:meth:`RunOptions.create`,
or :meth:`RunOptions.from_args` for a parsed command line, which calls it) and pass it on; ``parallelize(pipe,
options)`` reads it and nothing else. Every check and refusal message lives in :meth:`RunOptions.validate`:
``create`` runs the checks that need nothing but the values (this module imports neither torch nor diffusers, so
a mistyped value is refused at once), and ``validate(device=..., adapters=..., models=...)`` adds those that need
the device, the model's family or the loaded transformers. A new option is a field, a check here, a flag in
``cli.add_run_options`` and a test.

The object is a value: it never carries runtime state (ranks, groups, devices); that lives in
:class:`ditmesh.mesh.ParallelMesh` and the runtime ``parallelize`` returns.
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass, field, fields
from pathlib import Path

from .config import PP_CHUNK_BYTES, ConfigError, ParallelConfig, require_extra

#: how Ulysses all-to-alls travel: NCCL kernels (any backend), or copy engines writing into the peers' symmetric
#: memory (``ditmesh.symm``; CUDA GPUs of one host, Ulysses alone)
TRANSPORTS = ("nccl", "symm")

#: ``vae_parallel``: ``auto`` (split the VAE along height when there are several ranks; a call that cannot be split
#: runs whole on every rank), ``on`` (the same, but what cannot be split is an error), ``tiled`` (diffusers' tiled
#: decode with its tiles spread over the ranks), ``off``
VAE_PARALLEL_MODES = ("auto", "on", "tiled", "off")

#: ``quant``: the transformer blocks' linear layers in 8 bits (``off``: the model's dtype; ``fp8``: weights and
#: activations in float8 with per-row scales; ``fp8-weight``, ``int8-weight``: the weights alone; ``parallel.quant``)
QUANT_MODES = ("off", "fp8", "fp8-weight", "int8-weight")
#: the file a transformer folder written by ``ditmesh quantize`` names its mode in (``parallel.quant``)
QUANT_MANIFEST = "ditmesh_quant.json"

#: ``quant``: an fp8 layer of the text stream with at least this many input features keeps weight-only fp8
#: (row-wise fp8 products of large K and few rows failed on H100: pytorch/ao#4582; ``parallel.quant``)
WIDE_TEXT_INPUT = 8192


def quant_layer_mode(name: str, in_features: int, out_features: int, mode: str, modulation: bool = True) -> str | None:
    """The mode ``quant=mode`` gives the block linear at module path ``name`` (None: it stays in the model's dtype):
    both sizes multiples of 16 (what fp8 products take); AdaLN modulation linears (a path part starting with ``norm``)
    only with ``modulation``; in ``fp8``, a wide text-stream input (:data:`WIDE_TEXT_INPUT`) keeps weight-only fp8."""
    if mode == "off" or in_features % 16 or out_features % 16:
        return None
    if not modulation and any(part.startswith("norm") for part in name.split(".")):
        return None
    if mode == "fp8" and "context" in name and in_features >= WIDE_TEXT_INPUT:
        return "fp8-weight"
    return mode


#: ``quant_backend``: who does the 8-bit work (``parallel.quant.apply``): ``auto`` (:func:`resolved_quant_backend`: on
#: CUDA ``scaled-mm`` for fp8 and torchao for the weight-only modes, else ditmesh's ``QuantLinear``), ``torchao``,
#: ``scaled-mm`` (``QuantLinear`` everywhere, its fp8 products by ``torch._scaled_mm`` on plain tensors) or
#: ``emulated`` (products in the activations' dtype)
QUANT_BACKENDS = ("auto", "torchao", "scaled-mm", "emulated")


def resolved_quant_backend(backend: str, mode: str, device_type: str) -> str:
    """Who does ``mode``'s 8-bit work under ``backend`` on a ``device_type`` device: ``auto`` is ``scaled-mm`` for
    fp8 and ``torchao`` for the weight-only modes on CUDA, ``emulated`` (ditmesh's ``QuantLinear``) elsewhere; any
    other backend is itself."""
    if backend != "auto":
        return backend
    if device_type != "cuda":
        return "emulated"
    return "scaled-mm" if mode == "fp8" else "torchao"

#: ``compile_artifacts``: compiled blocks kept between processes (``ditmesh.aot``)
COMPILE_ARTIFACTS = ("off", "load", "save")

#: ``comm_dtype``: the dtype sequence-parallel payloads travel in (``auto``: the activations'; ``fp8``: float8_e4m3fn
#: with a float32 scale per token and head, ``comm.fp8_pack``; docs/quantization.md)
COMM_DTYPES = ("auto", "fp8")

#: ``attention``: the attention kernel (``default``: the exact one of the backend; ``fp8``: Q, K, V and P in float8,
#: cuDNN's fused fp8 attention (``attention.fp8``), Hopper or newer; ``fp8-emulated``: its rounding in float32 math,
#: any device, for tests and quality measurements)
ATTENTION_MODES = ("default", "fp8", "fp8-emulated")
#: attention kernels that were options once, and why they are not any more (the refusal names it)
RETIRED_ATTENTION = {mode: "it was slower than the exact attention on every shape measured on an H200 (1.6-3.2x "
                           "the time of cuDNN's exact kernel; docs/quantization.md)" for mode in ("int8", "int8-emulated")}

#: a hub id (``owner/name``), which diffusers fetches, as opposed to a local path that does not exist
HUB_ID = re.compile(r"^[\w.-]+/[\w.-]+$")

POLICIES = ("off", "dbcache", "fbcache", "teacache", "static", "taylor", "default")

#: knobs whose default differs by policy
_POLICY_DEFAULTS = {"teacache": {"threshold": 0.2, "first": 0}}

#: what ``--cache default`` means: the setting that met the quality bar with the fewest evaluations on the tiny
#: trained pipeline (docs/caching.md: 12.57 of 28 evaluations per image, no image lost an attribute)
DEFAULT = "taylor:interval=4,warmup=3"


@dataclass(frozen=True)
class CacheConfig:
    """A step-cache setting: ``policy`` and its knobs (see the module docstring)."""

    policy: str = "off"
    threshold: float = 0.08
    first: int = 1
    last: int = 0
    warmup: int = 1
    max_skips: int = 3
    #: static: the steps whose middle blocks are skipped
    skip: tuple[int, ...] = ()
    #: taylor: the middle blocks run every ``interval`` steps (after ``warmup``); in between, their residual is
    #: extrapolated linearly from the last two steps they ran
    interval: int = 2
    #: teacache: the rescaling polynomial of the modulated input's change, highest power first (identity by default)
    poly: tuple[float, ...] = (1.0, 0.0)

    @classmethod
    def parse(cls, text: str | None) -> "CacheConfig":
        """``off``, ``fbcache:0.08``, ``dbcache:threshold=0.1,first=2,last=1,warmup=2,max_skips=3``,
        ``teacache:threshold=0.4,poly=498.7/-283.8/55.8/-3.82/0.264``, ``static:skip=3-5+8+10-12,first=1`` or
        ``taylor:interval=3,warmup=2``."""
        if not text or text == "off":
            return cls()
        if text == "default":
            text = DEFAULT
        name, _, rest = text.partition(":")
        if name not in POLICIES:
            raise ConfigError(f"cache policy {name!r} is not one of: {', '.join(POLICIES)} "
                              "(e.g. fbcache:0.08 or dbcache:threshold=0.1,first=2,last=1)")
        values: dict = {"policy": "dbcache" if name == "fbcache" else name, **_POLICY_DEFAULTS.get(name, {})}
        options = ("threshold", "first", "last", "warmup", "max_skips", "skip", "interval", "poly")
        for item in filter(None, rest.split(",")):
            key, eq, value = item.partition("=")
            if not eq:
                key, value = "threshold", key
            if key not in options:
                raise ConfigError(f"cache option {key!r} is not one of: {', '.join(options)}")
            try:
                values[key] = (float(value) if key == "threshold" else _steps(value) if key == "skip"
                               else tuple(float(c) for c in value.split("/")) if key == "poly" else int(value))
            except ValueError:
                hint = {"skip": " (steps like 3-5+8)", "poly": " (coefficients like 2.1/-0.3/0.01)"}.get(key, "")
                raise ConfigError(f"cache option {key}={value!r} is not a number{hint}") from None
        config = cls(**values)
        least_first = 0 if config.policy == "teacache" else 1
        if not (config.threshold >= 0 and config.first >= least_first and config.last >= 0 and config.warmup >= 0
                and config.max_skips >= 1 and config.interval >= 2):
            raise ConfigError(f"cache {text!r}: threshold >= 0, first >= {least_first}, last >= 0, warmup >= 0, "
                              "max_skips >= 1, interval >= 2")
        return config

    def describe(self) -> str:
        """The setting in the text form :meth:`parse` reads."""
        if not self.on:
            return "off"
        common = f"first={self.first},last={self.last}"
        if self.policy == "static":
            return f"static:skip={'+'.join(map(str, self.skip))},{common}"
        if self.policy == "taylor":
            return f"taylor:interval={self.interval},warmup={self.warmup},{common}"
        if self.policy == "teacache":
            poly = "/".join(f"{c:.6g}" for c in self.poly)
            return (f"teacache:threshold={self.threshold},poly={poly},{common},warmup={self.warmup},"
                    f"max_skips={self.max_skips}")
        return f"dbcache:threshold={self.threshold},{common},warmup={self.warmup},max_skips={self.max_skips}"

    @property
    def on(self) -> bool:
        return self.policy != "off"


def _steps(text: str) -> tuple[int, ...]:
    """``3-5+8`` -> ``(3, 4, 5, 8)``; ``none`` -> ``()``."""
    if text == "none":
        return ()
    out = []
    for part in filter(None, text.split("+")):
        lo, _, hi = part.partition("-")
        out += range(int(lo), int(hi or lo) + 1)
    return tuple(sorted(set(out)))


@dataclass(frozen=True)
class LoraSpec:
    """One LoRA adapter of a run: where it is (a .safetensors file, a folder holding one, or a hub id), its weight,
    and its name (None: ``lora<i>`` by position; a named adapter can be picked per request by ``serve``)."""

    path: str
    scale: float = 1.0
    name: str | None = None

    @classmethod
    def parse(cls, text: str, flag: str = "--lora ") -> "LoraSpec":
        """``PATH``, ``PATH:SCALE``, ``NAME=PATH`` or ``NAME=PATH:SCALE``. The scale is what follows the last ``:``,
        unless that holds a path separator (then it is all a path); the name is what precedes a first ``=`` that
        comes before any path separator."""
        name, eq, rest = text.partition("=")
        if not eq or "/" in name or "\\" in name or not name:
            name, rest = None, text
        elif not re.fullmatch(r"[A-Za-z0-9_.-]+", name):
            raise ConfigError(f"{flag}{text}: the name {name!r} may hold letters, digits, '_', '.' and '-' only")
        path, sep, scale = rest.rpartition(":")
        if not sep or not path or "/" in scale or "\\" in scale:
            return cls(rest, 1.0, name)
        try:
            value = float(scale)
        except ValueError:
            raise ConfigError(f"{flag}{text}: scale {scale!r} is not a number; give PATH or PATH:SCALE, e.g. "
                              "style.safetensors:0.8") from None
        if not math.isfinite(value):
            raise ConfigError(f"{flag}{text}: scale {scale} is not a finite number; give one like 0.8")
        return cls(path, value, name)

    def describe(self) -> str:
        """The text :meth:`parse` reads back."""
        return (f"{self.name}=" if self.name else "") + self.path + (f":{self.scale:g}" if self.scale != 1.0 else "")


#: the command-line flag of each option whose flag is not ``--`` + its name with dashes
_CLI_FLAGS = {"chunk_tokens": "--chunk", "pp_chunk_bytes": "--pp-chunk-mb", "loras": "--lora"}


def modulation_quantized(quant: str, quant_modulation: bool | None) -> bool:
    """Whether ``--quant``'s mode takes the AdaLN modulation linears of the blocks too: as asked, else the mode's
    default. ``fp8-weight`` keeps them in the model's dtype (on the tiny trained pipeline, quantizing them lost an
    attribute in 1 image of 128, keeping them none: docs/quantization.md); ``fp8`` and ``int8-weight`` quantize them
    (none lost either way; the memory target at ulysses 4 needs them in 8 bits)."""
    return quant != "fp8-weight" if quant_modulation is None else quant_modulation


def modulation_flag(quant_modulation: bool, cli: bool) -> str:
    """How the user asked for ``quant_modulation``: its command-line flag, or the keyword."""
    if cli:
        return "--quant-modulation" if quant_modulation else "--quant-keep-modulation"
    return f"quant_modulation={quant_modulation}"


def _int_or_auto(value, flag: str, what: str, example: int):
    """``value`` as None, ``"auto"`` or a positive count (a digit string from a command line is read); anything
    else is a ConfigError naming the value as typed."""
    if value is None or value == "auto":
        return value
    if isinstance(value, str):
        try:
            value = int(value) if int(value) >= 1 else value
        except ValueError:
            pass
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{flag}{value!r} is not a {what}; give a positive integer (e.g. {example}) or auto")
    return value


def _whole(value, flag: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{flag}{value!r} is not an integer")


@dataclass(frozen=True)
class RunOptions:
    """Everything about how a pipeline runs on the ranks: the degrees (:class:`~ditmesh.config.ParallelConfig`) and
    every option. Build it with :meth:`create` (checked); the fields are described in ``parallelize``'s docstring
    and docs/usage.md."""

    config: ParallelConfig = field(default_factory=ParallelConfig)
    #: ``torch.compile`` every transformer block (regional), after the parallel dimensions
    compile: bool = False
    #: with ``compile``, the compiled blocks kept between processes (:data:`COMPILE_ARTIFACTS`; ``ditmesh.aot``):
    #: ``off``; ``save``: compile each block class whole and save it (a cold compile: inductor's cache is not used);
    #: ``load``: run the blocks from the artifacts a ``save`` run of this exact configuration left, tracing nothing
    compile_artifacts: str = "off"
    #: replay each transformer call from a CUDA graph (CUDA only; not with dp/cfg > 1 or the consistency check)
    cuda_graph: bool = False
    #: step caching (``ditmesh.cache``)
    cache: CacheConfig = field(default_factory=CacheConfig)
    #: how Ulysses all-to-alls travel (:data:`TRANSPORTS`)
    transport: str = "nccl"
    #: head groups each Ulysses attention pipelines against its all-to-alls (None: the runtime's default)
    ulysses_chunks: int | None = None
    #: Q, K and V of each self-attention by one GEMM (``ditmesh.fusion``)
    fuse_qkv: bool = False
    #: how the VAE decodes over the ranks (:data:`VAE_PARALLEL_MODES`)
    vae_parallel: str = "auto"
    #: feed-forwards and attention on pieces of at most this many tokens (None: whole; ``"auto"``: from free memory)
    chunk_tokens: int | str | None = None
    #: the VAE's blocks on pieces of at most this many rows (None: whole; ``"auto"``: from free memory)
    vae_chunk: int | str | None = None
    #: PipeFusion (pp > 1): patches of the image tokens (None: pp), exact warm-up steps, largest message in bytes
    pp_patches: int | None = None
    pp_warmup: int = 1
    pp_chunk_bytes: int = PP_CHUNK_BYTES
    #: displaced patch parallelism over the ulysses axis, and its exact warm-up steps
    displaced: bool = False
    displaced_warmup: int = 1
    #: debug: verify before every transformer call that every rank holds the same inputs
    check_consistency: bool = False
    #: the LoRA adapters loaded after parallelizing, and whether they are fused into the weights
    loras: tuple[LoraSpec, ...] = ()
    fuse_lora: bool = False
    #: 8-bit linear layers (:data:`QUANT_MODES`), the sequence-parallel payloads' dtype (:data:`COMM_DTYPES`), the
    #: attention kernel (:data:`ATTENTION_MODES`)
    quant: str = "off"
    #: with ``quant``: the AdaLN modulation linears of the blocks quantized too (True), kept in the model's dtype
    #: (False), or the mode's default (None: :func:`modulation_quantized`)
    quant_modulation: bool | None = None
    #: with ``quant``: who does the 8-bit work (:data:`QUANT_BACKENDS`)
    quant_backend: str = "auto"
    comm_dtype: str = "auto"
    attention: str = "default"
    #: with the 8-bit attention: the first and last this many steps of each run attend exactly
    attention_bf16_steps: int = 0

    # ---- building ------------------------------------------------------------------------------------------

    @classmethod
    def create(cls, config: ParallelConfig | None = None, *, cli: bool = False, **values) -> "RunOptions":
        """The one constructor: ``values`` by field name, in the forms a person types them (``cache`` as text or a
        :class:`CacheConfig`, ``chunk_tokens``/``vae_chunk`` as a count, its digits or ``"auto"``, ``loras`` as
        ``PATH[:SCALE]`` texts or :class:`LoraSpec`), normalized and checked by :meth:`validate`. ``cli``: messages
        name the command-line flags (``--transport``) instead of the keywords (``transport=``)."""
        names = {f.name for f in fields(cls)}
        unknown = sorted(set(values) - names)
        if unknown:
            raise TypeError(f"unknown run option(s) {', '.join(unknown)}; known: {', '.join(sorted(names))}")
        flag = _flagger(cli)
        if config is None:
            config = ParallelConfig()
        elif not isinstance(config, ParallelConfig):
            raise TypeError(f"config must be a ParallelConfig, not {type(config).__name__}")
        cache = values.get("cache")
        if not isinstance(cache, CacheConfig):
            values["cache"] = CacheConfig.parse(cache)
        for name, what, example in (("chunk_tokens", "token count", 4096), ("vae_chunk", "row count", 256)):
            if name in values:
                values[name] = _int_or_auto(values[name], flag(name), what, example)
        values["loras"] = tuple(text if isinstance(text, LoraSpec) else LoraSpec.parse(text, flag("loras"))
                                for text in values.get("loras") or ())
        return cls(config=config, **values).validate(cli=cli)

    @classmethod
    def from_args(cls, args, config: ParallelConfig | None = None) -> "RunOptions":
        """:meth:`create` from a parsed command line (``generate``, ``serve``, ``bench``, ``plan``: each reads the
        flags it has; a flag a command lacks keeps its default). ``config``: the degrees, else read from the
        degree flags."""
        if config is None:
            config = ParallelConfig(**{axis: getattr(args, axis, 1) for axis in ("dp", "cfg", "pp", "ring", "ulysses",
                                                                                "tp")})
        taken = {"chunk_tokens": "chunk", "loras": "lora"}
        values = {}
        for f in fields(cls):
            if f.name == "config":
                continue
            if f.name == "pp_chunk_bytes":
                if getattr(args, "pp_chunk_mb", None) is not None:
                    values[f.name] = args.pp_chunk_mb << 20
                continue
            value = getattr(args, taken.get(f.name, f.name), None)
            if value is not None:
                values[f.name] = value
        return cls.create(config, cli=True, **values)

    def replace(self, **values) -> "RunOptions":
        """A copy with ``values`` changed (in :meth:`create`'s forms), checked again."""
        current = {f.name: getattr(self, f.name) for f in fields(self)}
        config = values.pop("config", current.pop("config"))
        return RunOptions.create(config, **{**current, **values})

    # ---- reading -------------------------------------------------------------------------------------------

    @property
    def quantized_modulation(self) -> bool:
        """Whether the quant step takes the blocks' AdaLN modulation linears (:func:`modulation_quantized`)."""
        return modulation_quantized(self.quant, self.quant_modulation)

    @property
    def stale(self) -> bool:
        """Whether the run is approximate by design (PipeFusion's or displaced attention's stale K/V)."""
        return self.config.pp > 1 or self.displaced

    def describe(self) -> str:
        """Short human form: the degrees and the options that differ from their defaults."""
        parts = [self.config.describe()]
        default = RunOptions()
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name == "config" or value == getattr(default, f.name):
                continue
            if isinstance(value, bool) and f.name != "quant_modulation":
                parts.append(f.name)
            elif f.name == "cache":
                parts.append(f"cache={value.describe()}")
            elif f.name == "loras":
                parts.append("loras=" + "+".join(lora.describe() for lora in value))
            else:
                parts.append(f"{f.name}={value}")
        return " ".join(parts)

    def as_dict(self) -> dict:
        """A JSON-friendly form (reports, results): degrees and options, cache and LoRAs as their texts."""
        out: dict = {"degrees": self.config.as_dict()}
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name == "cache":
                value = value.describe()
            elif f.name == "loras":
                value = [lora.describe() for lora in value]
            if f.name != "config":
                out[f.name] = value
        return out

    # ---- checking ------------------------------------------------------------------------------------------

    def validate(self, *, device=None, adapters=(), models=None, heads: int | None = None,
                 model_name: str = "the transformer", local_world: int | None = None,
                 cli: bool = False) -> "RunOptions":
        """Raise :class:`ConfigError` (one line: the value and what would work) for anything that cannot run;
        return ``self``.

        Without arguments, the checks that need nothing but the values (no torch). ``device``: this rank's device
        (CUDA graphs and the copy-engine transport need CUDA; the transport's host rule reads ``local_world``,
        default torchrun's ``LOCAL_WORLD_SIZE``). ``heads`` and ``model_name``: the transformer's attention heads,
        known from its config before loading. ``adapters``: the families' model adapters (their refusals of
        PipeFusion, displaced attention and CUDA graphs). ``models``: the loaded transformers (heads, adapters and
        the family's own refusal of the degrees, read from them).
        """
        flag = _flagger(cli)
        c = self.config
        for name in ("compile", "cuda_graph", "fuse_qkv", "displaced", "check_consistency", "fuse_lora",
                     "quant_modulation"):
            value = getattr(self, name)
            if not isinstance(value, bool) and not (name == "quant_modulation" and value is None):
                raise ConfigError(f"{flag(name)}{value!r} is not true or false")
        _choice(self.transport, TRANSPORTS, flag("transport"), "transport")
        _choice(self.compile_artifacts, COMPILE_ARTIFACTS, flag("compile_artifacts"), "compiled-artifact mode")
        if self.compile_artifacts != "off" and not self.compile:
            raise ConfigError(f"{flag('compile_artifacts')}{self.compile_artifacts} keeps compiled blocks, and "
                              f"{flag('compile').strip(' =')} is off; add it, or use {flag('compile_artifacts')}off")
        _choice(self.vae_parallel, VAE_PARALLEL_MODES, flag("vae_parallel"), "mode")
        _choice(self.quant, QUANT_MODES, flag("quant"), "quantization mode")
        _choice(self.quant_backend, QUANT_BACKENDS, flag("quant_backend"), "backend of the 8-bit linears")
        _choice(self.comm_dtype, COMM_DTYPES, flag("comm_dtype"), "communication dtype")
        refuse_retired_attention(self.attention, flag("attention"))
        _choice(self.attention, ATTENTION_MODES, flag("attention"), "attention kernel")
        _int_or_auto(self.chunk_tokens, flag("chunk_tokens"), "token count", 4096)
        _int_or_auto(self.vae_chunk, flag("vae_chunk"), "row count", 256)
        if self.ulysses_chunks is not None:
            _whole(self.ulysses_chunks, flag("ulysses_chunks"))
            if self.ulysses_chunks < 1:
                raise ConfigError(f"{flag('ulysses_chunks')}{self.ulysses_chunks} must be >= 1 (1 = no pipelining)")
        self._check_stale(flag)
        self._check_loras(flag)
        self._check_eight_bit(flag)
        self._check_quant(flag)
        if self.cuda_graph:
            if c.dp > 1 or c.cfg > 1:
                raise ConfigError(f"CUDA graphs do not run with dp={c.dp}, cfg={c.cfg} (their hooks choose per call "
                                  "what to run); use dp=1 and cfg=1, or drop the graph option")
            if self.check_consistency:
                raise ConfigError("CUDA graphs do not run with the consistency check (it reads values on the host); "
                                  "use one or the other")
        if self.transport == "symm" and c.ring > 1:
            raise ConfigError(f"{flag('transport')}symm moves Ulysses all-to-alls only, and ring={c.ring} is set; use "
                              "nccl, or ring=1")
        if models is not None:
            from .models.base import adapter_for  # the loaded transformers' families (torch is loaded already)

            models = list(models.values()) if isinstance(models, dict) else list(models)
            adapters = [adapter_for(m) for m in models]
            for model, adapter in zip(models, adapters):
                c.check_heads(adapter.num_heads(model), type(model).__name__)
                reason = adapter.unsupported(model, c) if adapter.unsupported is not None else None
                if reason:
                    raise ConfigError(reason)
                why = adapter.attention_refusal(model) if self.attention != "default" and \
                    adapter.attention_refusal is not None else None
                if why:
                    raise ConfigError(f"{flag('attention')}{self.attention} does not run {why}; use the default "
                                      "attention")
        elif heads is not None:
            c.check_heads(heads, model_name)
        for adapter in adapters:  # a family's refusal first: it holds on every device
            self.check_family(adapter)
        if device is not None:
            self._check_device(device, flag, local_world)
        return self

    def _check_stale(self, flag) -> None:
        """PipeFusion's and displaced attention's settings, and the options they do not run with."""
        c = self.config
        for name in ("pp_patches", "pp_warmup", "pp_chunk_bytes", "displaced_warmup"):
            value = getattr(self, name)
            if value is not None:
                _whole(value, flag(name))
        if self.pp_patches is not None and self.pp_patches < c.pp:
            raise ConfigError(f"{flag('pp_patches')}{self.pp_patches} is fewer than the pp={c.pp} stages; use at "
                              f"least {c.pp} patches (every stage needs a patch to work on)")
        for name in ("pp_warmup", "displaced_warmup"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{flag(name)}{getattr(self, name)} must be >= 1: the first step of a run fills "
                                  "the K/V buffers the stale steps read; use 1 (default) or more")
        if self.pp_chunk_bytes < 1:
            raise ConfigError(f"{flag('pp_chunk_bytes')}{self.pp_chunk_bytes} must be a positive byte count "
                              f"(default {PP_CHUNK_BYTES})")
        if self.displaced_warmup != 1 and not self.displaced:
            raise ConfigError(f"{flag('displaced_warmup')}{self.displaced_warmup} is given without "
                              f"{flag('displaced').strip('= ')}; add it or drop the warm-up")
        if c.pp > 1 or self.displaced:
            mode, off = (("displaced attention", "drop displaced") if self.displaced
                         else (f"PipeFusion (pp={c.pp})", "use pp=1"))
            for on, option in ((self.fuse_qkv, "fuse_qkv"), (self.displaced and self.cache.on, "step caching"),
                               (self.cuda_graph and not self.displaced, "CUDA graphs"),
                               (self.transport != "nccl", f"transport={self.transport}")):
                if on:
                    raise ConfigError(f"{option} does not run with {mode} yet; drop it or {off}")
        if c.pp > 1 and self.cache.policy not in ("off", "static", "taylor"):
            raise ConfigError(f"cache {self.cache.policy} does not run with PipeFusion (pp={c.pp}): its statistic "
                              "covers the whole image after the first blocks, which no stage holds while patches "
                              "flow; use static or taylor (--cache default is taylor), or pp=1")
        if self.displaced:
            if c.pp > 1:
                raise ConfigError(f"displaced attention and PipeFusion (pp={c.pp}) are two stale-K/V schemes; use "
                                  "one: pp=1 with displaced, or pp without displaced")
            if c.ring > 1:
                raise ConfigError(f"displaced attention gathers every rank's K/V and runs no ring; ring={c.ring} is "
                                  f"set: use ring=1 and ulysses={c.sp}")
            if c.ulysses == 1:
                raise ConfigError("displaced attention needs ulysses > 1: its patches are the ulysses ranks' token "
                                  "chunks; e.g. ulysses=4 with displaced")

    def _check_eight_bit(self, flag) -> None:
        """``comm_dtype``, ``attention`` and ``attention_bf16_steps`` against the degrees and the other options."""
        c, steps = self.config, self.attention_bf16_steps
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 0:
            raise ConfigError(f"{flag('attention_bf16_steps')}{steps!r} must be a step count >= 0 (0: every step in "
                              "8 bits)")
        if self.comm_dtype == "fp8":
            if c.sp == 1:
                raise ConfigError(f"{flag('comm_dtype')}fp8 sends the sequence-parallel payloads (ulysses all-to-alls, "
                                  "ring K/V) in fp8, and ulysses=ring=1 sends none; drop it or set ulysses/ring > 1")
            if self.transport != "nccl":
                raise ConfigError(f"{flag('comm_dtype')}fp8 packs the all-to-all payloads itself and "
                                  f"transport={self.transport} moves unpacked ones; use transport nccl with fp8")
            if self.stale:
                what = f"PipeFusion (pp={c.pp})" if c.pp > 1 else "displaced attention"
                raise ConfigError(f"{flag('comm_dtype')}fp8 does not run with {what} yet; drop one of them")
        if self.attention == "default":
            if steps:
                raise ConfigError(f"{flag('attention_bf16_steps')}{steps} keeps steps out of 8-bit attention, and "
                                  f"the attention is the default one; drop it or use {flag('attention')}fp8")
            return
        if c.ring > 1 or self.stale:
            what = f"ring={c.ring}" if c.ring > 1 else f"pp={c.pp}" if c.pp > 1 else "displaced"
            raise ConfigError(f"{flag('attention')}{self.attention} runs on one process or under ulysses alone, and "
                              f"{what} merges partial attention over key chunks; use the default attention there")
        if self.attention == "fp8":  # cuDNN's frontend, named before any rank starts (its device is checked there)
            require_extra(f"{flag('attention')}fp8", "fp8", ("cudnn",))
        if steps and self.cuda_graph:
            raise ConfigError(f"{flag('attention_bf16_steps')}{steps} switches attention per step on the host, which "
                              "a CUDA graph's replay does not see; drop one of them")

    def _check_loras(self, flag) -> None:
        names = [lora.name or f"lora{i}" for i, lora in enumerate(self.loras)]
        twice = sorted({n for n in names if names.count(n) > 1})
        if twice:
            raise ConfigError(f"{flag('loras')}: the adapter name {twice[0]!r} is given twice; give each a name of "
                              "its own (NAME=PATH)")
        for lora in self.loras:
            text = lora.describe()
            local = Path(lora.path).expanduser()
            if local.is_dir() and not any(local.glob("*.safetensors")):
                raise ConfigError(f"{flag('loras')}{text}: the folder {lora.path} has no .safetensors file")
            if not local.exists() and (not HUB_ID.match(lora.path) or local.suffix in (".safetensors", ".bin")):
                raise ConfigError(f"{flag('loras')}{text}: no such file or folder")
        if self.loras:  # diffusers loads adapters through peft
            require_extra(flag("loras").strip("= "), "lora", ("peft",))
        if self.fuse_lora and not self.loras:
            raise ConfigError(f"{flag('fuse_lora').strip('= ')} is given without {flag('loras').strip('= ')}: add "
                              "the adapters to fuse (PATH[:SCALE]) or drop it")

    def _check_quant(self, flag) -> None:
        if self.quant == "off":
            if self.quant_modulation is not None:
                given = modulation_flag(self.quant_modulation, flag("quant").startswith("--"))
                raise ConfigError(f"{given} is given without a {flag('quant').strip()} mode; add one (fp8, "
                                  "fp8-weight, int8-weight) or drop it")
            if self.quant_backend != "auto":
                raise ConfigError(f"{flag('quant_backend')}{self.quant_backend} is given without a "
                                  f"{flag('quant').strip()} mode; add one (fp8, fp8-weight, int8-weight) or drop it")
            return
        if self.quant_backend == "torchao":  # torchao on any device (auto takes it on CUDA: checked with the device)
            require_extra(f"{flag('quant_backend')}torchao", "quant", ("torchao",))
        if self.loras and not self.fuse_lora:
            raise ConfigError(f"{flag('quant')}{self.quant} with unfused LoRA adapters: add "
                              f"{flag('fuse_lora').strip('= ')} (the fused weights are quantized), or drop the quant")

    def _check_device(self, device, flag, local_world: int | None) -> None:
        kind = getattr(device, "type", str(device).split(":")[0])
        if self.quant != "off" and kind == "cuda":
            import torch  # a device is given: torch is loaded already

            if self.quant.startswith("fp8") and torch.cuda.get_device_capability(device) < (8, 9):
                name = torch.cuda.get_device_name(device)
                raise ConfigError(f"{flag('quant')}{self.quant} needs fp8 arithmetic (compute capability 8.9+: "
                                  f"Ada, Hopper, Blackwell), and this {name} lacks it; use int8-weight")
            import importlib.util

            if resolved_quant_backend(self.quant_backend, self.quant, kind) == "torchao" and \
                    importlib.util.find_spec("torchao") is None:
                raise ConfigError(f"{flag('quant')}{self.quant} on CUDA runs torchao, which is not installed here; "
                                  "pip install 'ditmesh[quant]' (or torchao), or use quant=off")
        if self.attention == "fp8":
            if kind != "cuda":
                raise ConfigError(f"{flag('attention')}fp8 runs cuDNN's fp8 attention on CUDA GPUs, and this rank runs "
                                  f"on {kind}; use the default attention (fp8-emulated gives its rounding in float32 "
                                  "math, for measurements)")
            import importlib.util

            import torch  # a device is given: torch is loaded already

            if torch.cuda.get_device_capability(device) < (9, 0):
                raise ConfigError(f"{flag('attention')}fp8 runs cuDNN's fp8 attention, which needs compute capability "
                                  f"9.0+ (Hopper, Blackwell), and this {torch.cuda.get_device_name(device)} lacks it; "
                                  "use the default attention")
            if importlib.util.find_spec("cudnn") is None:
                raise ConfigError(f"{flag('attention')}fp8 runs cuDNN's fp8 attention through its frontend, which is "
                                  "not installed here; pip install 'ditmesh[fp8]', or use the default attention")
        if self.cuda_graph and kind != "cuda":
            raise ConfigError(f"CUDA graphs need a CUDA device, but this rank runs on {kind}; drop the graph option")
        if self.transport == "symm":
            if kind != "cuda":
                raise ConfigError(f"{flag('transport')}symm needs CUDA GPUs (copy engines), not {kind}; use nccl")
            if local_world is None:
                local_world = int(os.environ.get("LOCAL_WORLD_SIZE", self.config.world_size))
            if local_world % self.config.ulysses:
                raise ConfigError(f"{flag('transport')}symm needs each ulysses={self.config.ulysses} group on one "
                                  f"host, but a host runs {local_world} processes; use nccl across hosts")

    def check_family(self, adapter) -> None:
        """The refusals of a model family (its adapter), raised as NotImplementedError: what this build does not run
        for that family yet."""
        if self.cuda_graph and adapter.graph_refusal:
            raise ConfigError(f"CUDA graphs do not run {adapter.name}: {adapter.graph_refusal}; drop the graph option")
        if self.config.pp > 1:
            pipefusion_refusal(adapter)
        if self.displaced:
            displaced_refusal(adapter)
        if self.config.ring > 1 and adapter.ring_refusal:
            raise ConfigError(f"ring={self.config.ring} does not run {adapter.name}: {adapter.ring_refusal}; use "
                              "ring=1 (ulysses runs it)")
        if (self.config.cfg > 1 or self.config.dp > 1) and adapter.batch_refusal:
            runs = "ulysses runs it" if adapter.ring_refusal else "ulysses and ring run it"
            raise ConfigError(f"cfg and dp do not run {adapter.name} yet: {adapter.batch_refusal}; use cfg=1 and dp=1 "
                              f"({runs})")
        if self.cache.on and adapter.cache_refusal:
            raise ConfigError(f"step caches do not run {adapter.name}: {adapter.cache_refusal}; run without a cache")


def pipefusion_refusal(adapter) -> None:
    """Raise NotImplementedError for a family that refuses PipeFusion (``pp_refusal``: Mochi's calls always carry a
    mask), without block lists (Z-Image), or whose consecutive block lists pass different activations (a stage
    boundary between them would send what the next block does not take; Chroma's single blocks take the text and
    image streams concatenated), or whose block lists do not declare the streams of what they carry (the families
    PipeFusion has not been tested on: their attention may not read the K/V buffers)."""
    if adapter.pp_refusal:
        raise NotImplementedError(f"PipeFusion does not run {adapter.name} yet: {adapter.pp_refusal}; use pp=1")
    if not adapter.blocks:
        raise NotImplementedError(f"PipeFusion does not run {adapter.name}: it declares no block lists to pipeline; "
                                  "use pp=1")
    for before, after in zip(adapter.blocks, adapter.blocks[1:]):
        if set(before.returns) != set(after.carries):
            raise NotImplementedError(
                f"PipeFusion does not run {adapter.name} yet: its {after.path} take {', '.join(after.carries)} but its "
                f"{before.path} return {', '.join(before.returns)}; use pp=1")
    undeclared = [spec.path for spec in adapter.blocks if len(spec.streams) != len(spec.carries)]
    if undeclared:
        raise NotImplementedError(f"PipeFusion does not run {adapter.name} yet (its {', '.join(undeclared)} declare no "
                                  f"token streams); use pp=1")


def displaced_refusal(adapter) -> None:
    """Raise NotImplementedError for a family displaced attention cannot run: a token grid (Sana's convolutions read
    neighbouring rows, its linear attention sums over ranks), or an attention that needs the whole sequence of its
    heads at once, which ring attention cannot run either (``ring_refusal``: Kandinsky 6 SR's NABLA mask, AnyFlow-FAR's
    K/V cache and block mask); displaced attention hands the processor keys gathered in the tokens' layout instead."""
    if adapter.sequence_plan.grid is not None:
        raise NotImplementedError(f"displaced attention does not run {adapter.name}: its token grid's convolutions and "
                                  "linear attention exchange rows and sums every call; use plain ulysses")
    if adapter.ring_refusal:
        raise NotImplementedError(f"displaced attention does not run {adapter.name}: {adapter.ring_refusal}; use "
                                  "plain ulysses")


def family_allows(refusal, adapter) -> bool:
    """Whether ``refusal(adapter)`` (:func:`pipefusion_refusal`, :func:`displaced_refusal`) lets the family run."""
    try:
        refusal(adapter)
    except NotImplementedError:
        return False
    return True


def refuse_retired_attention(value, flag: str) -> None:
    """A retired attention kernel (:data:`RETIRED_ATTENTION`) is one line naming why and what to use instead."""
    if value in RETIRED_ATTENTION:
        raise ConfigError(f"{flag}{value} was retired: {RETIRED_ATTENTION[value]}; use the default attention, or "
                          f"{flag}fp8 (Hopper+, faster from 8,192 keys)")


def _choice(value, allowed: tuple, flag: str, what: str) -> None:
    if value not in allowed:
        raise ConfigError(f"{flag}{value!r} is not a {what}; use one of {', '.join(allowed)}")


def _flagger(cli: bool):
    """How messages name an option: ``--pp-warmup `` on the command line, ``pp_warmup=`` in Python."""
    if cli:
        return lambda name: _CLI_FLAGS.get(name, "--" + name.replace("_", "-")) + " "
    return lambda name: f"{name}="


#: a ``--quant`` list entry's suffix: the modulation linears quantized or kept (none: the mode's default)
MODULATION_SUFFIXES = {"": None, "quant-modulation": True, "keep-modulation": False}


def quant_variants(text: str) -> list[str]:
    """``--quant``'s comma list, each ``MODE``, ``MODE:keep-modulation`` or ``MODE:quant-modulation`` checked."""
    values = [v.strip() for v in text.split(",") if v.strip()]
    for value in values or [""]:
        mode, _, suffix = value.partition(":")
        if mode not in QUANT_MODES or suffix not in MODULATION_SUFFIXES or (suffix and mode == "off"):
            raise ConfigError(f"--quant {value!r} is not one of {', '.join(QUANT_MODES)} (optionally MODE:keep-modulation"
                              " or MODE:quant-modulation; a comma list of them runs each)")
    return values


def quant_of(variant: str) -> dict:
    """A ``--quant`` entry as RunOptions fields."""
    mode, _, suffix = variant.partition(":")
    return {"quant": mode, "quant_modulation": MODULATION_SUFFIXES[suffix]}
