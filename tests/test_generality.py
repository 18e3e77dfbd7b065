"""The generality tables (README.md, docs/models.md) are what the code gives: every transformer class of diffusers'
pipelines, the family adapter that runs it (or none) and its axes."""

from __future__ import annotations

from pathlib import Path

import re

import pytest

ROOT = Path(__file__).resolve().parent.parent


def test_the_tables_are_the_generated_ones():
    # README.md: the families ditmesh runs; docs/models.md: every transformer class, and the pipelines not readable
    from ditmesh.runtime.generality import FAMILIES, GENERALITY, families_markdown, markdown

    for name, (start, end), make in (("README.md", FAMILIES, families_markdown),
                                     ("docs/models.md", GENERALITY, markdown)):
        text = (ROOT / name).read_text()
        section = text[text.index(start):text.index(end) + len(end)]
        assert section == make(), "regenerate: python -m ditmesh.runtime.generality --write README.md docs/models.md"


def test_every_registered_family_appears_with_its_axes_and_unknown_classes_are_refused():
    from ditmesh.models import adapter_for_class, supported_classes
    from ditmesh.runtime.generality import pipeline_transformers, rows

    walked = pipeline_transformers()
    assert {"FluxTransformer2DModel", "WanTransformer3DModel", "SD3Transformer2DModel"} <= set(walked)
    by_class = {row[0].strip("`"): row for row in rows()}
    for class_name in supported_classes():
        if class_name in walked:
            ring = adapter_for_class(class_name).ring_refusal is None  # Kandinsky 6 SR: ulysses only
            assert by_class[class_name][3] == ("ulysses, ring, USP" if ring else "ulysses"), by_class[class_name]
    from ditmesh.models.registry import NOT_ADAPTED, NOT_DITS

    # every class a pipeline takes has a family or a reason: none is left at the bare "no adapter"
    refused = {name: row[2] for name, row in by_class.items() if name not in supported_classes()}
    assert refused and set(refused) <= set(NOT_DITS) | set(NOT_ADAPTED), set(refused) - set(NOT_DITS) - set(NOT_ADAPTED)
    # a class that is not a DiT over tokens says why, and so does a DiT not adapted yet; asking for the adapter of
    # either says the same in one line
    assert all(refused[name] == f"refused, not a DiT over tokens: {why}" for name, why in NOT_DITS.items())
    assert all(refused[name] == f"refused, not adapted yet: {why}" for name, why in NOT_ADAPTED.items())

    with pytest.raises(NotImplementedError, match="does not parallelize UVit2DModel: aMUSEd's U-ViT"):
        adapter_for_class("UVit2DModel")
    for name, why in list(NOT_ADAPTED.items())[:1]:  # whichever DiT is still waiting for its adapter
        with pytest.raises(NotImplementedError, match=re.escape(f"no adapter for {name} yet: {why[:40]}")):
            adapter_for_class(name)
