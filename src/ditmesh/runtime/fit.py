"""Whether a model's weights fit before any is built: ``generate`` and ``serve`` count the weights from the model's
configs and compare them with the memory the ranks will have, so that a model too large for the machine is one line
naming both numbers and what would fit, not a minute of loading and an allocator's error.

What is counted: every transformer's parameters, from its config on the meta device (no weight is read or made),
in the run's dtype, with the block linears ``--quant`` takes in 8 bits and the blocks divided by ``--tp`` and
``--pp``; for a folder, the other components' floating tensors too, read from their safetensors headers. Activations
are not counted: a model that passes may still run out at a large size (``ditmesh plan`` predicts those).

What it is compared with: on CUDA, the rank's GPU's free memory (``torch.cuda.mem_get_info``); on CPU, the host's
``MemAvailable`` (``/proc/meminfo``), shared by every rank of this host. ``DITMESH_TEST_FREE_MEMORY`` (bytes) stands
in for the free memory: for tests only, to fake a small machine.
"""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path

from ..config import ConfigError

#: for tests only: bytes taken as the free memory of the device (GPU) or host (CPU) instead of the measured ones
FREE_MEMORY_ENV = "DITMESH_TEST_FREE_MEMORY"

#: safetensors dtypes of floating tensors (cast to the run's dtype when loaded); others keep their size
_FLOAT_DTYPES = {"F64", "F32", "F16", "BF16"}


@dataclass(frozen=True)
class TransformerCount:
    """Parameters of one transformer: ``total``; ``blocks``: those in its repeated blocks (divided by tp and pp);
    ``quantizable``: the block linears' weights ``--quant`` stores in 8 bits."""

    name: str
    total: int
    blocks: int
    quantizable: int


def count_transformer(name: str, class_name: str, config: dict) -> TransformerCount:
    """Count a transformer's parameters on the meta device (``config``: its config.json as a dict)."""
    import diffusers
    import torch

    from ..models import adapter_for_class
    from ..options import quant_layer_mode

    adapter = adapter_for_class(class_name)
    with torch.device("meta"):
        model = getattr(diffusers, class_name)(**{k: v for k, v in config.items() if not k.startswith("_")})
    prefixes = tuple(spec.path + "." for spec in adapter.blocks)
    blocks = quantizable = total = 0
    for param_name, param in model.named_parameters():
        total += param.numel()
        if param_name.startswith(prefixes):
            blocks += param.numel()
    for module_name, module in model.named_modules():
        if (isinstance(module, torch.nn.Linear) and module_name.startswith(prefixes)
                and quant_layer_mode(module_name, module.in_features, module.out_features, "int8-weight")):
            quantizable += module.weight.numel()
    return TransformerCount(name, total, blocks, quantizable)


def transformer_configs(model: str) -> list[tuple[str, str, dict]]:
    """(component, class, config) of every transformer of a local folder or synthetic architecture; [] for a hub id."""
    from ..models.registry import ARCHS

    if model in ARCHS:
        arch = ARCHS[model]
        return [(name, arch.transformer_class, config) for name, config in
                (("transformer", arch.transformer), ("transformer_2", getattr(arch, "transformer_2", None))) if config]
    found = []
    for folder in sorted(Path(model).glob("transformer*")):
        config_file = folder / "config.json"
        if config_file.is_file():
            config = json.loads(config_file.read_text())
            found.append((folder.name, config.get("_class_name"), config))
    return found


def other_components(model: str) -> tuple[int, int]:
    """(floating elements, bytes of the others) of a folder's components other than its transformers, from their
    safetensors headers; (0, 0) for a synthetic architecture not written yet or a hub id."""
    from ..models.registry import ARCHS
    from .models import synthesized_path

    folder = Path(synthesized_path(model) if model in ARCHS else model)
    floating = fixed = 0
    if not folder.is_dir():
        return 0, 0
    for component in sorted(p for p in folder.iterdir() if p.is_dir() and not p.name.startswith("transformer")):
        for weights in component.glob("*.safetensors"):
            with open(weights, "rb") as f:
                header = json.loads(f.read(struct.unpack("<Q", f.read(8))[0]))
            for key, entry in header.items():
                if key == "__metadata__":
                    continue
                numel = 1
                for size in entry["shape"]:
                    numel *= size
                if entry["dtype"] in _FLOAT_DTYPES:
                    floating += numel
                else:
                    fixed += (entry["data_offsets"][1] - entry["data_offsets"][0])
    return floating, fixed


