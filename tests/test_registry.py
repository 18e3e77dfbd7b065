"""The registry of families (``ditmesh.models.registry``): its tables say what the adapters register, and it lets
ditmesh import only the family a model needs (and no torch where no model is needed)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from ditmesh.models import registry

SRC = Path(__file__).resolve().parent.parent / "src"


def _python(code: str) -> str:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")]))
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env).stdout


def test_tables_match_what_the_adapters_register():
    """Every family imported: each class maps to the module whose ``register`` call made its adapter; every synthetic
    architecture to its family and description; each VAE class to the first plan (in the table's order) naming it."""
    import importlib
    import pkgutil
    import re

    import ditmesh.models
    from ditmesh.models import base

    for info in pkgutil.iter_modules(ditmesh.models.__path__):
        importlib.import_module(f"ditmesh.models.{info.name}")
    assert set(registry.CLASSES) == set(base._REGISTRY)
    for cls, module in registry.CLASSES.items():
        source = (SRC / "ditmesh" / "models" / f"{module}.py").read_text()
        registered = [getattr(sys.modules[f"ditmesh.models.{module}"], name)
                      for name in re.findall(r"^(\w+) = register\(", source, re.M)]
        assert any(adapter is base._REGISTRY[cls] for adapter in registered), (cls, module)
    adapters = base.adapters()
    archs = {arch.name: (adapter, arch) for adapter in adapters for arch in adapter.synth_archs}
    assert list(archs) == list(registry.SYNTH)
    for name, (module, description) in registry.SYNTH.items():
        adapter, arch = archs[name]
        assert arch.description == description and registry.ARCHS[name] is arch
        assert registry.CLASSES[adapter.class_names[0]] == module
        assert registry.HEADS.get(name) == arch.transformer.get("num_attention_heads"), name
    for cls, adapter in base._REGISTRY.items():  # the torch-free rules the launcher checks before any rank
        facts = registry.family_facts(cls)
        assert (facts.name, facts.cfg_switch, facts.cfg_hint, facts.frame_step, facts.first_frames) == (
            adapter.name, adapter.cfg_switch, adapter.cfg_hint, adapter.frame_step, adapter.first_frames), cls
    first_vae = {}
    for adapter in adapters:
        for vae in adapter.vae.class_names if adapter.vae else ():
            first_vae.setdefault(vae, registry.CLASSES[adapter.class_names[0]])
    assert first_vae == registry.VAES
    assert base.supported_classes() == sorted(base._REGISTRY)
    # a class is adapted, not a DiT, or a DiT not adapted yet, never two of them; each reason is one line
    assert not (set(registry.CLASSES) & set(registry.NOT_DITS) or set(registry.CLASSES) & set(registry.NOT_ADAPTED)
                or set(registry.NOT_DITS) & set(registry.NOT_ADAPTED))
    assert all("\n" not in why and why for why in {**registry.NOT_DITS, **registry.NOT_ADAPTED}.values())


def test_one_model_imports_one_family_and_the_list_no_torch():
    """A FLUX model's adapter and VAE plan import the FLUX module alone; the architecture names, the supported
    classes and ``ditmesh synth --list`` import no torch at all."""
    out = _python(
        "import sys\n"
        "from ditmesh.models import registry, supported_classes\n"
        "from ditmesh.runtime.models import resolve_model\n"
        "assert resolve_model('flux-dev') == 'flux-dev' and 'wan-tiny' in registry.ARCHS\n"
        "assert 'FluxTransformer2DModel' in supported_classes()\n"
        "print('torch' in sys.modules)\n"
        "from ditmesh.models import adapter_for_class\n"
        "from ditmesh.models.base import vae_plan_for\n"
        "assert 'FluxTransformer2DModel' in adapter_for_class('FluxTransformer2DModel').class_names\n"
        "print(sorted(n for n in sys.modules if n.startswith('ditmesh.models.')))\n"
    )
    no_torch, families = out.splitlines()
    assert no_torch == "False"
    assert eval(families) == ["ditmesh.models.base", "ditmesh.models.flux", "ditmesh.models.registry"]
    listing = _python("import sys\nfrom ditmesh.cli import main\nmain(['synth', '--list'])\n"
                      "print('torch' in sys.modules, 'diffusers' in sys.modules)")
    lines = listing.splitlines()
    assert lines[-1] == "False False"
    assert len(lines) - 1 == len(registry.SYNTH) and any(line.startswith("flux-dev ") for line in lines)


def test_argument_and_path_refusals_come_before_torch(tmp_path):
    """``generate``'s refusals of values, paths and names: exit code 2 with torch and diffusers still not imported
    (one process runs them all, in turn)."""
    refusals = [["--steps", "0"], ["--height", "30"], ["--model", str(tmp_path / "none")],
                ["--out", str(tmp_path / "x.txt")], ["--lora", str(tmp_path / "none.safetensors")],
                ["--nproc", "2", "--ulysses", "3"], ["--pp", "2", "--nproc", "2", "--pp-warmup", "0"],
                ["--displaced-warmup", "2"], ["--report", str(tmp_path)], ["--chunk", "-3"]]
    # a pipeline without a transformer, and a transformer class without an adapter, refused by the local launcher
    unet, other = tmp_path / "sd15", tmp_path / "other-dit"
    (other / "transformer").mkdir(parents=True)
    unet.mkdir()
    (unet / "model_index.json").write_text(json.dumps({"_class_name": "StableDiffusionPipeline",
                                                      "unet": ["diffusers", "UNet2DConditionModel"]}))
    (other / "model_index.json").write_text(json.dumps({"_class_name": "SomeDiTPipeline",
                                                       "transformer": ["diffusers", "SomeDiTTransformer2DModel"]}))
    (other / "transformer" / "config.json").write_text(json.dumps({"_class_name": "SomeDiTTransformer2DModel"}))
    refusals += [["--model", str(unet), "--nproc", "2", "--ulysses", "2"],
                 ["--model", str(other), "--nproc", "2", "--ulysses", "2"]]
    out = _python("import sys\nfrom ditmesh.cli import main\n"
                  f"for argv in {refusals!r}:\n"
                  "    print(main(['generate', *argv]), 'torch' in sys.modules, 'diffusers' in sys.modules)\n")
    assert out.splitlines() == ["2 False False"] * len(refusals)
