"""Give a synthetic FLUX pipeline folder full-size text encoders (random weights), to time text encoding as FLUX.1-dev has it.

    ditmesh synth --arch flux-dev --out /tmp/flux-dev
    python scripts/full_text_encoders.py /tmp/flux-dev            # CLIP-L and T5-XXL's encoder, bf16, on the GPU
    python scripts/full_text_encoders.py /tmp/flux-tiny --layers 2 --device cpu   # CPU check: the sizes, 2 layers

``ditmesh synth`` writes one-layer text encoders (their output widths are the real ones): enough for the
transformer's inputs, nothing like the real encoders' time. This script keeps each encoder's configuration (vocabulary,
tokens, output width) and sets the real model's depth and widths: CLIP-L (12 layers, 768 wide, 3072 feed-forward,
12 heads) and T5 v1.1 XXL's encoder (24 layers, 4096 wide, 10240 gated-GELU feed-forward, 64 heads of 64), about
4.8 B parameters together. Weights come from transformers' own initialization (seeded), made on ``--device`` and
written in the folder's dtype over the old files. ``--layers N`` keeps the widths and sets every encoder's depth to N
(a quick check).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

#: the real encoders' sizes (FLUX.1-dev's text_encoder and text_encoder_2)
CLIP_L = {"hidden_size": 768, "intermediate_size": 3072, "num_hidden_layers": 12, "num_attention_heads": 12,
          "projection_dim": 768}
T5_XXL = {"d_model": 4096, "d_kv": 64, "d_ff": 10240, "num_layers": 24, "num_heads": 64}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("model", help="a FLUX pipeline folder written by ditmesh synth")
    p.add_argument("--device", default=None, help="where the weights are made (default: cuda if present, else cpu)")
    p.add_argument("--layers", type=int, default=None, metavar="N", help="every encoder N layers deep (a check)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    model = Path(args.model)
    index = model / "model_index.json"
    if not index.is_file():
        p.error(f"{model}: no model_index.json; give a pipeline folder (ditmesh synth --arch flux-dev --out DIR)")
    entries = json.loads(index.read_text())
    if entries.get("text_encoder", [None, None])[1] != "CLIPTextModel" or \
            entries.get("text_encoder_2", [None, None])[1] != "T5EncoderModel":
        p.error(f"{model}: its text encoders are not CLIPTextModel and T5EncoderModel (a FLUX folder is)")
    if args.layers is not None and args.layers < 1:
        p.error(f"--layers {args.layers} must be >= 1")

    import torch
    import transformers

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    total = 0
    for name, cls, sizes, depth in (("text_encoder", transformers.CLIPTextModel, CLIP_L, "num_hidden_layers"),
                                    ("text_encoder_2", transformers.T5EncoderModel, T5_XXL, "num_layers")):
        folder = model / name
        config = cls.config_class.from_pretrained(folder)
        dtype = getattr(torch, str(config.torch_dtype or "float32").replace("torch.", ""))
        for key, value in sizes.items():
            setattr(config, key, value)
        if args.layers is not None:
            setattr(config, depth, args.layers)
        torch.manual_seed(args.seed)
        with torch.device(device):
            encoder = cls._from_config(config, torch_dtype=dtype)
        count = sum(p.numel() for p in encoder.parameters())
        total += count
        for old in list(folder.glob("*.safetensors")) + list(folder.glob("*.safetensors.index.json")) + \
                list(folder.glob("*.bin")):
            old.unlink()
        encoder.save_pretrained(folder, safe_serialization=True)
        print(f"{name}: {cls.__name__}, {getattr(config, depth)} layers, {count / 1e9:.2f} B parameters, {dtype}",
              file=sys.stderr, flush=True)
        del encoder
    print(f"full-size text encoders in {model}: {total / 1e9:.2f} B parameters", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
