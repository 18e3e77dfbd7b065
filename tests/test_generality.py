"""The README's generality table is what the code gives: every transformer class of diffusers' pipelines, the
family adapter that runs it (or none) and its axes."""

from __future__ import annotations

from pathlib import Path

README = Path(__file__).resolve().parent.parent / "README.md"


def test_the_readme_table_is_the_generated_one():
    from ditmesh.runtime.generality import END, START, markdown

    text = README.read_text()
    section = text[text.index(START):text.index(END) + len(END)]
    assert section == markdown(), "regenerate it: python -m ditmesh.runtime.generality --write README.md"


def test_every_registered_family_appears_with_its_axes_and_unknown_classes_are_refused():
    from ditmesh.models import supported_classes
    from ditmesh.runtime.generality import pipeline_transformers, rows

    walked = pipeline_transformers()
    assert {"FluxTransformer2DModel", "WanTransformer3DModel", "SD3Transformer2DModel"} <= set(walked)
    by_class = {row[0].strip("`"): row for row in rows()}
    for class_name in supported_classes():
        if class_name in walked:
            assert by_class[class_name][3] == "ulysses, ring, USP", by_class[class_name]
    refused = [row for name, row in by_class.items() if name not in supported_classes()]
    assert refused and all(row[2] == "no adapter: refused" for row in refused)
