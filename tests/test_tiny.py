"""The tiny trained pipeline: data grammar, checker, shipped weights, evaluation and training entry points."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch

from ditmesh.tiny import data, default_model_path, load_pipeline, read_meta

GRAMMAR = re.compile(
    r"^a (red|green|blue|yellow) (circle|square|triangle)"
    r"( at the (top left|top right|bottom left|bottom right|center))?( on a (white|black|gray) background)?$"
)


@pytest.fixture(scope="module")
def shipped():
    torch.set_num_threads(2)
    pipe = load_pipeline()
    pipe.set_progress_bar_config(disable=True)
    return pipe


def test_every_caption_follows_the_grammar_and_parses_back_to_its_scene():
    scenes = data.all_scenes()
    assert len(scenes) == 4 * 3 * 5 * 3
    for scene in scenes:
        for text in scene.captions():
            assert GRAMMAR.match(text), text
            assert data.parse_caption(text) == scene
    assert data.parse_caption("a blue square") == data.Scene("blue", "square", "center", "white")
    with pytest.raises(ValueError):
        data.parse_caption("a purple circle")


def test_dataset_is_deterministic_per_seed():
    a, scenes_a = data.sample_dataset(data.all_scenes(), 16, seed=3)
    b, scenes_b = data.sample_dataset(data.all_scenes(), 16, seed=3)
    c, _ = data.sample_dataset(data.all_scenes(), 16, seed=4)
    assert a.shape == (16, 64, 64, 3) and a.dtype == np.uint8
    assert np.array_equal(a, b) and scenes_a == scenes_b
    assert not np.array_equal(a, c)


def test_held_out_scenes_are_unseen_but_every_word_is_trained():
    train, held = data.split_scenes(0)
    assert held and not set(train) & set(held)
    for attr, values in [("colour", data.COLOURS), ("shape", data.SHAPES), ("position", data.POSITIONS), ("background", data.BACKGROUNDS)]:
        assert {getattr(s, attr) for s in train} == set(values)


def test_checker_reads_ground_truth_images_even_with_noise():
    images, scenes = data.sample_dataset(data.all_scenes(), 400, seed=11)
    noisy = np.clip(images + np.random.default_rng(0).normal(0, 15, images.shape), 0, 255).astype(np.uint8)
    for batch in (images, noisy):
        readings = [data.classify(img) for img in batch]
        assert [(r.colour, r.shape, r.position, r.background) for r in readings] == [
            (s.colour, s.shape, s.position, s.background) for s in scenes
        ]
    blank = np.full((64, 64, 3), 255, np.uint8)
    assert data.classify(blank).shape is None


def test_shipped_pipeline_loads_with_from_pretrained_and_draws_64x64(shipped):
    meta = read_meta()
    assert meta["default_size"] == [64, 64]
    heads = shipped.transformer.config.num_attention_heads
    assert heads % 4 == 0 and heads % 2 == 0  # ulysses 2/4 and tp 2 divide the heads
    image = shipped("a red circle at the top left", height=64, width=64, num_inference_steps=4,
                    max_sequence_length=meta["max_sequence_length"], generator=torch.Generator().manual_seed(0)).images[0]
    assert image.size == (64, 64)


def test_shipped_weights_fit_the_size_budget():
    from pathlib import Path

    total = sum(p.stat().st_size for p in Path(default_model_path()).rglob("*") if p.is_file())
    assert total <= 25 * 2**20


def test_small_evaluation_runs_and_reports_accuracies(shipped):
    from ditmesh.tiny.evaluate import eval_captions, evaluate

    captions = eval_captions()[:8]
    result = evaluate(captions=captions, steps=8, images_per_caption=1, pipe=shipped)
    assert result.n == 8 and len(result.rows) == 8
    assert set(result.accuracy) == {"colour", "shape", "position", "all"}
    assert all(0.0 <= v <= 1.0 for v in result.accuracy.values())
    assert result.accuracy["colour"] >= 0.75  # the shipped weights follow the caption's colour


def test_train_entry_point_writes_a_loadable_pipeline(tmp_path):
    import argparse

    from diffusers import FluxPipeline

    from ditmesh.tiny.train import add_train_parser

    parser = argparse.ArgumentParser()
    add_train_parser(parser.add_subparsers())
    args = parser.parse_args(["train-tiny", "--out", str(tmp_path / "pipe"), "--work-dir", str(tmp_path / "work"),
                              "--vae-steps", "2", "--decoder-steps", "2", "--vae-batch", "4", "--latent-images", "32", "--dit-steps", "2",
                              "--dit-batch", "4", "--warmup", "1", "--checkpoint-every", "1"])
    assert args.func(args) == 0
    pipe = FluxPipeline.from_pretrained(str(tmp_path / "pipe"))
    assert pipe.transformer.config.num_attention_heads == 8
    assert read_meta(str(tmp_path / "pipe"))["max_sequence_length"] == 16


def test_against_reference_counts_and_names_each_image_that_lost_an_attribute():
    from ditmesh.tiny.evaluate import against_reference

    scenes = [data.Scene("red", "circle"), data.Scene("blue", "square", "top left"), data.Scene("green", "triangle")]
    prompts = [s.captions()[0] for s in scenes]
    reference = np.stack([data.render(s) for s in scenes])
    images = reference.copy()
    images[1] = data.render(data.Scene("blue", "circle", "top left"))  # the square read as a circle: lost
    images[2] = data.render(data.Scene("green", "triangle", "top left"))  # moved: lost its position
    wrong_ref = reference.copy()
    wrong_ref[2] = data.render(data.Scene("green", "triangle", "top left"))  # the reference already had it wrong
    same = against_reference(reference, reference, prompts)
    assert same["lost"] == 0 and same["lost_images"] == [] and same["psnr"] == float("inf")
    row = against_reference(images, reference, prompts)
    assert row["lost"] == 2
    assert [(e["image"], e["attribute"], e["want"], e["got"]) for e in row["lost_images"]] == [
        (1, "shape", "square", "circle"), (2, "position", "center", "top left")]
    assert all(e["psnr"] < 30 for e in row["lost_images"])
    assert against_reference(images, wrong_ref, prompts)["lost"] == 1  # an attribute the reference missed is not lost
