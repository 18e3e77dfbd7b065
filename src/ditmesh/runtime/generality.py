"""The generality table: every transformer class a diffusers pipeline takes, and what ditmesh runs on it.

Walks the pipeline classes diffusers exports, reads the class annotated on each one's ``transformer`` argument, and
asks the family adapters (``ditmesh.models``) which axes each class gets. A pipeline diffusers exports only as a
placeholder, because an optional dependency of it is missing here (ConsisID without opencv), is listed with the
dependency it lacks: its transformer class cannot be read.

Two tables come out, each between its markers: the families ditmesh runs (README.md, :data:`FAMILIES`) and every
class with the pipelines not read (docs/models.md, :data:`GENERALITY`). ``python -m ditmesh.runtime.generality
--write README.md docs/models.md`` rewrites them; a test compares them, so the tables cannot drift from the code.
"""

from __future__ import annotations

import argparse
import inspect
import re
import sys
import warnings
from pathlib import Path

#: the markers of the whole table (every transformer class) and of the families-only one
GENERALITY = ("<!-- generality:start -->", "<!-- generality:end -->")
FAMILIES = ("<!-- families:start -->", "<!-- families:end -->")
START, END = GENERALITY


def _pipeline_classes() -> list[tuple[str, type]]:
    import diffusers

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        names = sorted(n for n in dir(diffusers) if n.endswith("Pipeline"))
        return [(name, getattr(diffusers, name)) for name in names]


def missing_backends(cls: type) -> list[str]:
    """The optional dependencies a diffusers placeholder class lacks here ([] for a real class).

    diffusers exports a pipeline whose dependencies are not installed as a placeholder from one of its
    ``utils.dummy_*`` modules, with the dependencies in ``_backends`` and a ``__init__`` that takes anything."""
    if not cls.__module__.startswith("diffusers.utils.dummy_"):
        return []
    from diffusers.utils.import_utils import BACKENDS_MAPPING

    backends = getattr(cls, "_backends", [])
    return [b for b in backends if b in BACKENDS_MAPPING and not BACKENDS_MAPPING[b][0]()] or list(backends)


def unreadable_pipelines() -> dict[str, list[str]]:
    """Pipeline class name -> the optional dependencies it lacks here, for every pipeline exported as a placeholder."""
    return {name: missing for name, cls in _pipeline_classes() if (missing := missing_backends(cls))}


def pipeline_transformers() -> dict[str, list[str]]:
    """Transformer class name -> the diffusers pipeline classes whose ``transformer`` argument takes it (pipelines
    exported as placeholders are left to :func:`unreadable_pipelines`)."""
    found: dict[str, list[str]] = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for name, cls in _pipeline_classes():
            if missing_backends(cls):
                continue
            param = inspect.signature(cls.__init__).parameters.get("transformer")
            if param is None or param.annotation is inspect.Parameter.empty:
                continue
            annotation = param.annotation if isinstance(param.annotation, str) else repr(param.annotation)
            for class_name in re.findall(r"\b([A-Z]\w*(?:Transformer\w*|DiT\w*|Model))\b", annotation):
                if class_name != "ModelMixin":
                    found.setdefault(class_name, []).append(name)
    return found


def axes(adapter) -> dict[str, str]:
    """What ditmesh runs on a family's transformer, by column of the table."""
    caches = ["dbcache", "static", "taylor"] + (["teacache"] if adapter.modulated_input is not None else [])
    sequence = "ulysses" if adapter.ring_refusal else "ulysses, ring, USP"  # Kandinsky 6 SR: ulysses only
    return {
        "sequence": sequence if adapter.sequence_plan is not None else "",
        "tp": "yes" if adapter.tensor_plan is not None else "",
        "cfg / dp": "" if adapter.batch_refusal else
        ("dp only (cfg refused)" if adapter.cfg_refusal else f"yes ({adapter.cfg_mode} CFG)"),
        "step cache": ", ".join(caches) if adapter.blocks and not adapter.cache_refusal else "",
        "parallel VAE": "yes" if adapter.vae is not None else "",
        "PipeFusion": "yes" if _pipefusion_runs(adapter) else "",
    }


def _pipefusion_runs(adapter) -> bool:
    from ..options import family_allows, pipefusion_refusal

    return family_allows(pipefusion_refusal, adapter)


