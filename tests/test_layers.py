"""The source's shape: the core never imports the tools, no import cycles, and only models/ knows a family.

These walk the source with ``ast`` (every import, also those inside functions), so they hold without
importing anything.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parent.parent / "src" / "ditmesh"

#: the library: what ``parallelize`` needs. Everything else is a tool built on it.
CORE = {"__init__", "aot", "api", "config", "mesh", "comm", "hooks", "attention", "parallel", "models", "fusion", "symm",
        "profiling", "redundancy", "cache", "options", "timeline"}
TOOLS = {"cli", "__main__", "runtime", "bench", "planner", "synth", "tiny", "shared", "testing", "analyze", "serve", "quantize", "png"}

#: where naming a family is allowed: its adapter, the tiny trained FLUX pipeline, and the benchmark's peer drivers
FAMILY_HOMES = ("models/", "tiny/", "bench/peers.py")


def unit_of(path: Path) -> str:
    """The top-level module or subpackage a source file belongs to (``parallel/tensor.py`` -> ``parallel``)."""
    rel = path.relative_to(SRC)
    return rel.parts[0] if len(rel.parts) > 1 else rel.stem


def imported_units(path: Path) -> set[str]:
    """The other ditmesh units a file imports (relative and absolute imports, at any depth)."""
    tree = ast.parse(path.read_text())
    package = ["ditmesh", *path.relative_to(SRC).parent.parts]
    modules = []  # absolute dotted names, as lists
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else []
            module = base + (node.module.split(".") if node.module else [])
            modules += [module + [alias.name] for alias in node.names]  # "from . import x" imports module x
        elif isinstance(node, ast.Import):
            modules += [alias.name.split(".") for alias in node.names]
    units = {m[1] for m in modules if len(m) > 1 and m[0] == "ditmesh"}
    known = {unit_of(p) for p in sources()}
    return (units & known) - {unit_of(path)}


def sources() -> list[Path]:
    return sorted(p for p in SRC.rglob("*.py") if "assets" not in p.parts)


def test_every_unit_is_either_core_or_a_tool():
    units = {unit_of(p) for p in sources()}
    assert units == CORE | TOOLS, f"classify the new units: {sorted(units ^ (CORE | TOOLS))}"


def test_the_core_imports_no_tool():
    offenders = [(str(p.relative_to(SRC)), sorted(imported_units(p) & TOOLS))
                 for p in sources() if unit_of(p) in CORE and imported_units(p) & TOOLS]
    assert not offenders, f"core modules import tools: {offenders}"


def test_only_the_bench_worker_imports_the_peers():
    # the peers (diffusers' and xDiT's parallelism) stay off the library's import path: ``import ditmesh`` or
    # ``ditmesh.bench`` never loads them, a worker process does for its peer row
    peers = SRC / "bench" / "peers.py"
    importers = []
    for p in sources():
        tree = ast.parse(p.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                base = p.parent if node.level else SRC.parent
                for _ in range(max(node.level - 1, 0)):
                    base = base.parent
                target = base.joinpath(*(node.module or "").split("."))
                names = [target / alias.name for alias in node.names] + [target]
                if any(n.with_suffix(".py") == peers for n in names):
                    importers.append((str(p.relative_to(SRC)), node.col_offset))
    assert importers and all(path == "bench/worker.py" and indent > 0 for path, indent in importers), importers


def test_units_import_each_other_without_cycles():
    graph: dict[str, set[str]] = {}
    for p in sources():
        graph.setdefault(unit_of(p), set()).update(imported_units(p) - {"__init__"})
    # depth-first search for a back edge
    state: dict[str, int] = {}

    def visit(unit: str, trail: list[str]) -> list[str] | None:
        state[unit] = 1
        for dep in sorted(graph.get(unit, ())):
            if state.get(dep) == 1:
                return trail + [unit, dep]
            if dep not in state:
                found = visit(dep, trail + [unit])
                if found:
                    return found
        state[unit] = 2
        return None

    for unit in sorted(graph):
        if unit not in state:
            cycle = visit(unit, [])
            assert cycle is None, f"import cycle: {' -> '.join(cycle)}"


def family_words() -> tuple[re.Pattern, set[str]]:
    """A regex of every family's class names and class-name prefixes, and the adapters' names."""
    from ditmesh.models import adapters

    names, prefixes = set(), set()
    for adapter in adapters():
        names.update(adapter.class_names + adapter.pipelines + adapter.attention.class_names)
        for cls in adapter.class_names:
            prefix = re.match(r"[A-Z0-9]+(?=[A-Z][a-z])|[A-Z][a-z0-9]+", cls).group()
            if len(prefix) <= 2:  # one or two letters name no family: Z-Image's "Z" takes its next word, "ZImage";
                # DiT's "Di" would be the generic "DiT": it takes "DiTTransformer2"
                prefix = re.match(r"[A-Z]+[a-z0-9]*[A-Z]+[a-z0-9]+", cls).group()
            prefixes.add(prefix)
    words = sorted(names | prefixes, key=len, reverse=True)
    # a family word not glued to other lowercase letters ("Wan" but not "Wanted"); "Attention" alone is a
    # generic diffusers class that SD3 happens to use, so only the family-specific names count
    words = [w for w in words if w != "Attention"]
    return re.compile(r"(?<![A-Za-z])(" + "|".join(map(re.escape, words)) + r")(?![a-z])"), {a.name for a in adapters()}


def family_mentions(path: Path, pattern: re.Pattern, adapter_names: set[str]) -> list[str]:
    """Identifiers and (non-docstring) string constants of a file that name a family."""
    tree = ast.parse(path.read_text())
    docstrings = {id(node.body[0].value) for node in ast.walk(tree)
                  if isinstance(node, (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
                  and node.body and isinstance(node.body[0], ast.Expr) and isinstance(node.body[0].value, ast.Constant)}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
            if pattern.search(node.value) or node.value in adapter_names:
                found.append(f"{node.lineno}: {node.value[:60]!r}")
        elif isinstance(node, ast.Name) and pattern.search(node.id):
            found.append(f"{node.lineno}: {node.id}")
        elif isinstance(node, ast.Attribute) and pattern.search(node.attr):
            found.append(f"{node.lineno}: .{node.attr}")
        elif isinstance(node, ast.alias) and pattern.search(node.name):
            found.append(f"import {node.name}")
    return found


def test_only_the_model_adapters_name_a_family():
    pattern, adapter_names = family_words()
    offenders = {}
    for p in sources():
        rel = str(p.relative_to(SRC))
        if rel.startswith(FAMILY_HOMES):
            continue
        mentions = family_mentions(p, pattern, adapter_names)
        if mentions:
            offenders[rel] = mentions
    assert not offenders, f"family knowledge outside models/: {offenders}"


@pytest.mark.parametrize("snippet, expected", [
    ('if cls.startswith("Flux"):\n    pass\n', True),
    ('x = pipe.FluxPipeline\n', True),
    ('family = "wan"\n', True),
    ('"""Docstrings may say FluxPipeline."""\n', False),
    ('model = "flux-tiny"\n', False),
    ('text = "Wanted"\n', False),
])
def test_the_family_walk_catches_branches_on_a_family(tmp_path, snippet, expected):
    # the walk itself must be able to fail: a planted branch on a family is found, docstrings and
    # architecture names are not
    pattern, adapter_names = family_words()
    f = tmp_path / "planted.py"
    f.write_text(snippet)
    assert bool(family_mentions(f, pattern, adapter_names)) is expected


def test_the_import_walk_sees_function_level_imports(tmp_path):
    planted = SRC / "parallel" / "_planted_for_test.py"
    planted.write_text("def f():\n    from ..runtime import generate\n    from ditmesh.synth import ARCHS\n")
    try:
        assert imported_units(planted) == {"runtime", "synth"}
    finally:
        planted.unlink()
