"""`ParallelConfig`: the degrees of every parallel dimension, validated once.

The config is a frozen value object: it never carries runtime state (ranks, groups, meshes).
Runtime state lives in :class:`ditmesh.mesh.ParallelMesh`.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, fields
from pathlib import Path


def cache_dir() -> Path:
    """Where ditmesh keeps what it makes once for later runs: synthesized checkpoints, compile caches, compiled
    blocks (``$DITMESH_CACHE`` or ``~/.cache/ditmesh``)."""
    return Path(os.environ.get("DITMESH_CACHE", Path.home() / ".cache" / "ditmesh"))


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


def require_extra(what: str, extra: str, modules: tuple[str, ...], load: bool = False) -> None:
    """Raise :class:`ConfigError` (one line naming ``pip install 'ditmesh[extra]'``) when ``what`` needs a module of
    the optional extra ``extra`` that is not installed. Each of ``modules`` is looked up (nothing imported); with
    ``load`` they are then imported too, so that an install that raises ImportError is caught before anything
    starts."""
    import importlib
    import importlib.util

    for loading in (False, True) if load else (False,):  # every look-up first: a missing module is said at once
        for module in modules:
            try:
                found = importlib.import_module(module) if loading else importlib.util.find_spec(module)
            except (ImportError, ValueError):
                found = None
            if found is None:
                raise ConfigError(f"{what} needs {module}, which is not installed here: pip install 'ditmesh[{extra}]'")


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
            given = (f"the degrees {self.describe()} multiply to {self.world_size}" if self.active_axes() else
                     "every degree is 1 (one process's work)")
            raise ConfigError(
                f"{given}, but there are {world_size} processes; make the product of --dp --cfg --pp --ring "
                f"--ulysses --tp equal the process count" + ("" if self.active_axes() else f" (e.g. --ulysses {world_size})")
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


#: the largest single point-to-point message PipeFusion sends by default; bigger tensors travel in pieces
PP_CHUNK_BYTES = 64 << 20