def rows() -> list[list[str]]:
    """One row per transformer class: class, pipelines, family (or what happens), then :func:`axes`' columns."""
    from ..models import adapter_for_class
    from ..models.registry import CLASSES

    out = []
    for class_name, pipelines in sorted(pipeline_transformers().items()):
        shown = ", ".join(pipelines[:2]) + (f" (+{len(pipelines) - 2})" if len(pipelines) > 2 else "")
        if class_name not in CLASSES:
            out.append([f"`{class_name}`", shown, refused_cell(class_name), "", "", "", "", "", ""])
            continue
        adapter = adapter_for_class(class_name)
        out.append([f"`{class_name}`", shown, adapter.name, *axes(adapter).values()])
    return out


#: the family cell of a class without an adapter that neither refusal table names (a class newer than the tables)
NO_ADAPTER = "no adapter: refused"


def refused_cell(class_name: str) -> str:
    """The family cell of a class ditmesh refuses: why, from the registry's :data:`~ditmesh.models.registry.NOT_DITS`
    (not a DiT over tokens) or :data:`~ditmesh.models.registry.NOT_ADAPTED` (a DiT without an adapter yet)."""
    from ..models.registry import NOT_ADAPTED, NOT_DITS

    if class_name in NOT_DITS:
        return f"refused, not a DiT over tokens: {NOT_DITS[class_name]}"
    if class_name in NOT_ADAPTED:
        return f"refused, not adapted yet: {NOT_ADAPTED[class_name]}"
    return NO_ADAPTER

HEADER = ["transformer class", "pipelines", "family", "sequence", "tp", "cfg / dp", "step cache", "parallel VAE",
          "PipeFusion"]


def _table(header: list[str], body: list[list[str]]) -> list[str]:
    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)] + ["| " + " | ".join(r) + " |" for r in body]


def markdown() -> str:
    """The whole table (every transformer class, then the pipelines not read), between the :data:`GENERALITY`
    markers."""
    lines = _table(HEADER, rows())
    unreadable = unreadable_pipelines()
    if unreadable:
        lines += ["", "Pipelines diffusers exports here only as placeholders, because an optional dependency is "
                  "missing (their transformer class cannot be read; install the dependency and regenerate):", ""]
        lines += _table(["pipeline", "missing dependency"],
                        [[name, ", ".join(missing)] for name, missing in sorted(unreadable.items())])
    return "\n".join([GENERALITY[0], *lines, GENERALITY[1]])


def families_markdown() -> str:
    """The families ditmesh runs, one row each with its transformer classes, between the :data:`FAMILIES` markers."""
    by_family: dict[str, list[list[str]]] = {}
    for row in rows():
        if not row[2].startswith(("refused", NO_ADAPTER)):
            by_family.setdefault(row[2], []).append(row)
    header = ["family", "transformer", "sequence", "tp", "cfg / dp", "step cache", "parallel VAE", "PipeFusion"]
    body = [[family, ", ".join(r[0] for r in group), *group[0][3:]] for family, group in sorted(by_family.items())]
    return "\n".join([FAMILIES[0], *_table(header, body), FAMILIES[1]])


def replace_in(text: str, table: str, markers: tuple[str, str] = GENERALITY) -> str:
    """``text`` with the part between ``markers`` replaced by ``table`` (ValueError without the markers)."""
    start, end = text.find(markers[0]), text.find(markers[1])
    if start < 0 or end < start:
        raise ValueError(f"no {markers[0]} ... {markers[1]} section to replace")
    return text[:start] + table + text[end + len(markers[1]):]


def rewrite(text: str) -> str:
    """``text`` with every table whose markers it holds regenerated (ValueError when it holds none)."""
    tables = [(markers, make) for markers, make in ((GENERALITY, markdown), (FAMILIES, families_markdown))
              if markers[0] in text]
    if not tables:
        raise ValueError(f"no {GENERALITY[0]} or {FAMILIES[0]} section to replace")
    for markers, make in tables:
        text = replace_in(text, make(), markers)
    return text


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ditmesh.runtime.generality", description=__doc__.splitlines()[0])
    parser.add_argument("--write", metavar="FILE", nargs="+", help="replace the tables between the markers of FILE")
    args = parser.parse_args(argv)
    for name in args.write or []:
        path = Path(name)
        path.write_text(rewrite(path.read_text()))
    if not args.write:
        print(markdown())
    return 0


if __name__ == "__main__":
    sys.exit(main())
