"""`ParallelConfig`: the degrees of every parallel dimension, validated once.

The config is a frozen value object: it never carries runtime state (ranks, groups, meshes).
Runtime state lives in :class:`ditmesh.mesh.ParallelMesh`.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields

#: Mesh axis order, outermost first. The innermost axes get the closest ranks (consecutive ranks share
#: a node / NVLink island), so the most communication-hungry dimensions sit last: tensor parallelism
#: (two all-reduces per block), then Ulysses (two all-to-alls per attention), then ring (overlappable
#: point-to-point), then PipeFusion, CFG and data parallelism (one exchange per step or less).
AXIS_ORDER = ("dp", "cfg", "pp", "ring", "ulysses", "tp")

#: One-line help per degree, used by the CLI and the docs.
AXIS_HELP = {
    "dp": "data parallelism: each group runs whole prompts",
    "cfg": "CFG parallelism: conditional and unconditional branches on different ranks (1 or 2)",
    "pp": "PipeFusion: patch-level pipeline over transformer blocks",
    "ring": "ring attention: K/V chunks passed around the ring of ranks",
    "ulysses": "Ulysses sequence parallelism: all-to-all over attention heads",
    "tp": "tensor parallelism: Megatron-style sharded linears",
}


class ConfigError(ValueError):
    """A parallel configuration that cannot run; the message says what would work."""


def divisors(n: int) -> list[int]:
    """All positive divisors of ``n`` in increasing order."""
    return [d for d in range(1, n + 1) if n % d == 0]


@dataclass(frozen=True)
class ParallelConfig:
    """Degrees of the parallel dimensions. Their product is the number of processes (world size).

    Every degree defaults to 1, and a degree of 1 creates no process group and costs nothing.
    """

    dp: int = 1
    cfg: int = 1
    pp: int = 1
    ring: int = 1
    ulysses: int = 1
    tp: int = 1

    def __post_init__(self):
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise ConfigError(f"{f.name}={value!r} is not an integer; degrees are positive integers such as 1, 2, 4")
            if value < 1:
                raise ConfigError(f"{f.name}={value} must be >= 1; use 1 to switch the dimension off")
        if self.cfg > 2:
            raise ConfigError(f"cfg={self.cfg} is not supported: classifier-free guidance has 2 branches; use cfg=1 or cfg=2")

    @property
    def world_size(self) -> int:
        """Product of all degrees: the number of processes this configuration needs."""
        n = 1
        for axis in AXIS_ORDER:
            n *= getattr(self, axis)
        return n

    @property
    def sp(self) -> int:
        """Sequence-parallel degree (ring x ulysses)."""
        return self.ring * self.ulysses

    def degrees(self) -> dict[str, int]:
        """Degrees by axis name, in mesh order."""
        return {axis: getattr(self, axis) for axis in AXIS_ORDER}

    def active_axes(self) -> list[str]:
        """Axes with degree > 1, in mesh order."""
        return [axis for axis in AXIS_ORDER if getattr(self, axis) > 1]

    def describe(self) -> str:
        """Short human form, e.g. ``ulysses2 x tp2`` (``single`` when nothing is parallel)."""
        active = self.active_axes()
        return " x ".join(f"{a}{getattr(self, a)}" for a in active) if active else "single"

    def as_dict(self) -> dict[str, int]:
        return asdict(self)

    def coordinate(self, rank: int, axis: str) -> int:
        """The coordinate along ``axis`` of global rank ``rank`` in the mesh (ranks row-major over ``AXIS_ORDER``, the
        innermost axis varying fastest), known before the mesh is built (e.g. to load only a rank's weights)."""
        inner = 1
        for a in AXIS_ORDER[AXIS_ORDER.index(axis) + 1:]:
            inner *= getattr(self, a)
        return rank // inner % getattr(self, axis)

    def check_world_size(self, world_size: int) -> None:
        """Raise :class:`ConfigError` unless the product of degrees equals ``world_size``."""
        if self.world_size != world_size:
            raise ConfigError(
                f"the degrees {self.describe()} multiply to {self.world_size}, but there are {world_size} processes; "
                f"make the product of --dp --cfg --pp --ring --ulysses --tp equal the process count"
            )

    def check_heads(self, num_heads: int, model_name: str) -> None:
        """Validate degrees that split attention heads against a model's head count."""
        if self.ulysses > num_heads:
            even = ", ".join(str(d) for d in divisors(num_heads))
            raise ConfigError(
                f"ulysses={self.ulysses} exceeds the {num_heads} attention heads of {model_name}; valid: 1 to "
                f"{num_heads} (even head split: {even})"
            )
        if num_heads % self.tp:
            valid = ", ".join(str(d) for d in divisors(num_heads))
            raise ConfigError(
                f"tp={self.tp} does not divide the {num_heads} attention heads of {model_name}; valid: {valid}"
            )
        if self.ulysses > num_heads // self.tp:
            raise ConfigError(
                f"ulysses={self.ulysses} exceeds the {num_heads // self.tp} heads each tp={self.tp} rank holds of "
                f"{model_name}; use ulysses <= {num_heads // self.tp} or a smaller tp"
            )


#: what ``vae_parallel`` takes: ``auto`` (split the VAE along height when there are several ranks; a call that
#: cannot be split runs whole on every rank), ``on`` (the same, but what cannot be split is an error), ``tiled``
#: (diffusers' tiled decode with its tiles spread over the ranks), ``off``
VAE_PARALLEL_MODES = ("auto", "on", "tiled", "off")


def check_vae_parallel(mode: str, flag: str = "vae_parallel=") -> None:
    """Raise :class:`ConfigError` unless ``mode`` is one of :data:`VAE_PARALLEL_MODES`."""
    if mode not in VAE_PARALLEL_MODES:
        raise ConfigError(f"{flag}{mode!r} is not a mode; use one of {', '.join(VAE_PARALLEL_MODES)}")


def check_chunk(chunk, flag: str = "chunk=", what: str = "token count", example: int = 4096) -> None:
    """Raise :class:`ConfigError` unless ``chunk`` is None, ``"auto"`` or a positive count (of tokens, or ``what``)."""
    if chunk is None or chunk == "auto":
        return
    if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1:
        raise ConfigError(f"{flag}{chunk!r} is not a {what}; give a positive integer (e.g. {example}) or auto")


def check_vae_chunk(rows, flag: str = "vae_chunk=") -> None:
    """Raise :class:`ConfigError` unless ``rows`` is None, ``"auto"`` or a positive number of rows."""
    check_chunk(rows, flag, "row count", 256)


#: the largest single point-to-point message PipeFusion sends by default; bigger tensors travel in pieces
PP_CHUNK_BYTES = 64 << 20


def check_pipefusion(pp: int, patches: int | None, warmup: int, chunk_bytes: int, flags: tuple[str, str, str] =
                     ("pp_patches=", "pp_warmup=", "pp_chunk_bytes=")) -> None:
    """Raise :class:`ConfigError` unless the PipeFusion settings can run at degree ``pp``.

    ``patches``: the image (video) tokens are cut into this many patches, at least ``pp`` (None: ``pp``);
    ``warmup``: steps of each run computed exactly, at least 1 (they fill the K/V buffers the stale steps read);
    ``chunk_bytes``: the largest single point-to-point message. Whether the patches fit the token count is known
    only at the call (it depends on the size), and is checked there.
    """
    for flag, value in zip(flags, (patches, warmup, chunk_bytes)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
            raise ConfigError(f"{flag}{value!r} is not an integer")
    if patches is not None and patches < pp:
        raise ConfigError(f"{flags[0]}{patches} is fewer than the pp={pp} stages; use at least {pp} patches "
                          "(every stage needs a patch to work on)")
    if warmup < 1:
        raise ConfigError(f"{flags[1]}{warmup} must be >= 1: the first step of a run fills the K/V buffers the stale "
                          "steps read; use 1 (default) or more")
    if chunk_bytes < 1:
        raise ConfigError(f"{flags[2]}{chunk_bytes} must be a positive byte count (default {PP_CHUNK_BYTES})")


def check_displaced(config: ParallelConfig, warmup, flag: str = "displaced_warmup=") -> None:
    """Raise :class:`ConfigError` unless displaced attention (``parallel.displaced``) can run on ``config``: its patches
    are the ulysses ranks' token chunks (ulysses > 1, ring = 1, no PipeFusion); ``warmup``: exact steps of each run,
    at least 1 (they fill the K/V buffers the stale steps read)."""
    if isinstance(warmup, bool) or not isinstance(warmup, int):
        raise ConfigError(f"{flag}{warmup!r} is not an integer")
    if warmup < 1:
        raise ConfigError(f"{flag}{warmup} must be >= 1: the first step of a run fills the K/V buffers the stale "
                          "steps read; use 1 (default) or more")
    if config.pp > 1:
        raise ConfigError(f"displaced attention and PipeFusion (pp={config.pp}) are two stale-K/V schemes; use one: "
                          f"pp=1 with displaced, or pp without displaced")
    if config.ring > 1:
        raise ConfigError(f"displaced attention gathers every rank's K/V and runs no ring; ring={config.ring} is set: "
                          f"use ring=1 and ulysses={config.sp}")
    if config.ulysses == 1:
        raise ConfigError("displaced attention needs ulysses > 1: its patches are the ulysses ranks' token chunks; "
                          "e.g. ulysses=4 with displaced")


#: what the sequence-parallel payloads travel as (``comm_dtype``): ``auto`` (the activations' dtype) or ``fp8``
#: (float8_e4m3fn with a float32 scale per token and head, ``comm.fp8_pack``)
COMM_DTYPES = ("auto", "fp8")
#: what computes softmax attention (``attention``): ``exact`` (the backend's kernels), ``int8`` (Q and K quantized to
#: int8 per token and head, the Triton kernel of ``attention.int8``; CUDA) or ``int8-emulated`` (the same rounding in
#: float32 math, on any device: for tests and quality measurements, slow)
ATTENTIONS = ("exact", "int8", "int8-emulated")


def check_eight_bit(config: ParallelConfig, comm_dtype: str = "auto", attention: str = "exact", bf16_steps: int = 0,
                    device_type: str | None = None, transport: str = "nccl", displaced: bool = False,
                    cuda_graph: bool = False) -> None:
    """Raise :class:`ConfigError` unless ``comm_dtype``, ``attention`` and ``bf16_steps`` (steps at each end of a run
    computed with exact attention) can run on ``config`` (and on ``device_type``, where known)."""
    if comm_dtype not in COMM_DTYPES:
        raise ConfigError(f"comm_dtype={comm_dtype!r} is not a payload dtype; use one of {', '.join(COMM_DTYPES)}")
    if attention not in ATTENTIONS:
        raise ConfigError(f"attention={attention!r} is not an attention; use one of {', '.join(ATTENTIONS)}")
    if isinstance(bf16_steps, bool) or not isinstance(bf16_steps, int) or bf16_steps < 0:
        raise ConfigError(f"attention_bf16_steps={bf16_steps!r} must be a step count >= 0 (0: every step in 8 bits)")
    if comm_dtype == "fp8":
        if config.sp == 1:
            raise ConfigError("comm_dtype=fp8 sends the sequence-parallel payloads (ulysses all-to-alls, ring K/V) in "
                              "fp8, and ulysses=ring=1 sends none; drop comm_dtype or set ulysses/ring > 1")
        if transport != "nccl":
            raise ConfigError(f"comm_dtype=fp8 packs the all-to-all payloads itself and transport={transport} moves "
                              "unpacked ones; use transport=nccl with fp8")
        if config.pp > 1 or displaced:
            what = f"PipeFusion (pp={config.pp})" if config.pp > 1 else "displaced attention"
            raise ConfigError(f"comm_dtype=fp8 does not run with {what} yet; drop one of them")
    if attention == "exact":
        if bf16_steps:
            raise ConfigError(f"attention_bf16_steps={bf16_steps} keeps steps out of 8-bit attention, and attention is "
                              "exact; drop it or use attention=int8")
        return
    if attention == "int8" and device_type is not None and device_type != "cuda":
        raise ConfigError(f"attention=int8 runs a Triton kernel on CUDA GPUs, and this rank runs on {device_type}; use "
                          "attention=exact (int8-emulated gives its rounding in float32 math, for measurements)")
    if config.ring > 1 or config.pp > 1 or displaced:
        what = f"ring={config.ring}" if config.ring > 1 else f"pp={config.pp}" if config.pp > 1 else "displaced"
        raise ConfigError(f"attention={attention} runs on one process or under ulysses alone, and {what} merges "
                          "partial attention over key chunks; use attention=exact there")
    if bf16_steps and cuda_graph:
        raise ConfigError(f"attention_bf16_steps={bf16_steps} switches attention per step on the host, which a CUDA "
                          "graph's replay does not see; drop one of them")
