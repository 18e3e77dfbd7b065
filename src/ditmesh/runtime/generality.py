"""The generality table: every transformer class a diffusers pipeline takes, and what ditmesh runs on it.

Walks the pipeline classes diffusers exports, reads the class annotated on each one's ``transformer`` argument, and
asks the family adapters (``ditmesh.models``) which axes each class gets. The README's table is this module's
output (``python -m ditmesh.runtime.generality --write README.md``); a test compares them, so the table cannot
drift from the code.
"""

from __future__ import annotations

import argparse
import inspect
import re
import sys
import warnings
from pathlib import Path

START, END = "<!-- generality:start -->", "<!-- generality:end -->"


def pipeline_transformers() -> dict[str, list[str]]:
    """Transformer class name -> the diffusers pipeline classes whose ``transformer`` argument takes it."""
    import diffusers

    found: dict[str, list[str]] = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for name in sorted(n for n in dir(diffusers) if n.endswith("Pipeline")):
            try:
                cls = getattr(diffusers, name)
                param = inspect.signature(cls.__init__).parameters.get("transformer")
            except Exception:  # noqa: BLE001  (a pipeline whose optional dependency is missing: not counted)
                continue
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
    return {
        "sequence": "ulysses, ring, USP" if adapter.sequence_plan is not None else "",
        "tp": "yes" if adapter.tensor_plan is not None else "",
        "cfg / dp": f"yes ({adapter.cfg_mode} CFG)",
        "step cache": ", ".join(caches) if adapter.blocks else "",
        "parallel VAE": "yes" if adapter.vae is not None else "",
        "PipeFusion": "yes" if _pipefusion_runs(adapter) else "",
    }


def _pipefusion_runs(adapter) -> bool:
    from ..options import family_allows, pipefusion_refusal

    return family_allows(pipefusion_refusal, adapter)


def rows() -> list[list[str]]:
    """One row per transformer class: class, pipelines, family (or what happens), then :func:`axes`' columns."""
    from ..models import adapter_for_class

    out = []
    for class_name, pipelines in sorted(pipeline_transformers().items()):
        shown = ", ".join(pipelines[:2]) + (f" (+{len(pipelines) - 2})" if len(pipelines) > 2 else "")
        try:
            adapter = adapter_for_class(class_name)
        except Exception:  # noqa: BLE001  (no adapter: refused before loading)
            out.append([f"`{class_name}`", shown, "no adapter: refused", "", "", "", "", "", ""])
            continue
        out.append([f"`{class_name}`", shown, adapter.name, *axes(adapter).values()])
    return out


def markdown() -> str:
    """The table, between the README's markers."""
    header = ["transformer class", "pipelines", "family", "sequence", "tp", "cfg / dp", "step cache", "parallel VAE",
              "PipeFusion"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in rows()]
    return "\n".join([START, *lines, END])


def replace_in(text: str, table: str) -> str:
    """``text`` with the part between the markers replaced by ``table`` (ValueError without the markers)."""
    start, end = text.find(START), text.find(END)
    if start < 0 or end < start:
        raise ValueError(f"no {START} ... {END} section to replace")
    return text[:start] + table + text[end + len(END):]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ditmesh.runtime.generality", description=__doc__.splitlines()[0])
    parser.add_argument("--write", metavar="FILE", help="replace the table between the markers of FILE")
    args = parser.parse_args(argv)
    table = markdown()
    if args.write:
        path = Path(args.write)
        path.write_text(replace_in(path.read_text(), table))
    else:
        print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
