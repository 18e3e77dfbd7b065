"""What a new user meets first: the set-up commands, the README's commands, ``--model`` as ``generate`` and ``plan``
take it, the generality table's gaps and the tensor-parallel rule as the docs state them. Each test is one defect a
new user found, kept fixed."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def test_the_docs_use_the_hf_command_the_installed_huggingface_hub_ships():
    # huggingface_hub ships `hf` (hf auth login, hf download); `huggingface-cli` is not installed with it
    hf = Path(sys.executable).with_name("hf")
    assert hf.exists() or shutil.which("hf"), "huggingface_hub's `hf` command is missing"
    stale = [str(p.relative_to(ROOT)) for p in DOCS if "huggingface-cli" in p.read_text()]
    assert not stale, f"docs still say huggingface-cli: {stale}"
    readme = (ROOT / "README.md").read_text()
    assert "hf auth login" in readme and "hf download" in readme


def test_no_wheel_or_other_package_file_is_tracked():
    # a pyflakes wheel once sat in the root; nothing uses it (no linter reads it), so nothing is installed from it
    tracked = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    assert not [f for f in tracked if f.endswith((".whl", ".tar.gz", ".egg"))]


def _make_dry_run(target: str, tmp_path: Path) -> str:
    venv = tmp_path / "venv"  # a venv that does not exist: make prints every set-up step it would run
    return subprocess.run(["make", "-n", target, f"VENV={venv}"], cwd=ROOT, capture_output=True, text=True,
                          check=True).stdout


@pytest.mark.skipif(shutil.which("make") is None, reason="make is not installed")
def test_make_demo_installs_ditmesh_without_the_test_extra_and_make_test_adds_it(tmp_path):
    demo, test = _make_dry_run("demo", tmp_path), _make_dry_run("test", tmp_path)
    assert "pip install -q -e ." in demo and "[test]" not in demo and "ditmesh generate" in demo
    assert "pip install -q -e \".[test]\"" in test and "pytest" in test


@pytest.mark.skipif(shutil.which("make") is None, reason="make is not installed")
@pytest.mark.parametrize("tests, code, says", [("empty", 1, "ci: pytest collected no tests; failing"),
                                               ("test_passes.py", 0, "1 passed"),
                                               ("test_fails.py", 2, "1 failed")])
def test_ci_fails_when_pytest_collects_nothing(tmp_path, tests, code, says):
    # make returns 2 for any failing recipe; .ci/run reads pytest's own exit code (5: nothing collected)
    (tmp_path / "empty").mkdir()
    (tmp_path / "test_passes.py").write_text("def test_ok():\n    pass\n")
    (tmp_path / "test_fails.py").write_text("def test_not_ok():\n    assert False\n")
    stamps = [tmp_path / "base-stamp", tmp_path / "test-stamp"]
    for stamp in stamps:  # set-up done: in that order, each newer than the Makefile and pyproject.toml
        stamp.touch()
    proc = subprocess.run([str(ROOT / ".ci" / "run"), f"PY={sys.executable}", f"BASE_STAMP={stamps[0]}",
                           f"TEST_STAMP={stamps[1]}", f"TESTS={tmp_path / tests}"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == code and says in proc.stdout + proc.stderr, proc.stdout + proc.stderr


def test_a_file_given_as_model_is_called_a_file_before_torch_loads(tmp_path):
    weights = tmp_path / "some.txt"
    weights.write_text("not a pipeline")
    code = ("import sys; from ditmesh.cli import main; rc = main(['generate', '--model', sys.argv[1]]); "
            "print(rc, 'torch' in sys.modules)")
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"))
    proc = subprocess.run([sys.executable, "-c", code, str(weights)], capture_output=True, text=True, env=env,
                          cwd=tmp_path, timeout=120)
    assert proc.stdout.split() == ["2", "False"], proc.stdout + proc.stderr
    error = proc.stderr.strip().splitlines()
    assert len(error) == 1 and f"--model {weights}: is a file; give the pipeline folder that holds model_index.json" \
        in error[0], error
    assert list(tmp_path.iterdir()) == [weights]  # nothing written


def _fake_hub_cache(root: Path, repo: str, arch: str) -> None:
    """A Hugging Face cache holding what ``plan`` reads of hub model ``repo``: its configurations, no weights."""
    from ditmesh.synth import ARCHS

    a = ARCHS[arch]
    commit = "0" * 40
    folder = root / f"models--{repo.replace('/', '--')}"
    snapshot = folder / "snapshots" / commit
    (snapshot / "transformer").mkdir(parents=True)
    (snapshot / "transformer" / "config.json").write_text(json.dumps(dict(a.transformer,
                                                                          _class_name=a.transformer_class)))
    (snapshot / "model_index.json").write_text(json.dumps({"_class_name": a.pipeline,
                                                           "transformer": ["diffusers", a.transformer_class]}))
    (folder / "refs").mkdir()
    (folder / "refs" / "main").write_text(commit)


@pytest.fixture
def offline_hub(tmp_path, monkeypatch):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    return tmp_path / "hub"


def test_plan_takes_a_hub_id_as_generate_does(offline_hub, capsys):
    from ditmesh.cli import main

    _fake_hub_cache(offline_hub, "acme/flux-like", "flux-tiny")
    assert main(["plan", "--model", "acme/flux-like", "--gpus", "2", "--top", "0", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["model"]["class"] == "FluxTransformer2DModel" and result["recommendation"]


def test_plan_names_a_hub_id_it_cannot_read_in_one_line(offline_hub, capsys):
    from ditmesh.cli import main

    assert main(["plan", "--model", "acme/not-cached", "--gpus", "2"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("ditmesh plan: error: --model acme/not-cached: could not read "
                                               "transformer/config.json of this hub id"), err
    assert "hf download acme/not-cached --local-dir DIR" in err[0]


def test_generality_lists_the_pipelines_it_could_not_read_with_the_missing_dependency():
    import diffusers

    from ditmesh.runtime.generality import markdown, unreadable_pipelines

    placeholders = {name for name in dir(diffusers) if name.endswith("Pipeline")
                    and getattr(diffusers, name).__module__.startswith("diffusers.utils.dummy_")}
    listed = unreadable_pipelines()
    assert set(listed) == placeholders and all(listed.values())
    table = markdown()
    for name, missing in listed.items():
        assert f"| {name} | {', '.join(missing)} |" in table
    try:
        import cv2  # noqa: F401
    except ImportError:  # ConsisID's transformer is behind opencv
        assert listed["ConsisIDPipeline"] == ["opencv"]


def test_tp_must_divide_the_feed_forward_widths_too_not_only_the_heads():
    # wan-tiny: 6 heads (tp 3 divides them) but a 128-wide feed-forward (tp 3 does not): refused, naming the layer
    # and the degrees that divide every split width
    import diffusers
    import torch

    from ditmesh import ConfigError, ParallelConfig
    from ditmesh.models import adapter_for_class
    from ditmesh.parallel.tensor import resolve_plan
    from ditmesh.synth import ARCHS

    arch = ARCHS["wan-tiny"]
    ParallelConfig(tp=3).check_heads(arch.transformer["num_attention_heads"], arch.transformer_class)
    with torch.device("meta"):
        model = getattr(diffusers, arch.transformer_class)(**arch.transformer)
    plan = adapter_for_class(arch.transformer_class).tensor_plan
    with pytest.raises(ConfigError, match=re.escape("tp=3 does not divide the colwise dimension (128,) of "
                                                    "blocks.0.ffn.net.0.proj") + r".*valid here: 1, 2$"):
        resolve_plan(model, plan, 3)
    assert resolve_plan(model, plan, 2)


def test_the_readme_fits_a_screen_and_the_architecture_map_reads_in_ten_minutes():
    readme = (ROOT / "README.md").read_text().splitlines()
    assert len(readme) <= 200 and len((ROOT / "docs" / "architecture.md").read_text().splitlines()) <= 400
    first_screen = "\n".join(readme[:45])  # the two set-up commands and the CPU quick start
    assert "make demo" in first_screen and "make test" in first_screen
    assert re.search(r"ditmesh generate --nproc 2 --ulysses 2", first_screen)


def test_every_relative_link_of_the_docs_resolves():
    broken = []
    for doc in DOCS:
        for target in re.findall(r"\]\(([^)\s#]+)(?:#[^)\s]*)?\)", doc.read_text()):
            if target.startswith(("http://", "https://", "mailto:")):
                continue
            path = (doc.parent / target).resolve()
            if not path.exists():
                broken.append(f"{doc.relative_to(ROOT)} -> {target}")
    assert not broken, broken