def rank_bytes(counts: list[TransformerCount], others: tuple[int, int], element: int, tp: int = 1, pp: int = 1,
               quant: str = "off") -> int:
    """Bytes of weights one rank holds: each transformer's blocks divided over tp x pp (their 8-bit linears at one
    byte an element under ``quant``), the rest and the other components whole."""
    total = others[0] * element + others[1]
    for c in counts:
        quantized = c.quantizable if quant != "off" else 0
        total += (c.total - c.blocks) * element
        total += ((c.blocks - quantized) * element + quantized) // (tp * pp)
    return total


def free_memory(device) -> tuple[int, str]:
    """(bytes free, where) for this rank: its GPU's free memory, or the host's MemAvailable on CPU."""
    faked = os.environ.get(FREE_MEMORY_ENV)
    kind = getattr(device, "type", str(device))
    where = f"free on {device}" if kind == "cuda" else "available on this host (MemAvailable)"
    if faked:
        return int(faked), where
    if kind == "cuda":
        import torch

        return torch.cuda.mem_get_info(device)[0], where
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024, where
    except OSError:
        pass
    return 0, ""  # not known (no /proc): not checked


def size_text(n: int) -> str:
    return f"{n / 2**30:.1f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def check_fit(model: str, options, device, element: int, local_ranks: int) -> None:
    """Raise ConfigError (one line: both numbers, and what would fit) when the weights ``options`` give each rank do
    not fit in the memory ``device`` has (on CPU, the host's, shared by ``local_ranks`` processes)."""
    configs = transformer_configs(model)
    if not configs:
        return
    free, where = free_memory(device)
    if not where:
        return
    counts = [count_transformer(name, cls, config) for name, cls, config in configs]
    others = other_components(model)
    sharing = 1 if getattr(device, "type", str(device)) == "cuda" else local_ranks
    c = options.config

    def need(element=element, tp=c.tp, pp=c.pp, quant=options.quant):
        return rank_bytes(counts, others, element, tp, pp, quant) * sharing

    wanted = need()
    if wanted <= free:
        return
    params = sum(x.total for x in counts)
    alternatives = []
    if element > 2:
        alternatives.append(("--dtype bfloat16", need(element=2)))
    if options.quant == "off":
        alternatives.append(("--quant int8-weight", need(quant="int8-weight")))
        if element > 2:
            alternatives.append(("--dtype bfloat16 --quant int8-weight", need(element=2, quant="int8-weight")))
    if getattr(device, "type", str(device)) == "cuda":  # a GPU each: more ranks split the blocks over more memory
        # (on CPU the ranks of a host share its memory: more of them hold as much in all)
        heads = [config.get("num_attention_heads") for _, _, config in configs]
        alternatives += [(f"--tp {c.tp * n}", need(tp=c.tp * n)) for n in (2, 4, 8)
                         if all(not isinstance(h, int) or h % (c.tp * n) == 0 for h in heads)]
        alternatives += [(f"--pp {c.pp * n}", need(pp=c.pp * n)) for n in (2, 4)]
    fitting = [f"{flag} ({size_text(n)})" for flag, n in alternatives if n <= free]
    what = ("what would fit: " + ", ".join(fitting) + "; or a smaller model (ditmesh synth --list)" if fitting
            else "none of --dtype bfloat16, --quant, --tp, --pp fits it here; use a smaller model (ditmesh synth "
                 "--list) or a machine with more memory")
    processes = f" for {sharing} processes" if sharing > 1 else ""
    count = f"{params / 1e9:.2f}B" if params >= 1e9 else f"{params / 1e6:.2f}M"
    raise ConfigError(f"--model {model}: its weights need {size_text(wanted)}{processes} (transformer "
                      f"{count} parameters, {element} bytes each"
                      + (f", {options.quant} block linears" if options.quant != "off" else "")
                      + (f", split over tp={c.tp} x pp={c.pp}" if c.tp * c.pp > 1 else "")
                      + f"), and {size_text(free)} is {where}; {what}")
