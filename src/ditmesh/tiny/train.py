"""Seeded, resumable training of the tiny FLUX pipeline on CPU (or one GPU).

Stages, each checkpointed under ``--work-dir`` so an interrupted run resumes where it stopped:

1. ``vae``: a tiny ``AutoencoderKL`` (factor 8: 64x64 images -> 16x8x8 latents) learns to reconstruct
   procedural images (MSE + L1 + a small KL term).
2. ``latents``: the training set is encoded once (posterior mean); the latents' mean and std become the
   VAE's ``shift_factor`` / ``scaling_factor``, exactly as the pipeline un-normalises them.
2b. ``decoder``: the decoder alone trains on, with the encoder frozen (sharper edges; the latents the
   transformer learns do not change).
3. ``text``: every caption of the grammar (and the empty caption) goes once through the frozen, seeded
   random CLIP and T5 encoders via ``FluxPipeline.encode_prompt``.
4. ``dit``: the ``FluxTransformer2DModel`` learns rectified flow: ``x_t = (1 - t) x0 + t noise``, target
   ``noise - x0``, ``t`` logit-normal, 10% empty captions (so true CFG works), guidance embedding drawn in
   [1, 5] (the model learns to ignore it). An EMA of the weights is what ships.
5. ``export``: ``save_pretrained`` of the whole pipeline plus ``ditmesh_tiny.json``.

Every random draw of step ``s`` comes from a generator seeded by ``(seed, stage, s)``, so a resumed run
sees the same batches as an uninterrupted one.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import random
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from . import META_FILE, default_model_path
from . import data as tiny_data

#: T5 tokens per caption: the longest grammar caption is 12 tokens with ``</s>``.
MAX_SEQUENCE_LENGTH = 16
LATENT_CHANNELS = 16


def tiny_arch():
    """The architecture of the shipped pipeline: ``flux-tiny`` resized (8 heads x 16, 3 double + 4 single)."""
    from ..synth import get_arch

    base = get_arch("flux-tiny")
    return dataclasses.replace(
        base,
        name="tiny-flux-trained",
        description="trained tiny FLUX.1: 3 double + 4 single blocks, 8 heads x 16; 64x64 shapes",
        transformer=dict(
            base.transformer, num_layers=3, num_single_layers=4, num_attention_heads=8, attention_head_dim=16,
            joint_attention_dim=64, pooled_projection_dim=32, axes_dims_rope=[4, 6, 6],
        ),
        # One norm group: with one channel per group, GroupNorm is an instance norm that erases each channel's
        # image-wide mean, and flat-colour images then decode with wrong colours.
        vae=dict(base.vae, block_out_channels=[8, 16, 32, 32], layers_per_block=1, norm_num_groups=1,
                 latent_channels=LATENT_CHANNELS, sample_size=tiny_data.SIZE),
        default_size=(tiny_data.SIZE, tiny_data.SIZE),
        max_sequence_length=MAX_SEQUENCE_LENGTH,
    )


@dataclass
class TrainConfig:
    """Everything a training run depends on; the defaults retrain the shipped weights."""

    out: str = default_model_path()
    work_dir: str = "out/tiny-train"
    seed: int = 0
    threads: int = 2
    vae_steps: int = 600
    vae_batch: int = 32
    vae_lr: float = 2e-3
    kl_weight: float = 3e-5
    decoder_steps: int = 1000
    decoder_lr: float = 1e-3
    latent_images: int = 16384
    dit_steps: int = 7000
    dit_batch: int = 32
    dit_lr: float = 6e-4
    warmup: int = 100
    ema_decay: float = 0.998
    caption_dropout: float = 0.1
    checkpoint_every: int = 100
    save_dtype: str = "float32"


def _log(cfg: TrainConfig, msg: str) -> None:
    line = f"{time.strftime('%H:%M:%S')} {msg}"
    print(line, flush=True)
    with open(Path(cfg.work_dir) / "train.log", "a") as f:
        f.write(line + "\n")


def _step_seed(cfg: TrainConfig, stage: int, step: int) -> int:
    return (cfg.seed * 1_000_003 + stage * 10_007_000 + step) % (2**63)


def _save_atomic(obj, path: Path) -> None:
    tmp = path.with_suffix(".tmp")
    torch.save(obj, tmp)
    os.replace(tmp, path)


def images_to_tensor(images: np.ndarray) -> torch.Tensor:
    """uint8 ``[N, H, W, 3]`` -> float ``[N, 3, H, W]`` in [-1, 1] (the VAE's input range)."""
    return torch.from_numpy(images).permute(0, 3, 1, 2).float().div(127.5).sub(1.0)


def _lr(cfg: TrainConfig, step: int, base: float) -> float:
    """Linear warm-up, then constant: the schedule does not depend on the stage's length, so a run resumed
    with more (or fewer) steps is the same run as one started with that length (the EMA does the annealing)."""
    return base * min(1.0, (step + 1) / cfg.warmup)


def _optimizer_step(model, opt, loss: torch.Tensor, lr: float) -> None:
    """One AdamW step at learning rate ``lr`` with gradients clipped to norm 1."""
    for group in opt.param_groups:
        group["lr"] = lr
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()


class _Progress:
    """Logs the mean loss every ``log_every`` steps and writes the stage checkpoint every ``checkpoint_every``."""

    def __init__(self, cfg: TrainConfig, stage: str, total: int, log_every: int, path: Path):
        self.cfg, self.stage, self.total, self.log_every, self.path = cfg, stage, total, log_every, path
        self.losses, self.t0 = [], time.time()

    def update(self, done: int, loss: float, state, detail: str = "") -> None:
        """Record step ``done``'s loss; ``state()`` builds the checkpoint dict when one is due."""
        self.losses.append(loss)
        last = done == self.total
        if done % self.log_every == 0 or last:
            _log(self.cfg, f"{self.stage} step {done}/{self.total} loss {np.mean(self.losses):.5f} {detail} "
                           f"({(time.time() - self.t0) / len(self.losses):.2f}s/step)")
            self.losses, self.t0 = [], time.time()
        if done % self.cfg.checkpoint_every == 0 or last:
            _save_atomic({"step": done, **state()}, self.path)


def _load_or_init(path: Path, model, opt):
    if not path.exists():
        return 0, None
    state = torch.load(path, map_location="cpu", weights_only=False)
    model.load_state_dict(state["model"])
    opt.load_state_dict(state["opt"])
    return state["step"], state


# ---------------------------------------------------------------------------------------------------
# stages
# ---------------------------------------------------------------------------------------------------
def train_vae(cfg: TrainConfig, vae, train_scenes) -> None:
    """Stage 1: reconstruct procedural images; checkpoint ``vae.pt``."""
    path = Path(cfg.work_dir) / "vae.pt"
    vae.train()
    opt = torch.optim.AdamW(vae.parameters(), lr=cfg.vae_lr, weight_decay=0.0)
    start, _ = _load_or_init(path, vae, opt)
    if start:
        _log(cfg, f"vae: resumed at step {start}")
    progress = _Progress(cfg, "vae", cfg.vae_steps, 50, path)
    for step in range(start, cfg.vae_steps):
        seed = _step_seed(cfg, 1, step)
        images, _ = tiny_data.sample_dataset(train_scenes, cfg.vae_batch, seed)
        x = images_to_tensor(images)
        post = vae.encode(x).latent_dist
        z = post.sample(generator=torch.Generator().manual_seed(seed))
        recon = vae.decode(z).sample
        mse = torch.nn.functional.mse_loss(recon, x)
        kl = post.kl().mean() / z[0].numel()
        # L1 keeps flat colours and edges sharper than MSE alone.
        loss = mse + torch.nn.functional.l1_loss(recon, x) + cfg.kl_weight * kl
        _optimizer_step(vae, opt, loss, _lr(cfg, step, cfg.vae_lr))
        progress.update(step + 1, mse.item(), lambda: {"model": vae.state_dict(), "opt": opt.state_dict()},
                        f"(mse) kl {kl.item():.3f}")
    vae.eval().requires_grad_(False)


def encode_latents(cfg: TrainConfig, vae, train_scenes) -> dict:
    """Stage 2: the training set's normalised latents and scene indices; sets the VAE's scale/shift."""
    path = Path(cfg.work_dir) / "latents.pt"
    if path.exists():
        cached = torch.load(path, map_location="cpu", weights_only=False)
    else:
        images, scenes = tiny_data.sample_dataset(train_scenes, cfg.latent_images, _step_seed(cfg, 2, 0))
        chunks = []
        with torch.no_grad():
            for i in range(0, len(images), 256):
                chunks.append(vae.encode(images_to_tensor(images[i:i + 256])).latent_dist.mean)
        raw = torch.cat(chunks)
        shift, scale = raw.mean().item(), 1.0 / raw.std().item()
        index = {s: i for i, s in enumerate(train_scenes)}
        cached = {"latents": (raw - shift) * scale, "scene": torch.tensor([index[s] for s in scenes]),
                  "shift": shift, "scale": scale}
        _save_atomic(cached, path)
        _log(cfg, f"latents: {tuple(raw.shape)} shift {shift:.4f} scale {scale:.4f}")
    vae.register_to_config(shift_factor=cached["shift"], scaling_factor=cached["scale"])
    return cached


def refine_decoder(cfg: TrainConfig, vae, train_scenes) -> None:
    """Stage 2b: train the decoder alone on posterior means, the encoder (so the latent space) frozen.

    Sharpens edges and corners after the short joint stage; the transformer's latents do not change, so
    this stage is independent of the transformer's training. Checkpoint ``decoder.pt`` (whole VAE).
    """
    path = Path(cfg.work_dir) / "decoder.pt"
    opt = torch.optim.AdamW(vae.decoder.parameters(), lr=cfg.decoder_lr, weight_decay=0.0)
    start, _ = _load_or_init(path, vae, opt)
    if start:
        _log(cfg, f"decoder: resumed at step {start}")
    vae.decoder.train().requires_grad_(True)
    progress = _Progress(cfg, "decoder", cfg.decoder_steps, 50, path)
    for step in range(start, cfg.decoder_steps):
        images, _ = tiny_data.sample_dataset(train_scenes, cfg.vae_batch, _step_seed(cfg, 5, step))
        x = images_to_tensor(images)
        with torch.no_grad():
            z = vae.encode(x).latent_dist.mean
        recon = vae.decode(z).sample
        mse = torch.nn.functional.mse_loss(recon, x)
        _optimizer_step(vae.decoder, opt, mse + torch.nn.functional.l1_loss(recon, x), _lr(cfg, step, cfg.decoder_lr))
        progress.update(step + 1, mse.item(), lambda: {"model": vae.state_dict(), "opt": opt.state_dict()}, "(mse)")
    vae.eval().requires_grad_(False)


def encode_captions(cfg: TrainConfig, pipe) -> dict:
    """Stage 3: ``{caption: (t5 embeds [L, D], clip pooled [P])}`` for every grammar caption and ``""``."""
    path = Path(cfg.work_dir) / "text.pt"
    if path.exists():
        return torch.load(path, map_location="cpu", weights_only=False)
    captions = [""] + sorted({c for s in tiny_data.all_scenes() for c in s.captions()})
    with torch.no_grad():
        embeds, pooled, _ = pipe.encode_prompt(prompt=captions, prompt_2=None, device="cpu",
                                               max_sequence_length=MAX_SEQUENCE_LENGTH)
    table = {c: (embeds[i].clone(), pooled[i].clone()) for i, c in enumerate(captions)}
    _save_atomic(table, path)
    _log(cfg, f"text: {len(captions)} captions encoded, embeds {tuple(embeds.shape[1:])}")
    return table


def _zero_init_modulation(transformer) -> None:
    """adaLN-zero: modulation and output projections start at zero, so every block starts as identity."""
    with torch.no_grad():
        for name, module in transformer.named_modules():
            if isinstance(module, torch.nn.Linear) and (name.endswith("norm1.linear") or name.endswith("norm1_context.linear")
                                                        or name.endswith("norm.linear") or name in ("norm_out.linear", "proj_out")):
                module.weight.zero_()
                if module.bias is not None:
                    module.bias.zero_()


def train_transformer(cfg: TrainConfig, pipe, latents: dict, captions: dict, train_scenes) -> dict:
    """Stage 4: rectified-flow training of the transformer; returns the EMA state dict."""
    from diffusers import FluxPipeline

    path = Path(cfg.work_dir) / "dit.pt"
    model = pipe.transformer
    if not path.exists():
        _zero_init_modulation(model)
    model.train().requires_grad_(True)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.dit_lr, weight_decay=0.0, betas=(0.9, 0.99))
    start, state = _load_or_init(path, model, opt)
    ema = state["ema"] if state else {k: v.detach().clone() for k, v in model.state_dict().items()}
    if start:
        _log(cfg, f"dit: resumed at step {start}")

    x_all, scene_all = latents["latents"], latents["scene"]
    n, c, h, w = x_all.shape
    phrasings = [s.captions() for s in train_scenes]
    img_ids = FluxPipeline._prepare_latent_image_ids(cfg.dit_batch, h // 2, w // 2, "cpu", torch.float32)
    txt_ids = torch.zeros(MAX_SEQUENCE_LENGTH, 3)
    progress = _Progress(cfg, "dit", cfg.dit_steps, 25, path)
    for step in range(start, cfg.dit_steps):
        gen = torch.Generator().manual_seed(_step_seed(cfg, 4, step))
        pick = torch.randint(n, (cfg.dit_batch,), generator=gen)
        choice = torch.randint(1 << 30, (cfg.dit_batch,), generator=gen).tolist()
        drop = (torch.rand(cfg.dit_batch, generator=gen) < cfg.caption_dropout).tolist()
        texts = []
        for i, k in enumerate(pick.tolist()):
            options = phrasings[scene_all[k]]
            texts.append("" if drop[i] else options[choice[i] % len(options)])
        enc = torch.stack([captions[t][0] for t in texts])
        pooled = torch.stack([captions[t][1] for t in texts])
        x0 = FluxPipeline._pack_latents(x_all[pick], cfg.dit_batch, c, h, w)
        noise = torch.randn(x0.shape, generator=gen)
        t = torch.sigmoid(torch.randn(cfg.dit_batch, generator=gen))
        guidance = 1.0 + 4.0 * torch.rand(cfg.dit_batch, generator=gen)
        xt = (1 - t[:, None, None]) * x0 + t[:, None, None] * noise
        pred = model(hidden_states=xt, timestep=t, guidance=guidance, pooled_projections=pooled,
                     encoder_hidden_states=enc, txt_ids=txt_ids, img_ids=img_ids, return_dict=False)[0]
        loss = torch.nn.functional.mse_loss(pred, noise - x0)
        lr = _lr(cfg, step, cfg.dit_lr)
        _optimizer_step(model, opt, loss, lr)
        decay = min(cfg.ema_decay, (1 + step) / (10 + step))
        with torch.no_grad():
            for k, v in model.state_dict().items():
                ema[k].mul_(decay).add_(v.detach(), alpha=1 - decay)
        progress.update(step + 1, loss.item(),
                        lambda: {"model": model.state_dict(), "opt": opt.state_dict(), "ema": ema}, f"lr {lr:.2e}")
    model.eval().requires_grad_(False)
    return ema


def export_pipeline(cfg: TrainConfig, pipe, out: str | os.PathLike) -> Path:
    """Stage 5: write the pipeline folder (``save_pretrained`` + ``ditmesh_tiny.json``), atomically."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        pipe.to(getattr(torch, cfg.save_dtype)).save_pretrained(tmp, safe_serialization=True)
        meta = {"max_sequence_length": MAX_SEQUENCE_LENGTH, "default_size": [tiny_data.SIZE, tiny_data.SIZE],
                "seed": cfg.seed, "generator": "ditmesh train-tiny",
                "train_config": {k: v for k, v in dataclasses.asdict(cfg).items() if k not in ("out", "work_dir")}}
        (tmp / META_FILE).write_text(json.dumps(meta, indent=2) + "\n")
        for path in [tmp, *tmp.rglob("*")]:  # mkdtemp makes 0700; installed package data must be readable
            path.chmod(0o755 if path.is_dir() else 0o644)
        if out.exists():
            shutil.rmtree(out)
        tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    finally:
        pipe.to(torch.float32)
    return out


def train(cfg: TrainConfig) -> Path:
    """Run every stage (resuming from ``cfg.work_dir``) and write the pipeline folder to ``cfg.out``."""
    from ..synth import build_pipeline

    torch.set_num_threads(cfg.threads)
    torch.manual_seed(cfg.seed)
    random.seed(cfg.seed)
    Path(cfg.work_dir).mkdir(parents=True, exist_ok=True)
    _log(cfg, f"config {dataclasses.asdict(cfg)}")
    # The shipped weights were trained from zero biases and unit norm scales (the frozen text encoders keep
    # them), so a retrain starts there too and reproduces them.
    pipe = build_pipeline(tiny_arch(), seed=cfg.seed, device="cpu", dtype=torch.float32, affine="identity")
    train_scenes, held = tiny_data.split_scenes(cfg.seed)
    _log(cfg, f"{len(train_scenes)} training scenes, {len(held)} held out")
    train_vae(cfg, pipe.vae, train_scenes)
    latents = encode_latents(cfg, pipe.vae, train_scenes)
    refine_decoder(cfg, pipe.vae, train_scenes)
    captions = encode_captions(cfg, pipe)
    ema = train_transformer(cfg, pipe, latents, captions, train_scenes)
    pipe.transformer.load_state_dict(ema)
    out = export_pipeline(cfg, pipe, cfg.out)
    _log(cfg, f"wrote {out}")
    return out


# ---------------------------------------------------------------------------------------------------
# command line
# ---------------------------------------------------------------------------------------------------
def _add_config_arguments(parser: argparse.ArgumentParser) -> None:
    for f in dataclasses.fields(TrainConfig):
        parser.add_argument("--" + f.name.replace("_", "-"), type=type(f.default), default=f.default,
                            help=f"(default: {f.default})")


def add_train_parser(subparsers) -> argparse.ArgumentParser:
    """Register ``train-tiny`` on an argparse ``subparsers`` object; its handler is :func:`run_train`."""
    parser = subparsers.add_parser("train-tiny", help="retrain the shipped tiny FLUX pipeline (resumable)",
                                   description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    _add_config_arguments(parser)
    parser.set_defaults(func=run_train)
    return parser


def run_train(args: argparse.Namespace) -> int:
    """Handler of ``ditmesh train-tiny``: build a :class:`TrainConfig` from ``args`` and train."""
    from ..config import ConfigError

    if args.threads < 1:
        raise ConfigError(f"--threads {args.threads} must be >= 1")
    cfg = TrainConfig(**{f.name: getattr(args, f.name) for f in dataclasses.fields(TrainConfig)})
    train(cfg)
    return 0


def main(argv=None) -> int:
    """``python -m ditmesh.tiny.train [options]``."""
    parser = argparse.ArgumentParser(prog="ditmesh-train-tiny")
    sub = parser.add_subparsers(dest="command", required=True)
    add_train_parser(sub)
    args = parser.parse_args(["train-tiny"] + list(argv if argv is not None else __import__("sys").argv[1:]))
    return args.func(args)


if __name__ == "__main__":
    raise SystemExit(main())
