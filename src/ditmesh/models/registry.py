"""Which module holds which family, known without importing any: the registry of class names and synthetic
architectures that lets ditmesh import only the adapter a model needs.

Importing a family's adapter imports torch and that family's diffusers classes (seconds each), so nothing here
imports either: :func:`ditmesh.models.base.adapter_for_class` imports the one module :data:`CLASSES` names, ``ditmesh
synth --list`` prints :data:`SYNTH`, and :data:`ARCHS` loads an architecture's family when it is looked up.
tests/test_registry.py checks these tables against what the adapters register (a family added without its lines
here fails it).
"""

from __future__ import annotations

import importlib
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

#: diffusers transformer class -> the adapter module (``ditmesh.models.<module>``) that registers it, in the order
#: the adapters register when every family is imported (``adapters()`` keeps it)
CLASSES: dict[str, str] = {
    'LTXVideoTransformer3DModel': 'ltx',
    'FluxTransformer2DModel': 'flux',
    'PixArtTransformer2DModel': 'pixart',
    'AllegroTransformer3DModel': 'allegro',
    'ChromaTransformer2DModel': 'chroma',
    'CogVideoXTransformer3DModel': 'cogvideox',
    'CogView4Transformer2DModel': 'cogview4',
    'Flux2Transformer2DModel': 'flux2',
    'HiDreamImageTransformer2DModel': 'hidream',
    'HunyuanDiT2DModel': 'hunyuan_dit',
    'HunyuanVideoTransformer3DModel': 'hunyuan_video',
    'Lumina2Transformer2DModel': 'lumina2',
    'MochiTransformer3DModel': 'mochi',
    'WanTransformer3DModel': 'wan',
    'QwenImageTransformer2DModel': 'qwenimage',
    'SanaTransformer2DModel': 'sana',
    'SD3Transformer2DModel': 'sd3',
    'SkyReelsV2Transformer3DModel': 'skyreels_v2',
    'ZImageTransformer2DModel': 'zimage',
}

#: synthetic architecture -> (the adapter module that defines it, its description), for ``ditmesh synth --list``
SYNTH: dict[str, tuple[str, str]] = {
    'ltx-video': ('ltx', 'LTX-Video 2B transformer (28 blocks, 32 heads x 64, 0.9.x), LTX video VAE (32x, 8x '
                         'time), one-layer T5-XXL-wide encoder'),
    'ltx-video-tiny': ('ltx', 'LTX-Video architecture shrunk for CPU tests: 2 blocks, 6 heads x 16, per-channel'
                              ' RoPE, tiny LTX VAE'),
    'ltx-video-tiny-tp': ('ltx', 'ltx-video-tiny with 4 heads x 24 (96 wide), so tensor parallelism of degree 4'
                                 " divides the heads and each rank's RoPE share keeps whole rotation pairs"),
    'flux-tiny': ('flux', 'FLUX.1 architecture shrunk for CPU tests: 2 double + 2 single blocks, 6 heads x 16'),
    'flux-fill-tiny': ('flux', "flux-tiny as FLUX.1-Fill: the masked image's latents and the mask concatenated "
                               'on channels (384 in, 64 out), FluxFillPipeline'),
    'flux-tiny-tp': ('flux', 'flux-tiny with 4 heads x 16 (64 wide), so tensor parallelism of degree 4 divides '
                             'the heads'),
    'flux-dev': ('flux', 'FLUX.1-dev transformer (19 double + 38 single blocks, 24 heads x 128, 11.9B params), '
                         'full VAE'),
    'pixart-sigma': ('pixart', 'PixArt-Σ XL-2-1024-MS transformer (28 blocks, 16 heads x 72, 0.6B params), SDXL'
                               ' VAE, one-layer T5'),
    'pixart-sigma-tiny': ('pixart', 'PixArt-Σ architecture shrunk for CPU tests: 2 blocks, 6 heads x 16, cross-'
                                    'attention to 64-wide T5'),
    'pixart-sigma-tiny-tp': ('pixart', 'pixart-sigma-tiny with 4 heads x 16 (64 wide), so tensor parallelism of'
                                       ' degree 4 divides the heads'),
    'pixart-alpha-tiny': ('pixart', 'pixart-sigma-tiny as PixArt-α 1024 reads it: the image size and aspect '
                                    'ratio as micro-conditions (added_cond_kwargs), PixArtAlphaPipeline'),
    'allegro': ('allegro', 'Allegro transformer (32 blocks, 24 heads x 96, 2.8B params), full Allegro VAE, one-'
                           'layer T5-XXL-wide encoder'),
    'allegro-tiny': ('allegro', 'Allegro architecture shrunk for CPU tests: 2 blocks, 6 heads x 24 (3-D RoPE of'
                                ' 3 x 8 channels), tiny Allegro VAE (tiles of 128 px)'),
    'allegro-tiny-tp': ('allegro', 'allegro-tiny with 4 heads x 24 (96 wide), so tensor parallelism of degree 4'
                                   ' divides the heads'),
    'chroma-tiny': ('chroma', 'Chroma architecture shrunk for CPU tests: 2 double + 2 single blocks, 6 heads x 16'),
    'chroma1-hd': ('chroma', 'Chroma1-HD transformer (19 double + 38 single blocks, 24 heads x 128, '
                             "approximator 5120 x 5), FLUX.1's VAE"),
    'cogvideox-5b': ('cogvideox', 'CogVideoX-5B transformer (42 blocks, 48 heads x 64, 3-D RoPE), full '
                                  'CogVideoX VAE, small T5'),
    'cogvideox-tiny': ('cogvideox', 'CogVideoX-5B architecture shrunk for CPU tests: 2 blocks, 4 heads x 16, '
                                    '3-D RoPE, a tiny CogVideoX VAE and T5'),
    'cogvideox-2b-tiny': ('cogvideox', 'cogvideox-tiny as CogVideoX 1.0 2B: no RoPE, sine-cosine positions '
                                       'added in patch_embed'),
    'cogvideox1.5-tiny': ('cogvideox', 'cogvideox-tiny as CogVideoX 1.5: 2 latent frames a patch '
                                       '(patch_size_t), RoPE over the patches'),
    'cogview4-tiny': ('cogview4', 'CogView4 architecture shrunk for CPU tests: 2 blocks, 4 heads x 8'),
    'cogview4': ('cogview4', 'CogView4-6B transformer (28 blocks, 32 heads x 128, 6.4B params); a one-layer GLM'
                             " text encoder of GLM-4's width"),
    'flux2-tiny': ('flux2', 'FLUX.2 architecture shrunk for CPU tests: 2 double + 2 single blocks, 4 heads x '
                            "16, Klein's pipeline (true CFG), a 16-wide Qwen3"),
    'flux2-dev': ('flux2', 'FLUX.2-dev transformer (8 double + 48 single blocks, 48 heads x 128, text width '
                           '15360, 32B params), full VAE; in Flux2KleinPipeline with a 27-layer, one-head Qwen3'
                           ' text encoder 5120 wide'),
    'hidream-tiny': ('hidream', 'HiDream-I1 architecture shrunk for CPU tests: 2 double + 2 single blocks, 4 '
                                'heads x 16, MoE 4/2'),
    'hidream-i1': ('hidream', 'HiDream-I1 (17B) transformer (16 double + 32 single blocks, 20 heads x 128, MoE '
                              "4 routed experts, 2 active), FLUX's VAE, one-layer CLIP-L/G and T5, a 32-layer "
                              'Llama of width 4096 (narrow layers)'),
    'hunyuan-dit': ('hunyuan_dit', 'HunyuanDiT v1.2 transformer (40 blocks with long skips, 16 heads x 88, 1.5B'
                                   " params), SDXL's VAE, one-layer CLIP-shaped first text encoder (1024 wide) "
                                   'and T5 (2048 wide)'),
    'hunyuan-dit-tiny': ('hunyuan_dit', 'HunyuanDiT architecture shrunk for CPU tests: 4 blocks (one long '
                                        'skip), 6 heads x 16'),
    'hunyuan-dit-tiny-tp': ('hunyuan_dit', 'hunyuan-dit-tiny with 4 heads x 16 (64 wide), so tensor parallelism'
                                           ' of degree 4 divides the heads'),
    'hunyuan-video': ('hunyuan_video', 'HunyuanVideo (13B) transformer (20 dual + 40 single blocks, 24 heads x '
                                       '128, 2 refiner blocks), full HunyuanVideo VAE, a two-layer Llama text '
                                       'encoder (4096 wide) and CLIP-L'),
    'hunyuan-video-tiny': ('hunyuan_video', 'HunyuanVideo architecture shrunk for CPU tests: 2 dual + 2 single '
                                            'blocks, 1 refiner block, 4 heads x 16, a tiny HunyuanVideo VAE, '
                                            'Llama and CLIP'),
    'lumina2-tiny': ('lumina2', 'Lumina-Image 2.0 shrunk for CPU tests: 2 layers + 1 + 1 refiners, 4 query / 2 '
                                'key-value heads x 8'),
    'lumina2': ('lumina2', 'Lumina-Image 2.0 transformer (26 layers + 2 + 2 refiners, 24 query / 8 key-value '
                           "heads x 96, 2.6B params), FLUX.1's VAE, a one-layer Gemma-2 text encoder of Gemma-2"
                           " 2B's width"),
    'mochi-1': ('mochi', 'Mochi 1 preview transformer (48 blocks, 24 heads x 128, text stream 1536 wide), full '
                         "Mochi VAE, a one-layer T5 of T5-XXL's width"),
    'mochi-tiny': ('mochi', 'Mochi 1 architecture shrunk for CPU tests: 2 blocks, 6 heads x 16 (96 wide), a '
                            '48-wide text stream, tiny Mochi VAE'),
    'wan2.1-14b': ('wan', 'Wan2.1-T2V-14B transformer (40 blocks, 40 heads x 128, FFN 13824), full Wan VAE, '
                          'small UMT5'),
    'wan-tiny': ('wan', 'Wan 2.1 architecture shrunk for CPU tests: 2 blocks, 6 heads x 16, 3-D RoPE, tiny Wan VAE'),
    'wan-tiny-tp': ('wan', 'wan-tiny with 4 heads x 16 (64 wide), so tensor parallelism of degree 4 divides the heads'),
    'wan2.2-tiny': ('wan', 'Wan 2.2 A14B layout shrunk for CPU tests: two wan-tiny transformers (high- and low-'
                           'noise experts) switched at boundary_ratio 0.9'),
    'wan2.2-i2v-tiny': ('wan', 'Wan 2.2 I2V-A14B layout shrunk for CPU tests: two wan-tiny transformers reading'
                               ' the noise, the first-frame mask and the encoded condition video (36 in, 16 '
                               'out), WanImageToVideoPipeline'),
    'wan2.1-i2v-tiny': ('wan', 'Wan 2.1 I2V layout shrunk for CPU tests: wan-tiny reading 36 channels and '
                               'cross-attending to the image tokens of a tiny CLIP vision encoder (5 tokens of '
                               '32), WanImageToVideoPipeline'),
    'qwenimage-tiny': ('qwenimage', 'QwenImage architecture shrunk for CPU tests: 2 blocks, 4 heads x 16, a '
                                    'small VAE and text encoder'),
    'qwenimage': ('qwenimage', 'QwenImage (20B) transformer (60 dual-stream blocks, 24 heads x 128, text width '
                               '3584), full VAE, a one-layer Qwen2.5-VL text encoder'),
    'sana-1600m': ('sana', 'Sana 1600M 1024px transformer (20 blocks, linear attention 70 heads x 32, cross-'
                           'attention 20 x 112, Mix-FFN 2.5x, 1.6B params), DC-AE f32c32, one-layer Gemma-2'),
    'sana-tiny': ('sana', 'Sana architecture shrunk for CPU tests: 2 blocks, linear attention 6 heads x 16, '
                          'cross-attention 6 x 16, a six-level 32x DC-AE of 8-channel ResBlocks'),
    'sana-tiny-tp': ('sana', 'sana-tiny with 4 heads x 16 in both attentions (64 wide), so tensor parallelism '
                             'of degree 4 divides the heads'),
    'sd3.5-large': ('sd3', 'SD3.5-Large transformer (38 joint blocks, 38 heads x 64, RMS QK-norm, 8.1B params),'
                           ' full SD3 VAE'),
    'sd3-tiny': ('sd3', 'SD3.5 architecture shrunk for CPU tests: 3 joint blocks (block 0 dual-attention, RMS '
                        'QK-norm, last context_pre_only), 6 heads x 16'),
    'sd3-tiny-tp': ('sd3', 'sd3-tiny with 4 heads x 16 (64 wide, caption_projection_dim 64), so tensor '
                           'parallelism of degree 4 divides the heads'),
    'skyreels-v2-df-14b': ('skyreels_v2', "SkyReels-V2-DF-14B-540P transformer (Wan2.1-14B's: 40 blocks, 40 "
                                          'heads x 128, FFN 13824; diffusion forcing), full Wan VAE, small UMT5'),
    'skyreels-v2-df-1.3b': ('skyreels_v2', 'SkyReels-V2-DF-1.3B-540P transformer (30 blocks, 12 heads x 128, '
                                           'FFN 8960, fps conditioning), full Wan VAE, small UMT5'),
    'skyreels-v2-tiny': ('skyreels_v2', "SkyReels-V2 DF architecture shrunk for CPU tests: wan-tiny's 2 blocks "
                                        'of 6 heads x 16, tiny Wan VAE'),
    'skyreels-v2-i2v-tiny': ('skyreels_v2', 'SkyReels-V2 I2V layout shrunk for CPU tests: skyreels-v2-tiny '
                                            'reading 36 channels and cross-attending to 257 image tokens of 32 '
                                            '(a tiny CLIP vision encoder), SkyReelsV2ImageToVideoPipeline'),
    'skyreels-v2-tiny-fps': ('skyreels_v2', "skyreels-v2-tiny with the 1.3B checkpoint's fps conditioning "
                                            '(inject_sample_info)'),
    'z-image-tiny': ('zimage', 'Z-Image shrunk for CPU tests: 2 layers + 1 + 1 refiners, 2 heads x 24 '
                               "(diffusers' own test size, 48 wide)"),
    'z-image': ('zimage', 'Z-Image-Turbo-shaped transformer (30 layers + 2 + 2 refiners, 30 heads x 128, 6.2B '
                          "params), FLUX.1's VAE, a two-layer Qwen3 text encoder of Qwen3-4B's width"),
}

#: synthetic architecture -> its transformer's attention heads (``num_attention_heads``, where its config has one),
#: for the launcher's torch-free check of the degrees that split heads before any rank starts
HEADS: dict[str, int] = {
    'ltx-video': 32,
    'ltx-video-tiny': 6,
    'ltx-video-tiny-tp': 4,
    'flux-tiny': 6,
    'flux-fill-tiny': 6,
    'flux-tiny-tp': 4,
    'flux-dev': 24,
    'pixart-sigma': 16,
    'pixart-sigma-tiny': 6,
    'pixart-sigma-tiny-tp': 4,
    'pixart-alpha-tiny': 6,
    'allegro': 24,
    'allegro-tiny': 6,
    'allegro-tiny-tp': 4,
    'chroma-tiny': 6,
    'chroma1-hd': 24,
    'cogvideox-5b': 48,
    'cogvideox-tiny': 4,
    'cogvideox-2b-tiny': 4,
    'cogvideox1.5-tiny': 4,
    'cogview4-tiny': 4,
    'cogview4': 32,
    'flux2-tiny': 4,
    'flux2-dev': 48,
    'hidream-tiny': 4,
    'hidream-i1': 20,
    'hunyuan-dit': 16,
    'hunyuan-dit-tiny': 6,
    'hunyuan-dit-tiny-tp': 4,
    'hunyuan-video': 24,
    'hunyuan-video-tiny': 4,
    'lumina2-tiny': 4,
    'lumina2': 24,
    'mochi-1': 24,
    'mochi-tiny': 6,
    'wan2.1-14b': 40,
    'wan-tiny': 6,
    'wan-tiny-tp': 4,
    'wan2.2-tiny': 6,
    'wan2.2-i2v-tiny': 6,
    'wan2.1-i2v-tiny': 6,
    'qwenimage-tiny': 4,
    'qwenimage': 24,
    'sana-1600m': 70,
    'sana-tiny': 6,
    'sana-tiny-tp': 4,
    'sd3.5-large': 38,
    'sd3-tiny': 6,
    'sd3-tiny-tp': 4,
    'skyreels-v2-df-14b': 40,
    'skyreels-v2-df-1.3b': 12,
    'skyreels-v2-tiny': 6,
    'skyreels-v2-i2v-tiny': 6,
    'skyreels-v2-tiny-fps': 6,
}

#: VAE class -> the adapter module of the first adapter (in :data:`CLASSES` order) whose VAE plan names it
VAES: dict[str, str] = {
    'AutoencoderKLLTXVideo': 'ltx',
    'AutoencoderKL': 'flux',
    'AutoencoderKLCogVideoX': 'cogvideox',
    'AutoencoderKLFlux2': 'flux2',
    'AutoencoderKLMochi': 'mochi',
    'AutoencoderKLWan': 'wan',
    'AutoencoderKLQwenImage': 'qwenimage',
}


#: transformer class -> what the checks before any rank starts read of its family, without importing it
#: (:class:`FamilyFacts`): (name, cfg_switch, cfg_hint, frame_step, first_frames) as its adapter has them
FAMILIES: dict[str, tuple[str, str, str, int | None, int]] = {
    'LTXVideoTransformer3DModel': ('ltx-video', 'guidance_scale', '--guidance > 1 (e.g. --guidance 5)', 8, 1),
    'FluxTransformer2DModel': ('flux', 'true_cfg_scale', "a negative prompt with --true-cfg-scale > 1 (e.g. --negative-prompt '' --true-cfg-scale 4)", None, 1),
    'PixArtTransformer2DModel': ('pixart', 'guidance_scale', '--guidance > 1 (e.g. --guidance 5)', None, 1),
    'AllegroTransformer3DModel': ('allegro', 'guidance_scale', '--guidance > 1 (e.g. --guidance 5)', 16, 24),
    'ChromaTransformer2DModel': ('chroma', 'guidance_scale', '--guidance > 1 (e.g. --guidance 5)', None, 1),
    'CogVideoXTransformer3DModel': ('cogvideox', 'guidance_scale', '--guidance > 1 (e.g. --guidance 5)', 4, 1),
    'CogView4Transformer2DModel': ('cogview4', 'guidance_scale', '--guidance > 1 (e.g. --guidance 5)', None, 1),
    'Flux2Transformer2DModel': ('flux2', 'guidance_scale', "--guidance > 1 with a Klein checkpoint (FLUX.2-dev's guidance is distilled: no second branch)", None, 1),
    'HiDreamImageTransformer2DModel': ('hidream', 'guidance_scale', '--guidance > 1 (e.g. --guidance 5)', None, 1),
    'HunyuanDiT2DModel': ('hunyuan-dit', 'guidance_scale', '--guidance > 1 (e.g. --guidance 5)', None, 1),
    'HunyuanVideoTransformer3DModel': ('hunyuan-video', 'true_cfg_scale', "a negative prompt with --true-cfg-scale > 1 (e.g. --negative-prompt ' ' --true-cfg-scale 6)", 4, 1),
    'Lumina2Transformer2DModel': ('lumina2', 'guidance_scale', '--guidance > 1 (e.g. --guidance 4)', None, 1),
    'MochiTransformer3DModel': ('mochi', 'guidance_scale', '--guidance > 1 (e.g. --guidance 5)', 6, 1),
    'WanTransformer3DModel': ('wan', 'guidance_scale', '--guidance > 1 (e.g. --guidance 5)', 4, 1),
    'QwenImageTransformer2DModel': ('qwenimage', 'true_cfg_scale', "a negative prompt with --true-cfg-scale > 1 (e.g. --negative-prompt ' ' --true-cfg-scale 4)", None, 1),
    'SanaTransformer2DModel': ('sana', 'guidance_scale', '--guidance > 1 (e.g. --guidance 5)', None, 1),
    'SD3Transformer2DModel': ('sd3', 'guidance_scale', '--guidance > 1 (e.g. --guidance 5)', None, 1),
    'SkyReelsV2Transformer3DModel': ('skyreels-v2', 'guidance_scale', '--guidance > 1 (e.g. --guidance 5)', 4, 1),
    'ZImageTransformer2DModel': ('zimage', 'guidance_scale', '--guidance > 1 (e.g. --guidance 4; Z-Image-Turbo runs without guidance)', None, 1),
}


@dataclass(frozen=True)
class FamilyFacts:
    """A family's rules that need no model (how CFG is switched on, the frame rule of video families), read from
    :data:`FAMILIES` without importing the family (and torch): the launcher and ``serve`` refuse ``--cfg 2`` without
    guidance and a frame count the family cannot make before any rank starts. :class:`~ditmesh.models.base.ModelAdapter`
    keeps the same fields and these methods (tests/test_registry.py checks the table against it)."""

    name: str
    cfg_switch: str = "guidance_scale"
    cfg_hint: str = "--guidance > 1 (e.g. --guidance 5)"
    frame_step: int | None = None
    first_frames: int = 1

    def cfg_on(self, guidance_scale: float | None, true_cfg_scale: float | None, negative_prompt) -> bool:
        """Whether a pipeline call with these arguments runs both CFG branches."""
        if self.cfg_switch == "true_cfg_scale":
            return negative_prompt is not None and (true_cfg_scale or 0) > 1
        return (guidance_scale or 0) > 1

    def frames_error(self, frames: int) -> str | None:
        """Why a positive frame count ``frames`` breaks this family's frame rule (one line), or None when it keeps it."""
        if self.frame_step is None:
            return None
        step, first = self.frame_step, self.first_frames
        if frames < first or (frames - first) % step:
            lower = max(first, (frames - first) // step * step + first)
            return f"--frames {frames} must be {step}k+{first} for {self.name} (e.g. {lower} or {lower + step})"
        return None


def family_facts(class_name: str) -> FamilyFacts | None:
    """The :class:`FamilyFacts` of a transformer class (None: no family has it)."""
    row = FAMILIES.get(class_name)
    return FamilyFacts(*row) if row else None


def video_families() -> list[str]:
    """The names of the video families (those with a frame rule), in :data:`CLASSES` order, each once."""
    return list(dict.fromkeys(row[0] for row in FAMILIES.values() if row[3] is not None))


def supported_classes() -> list[str]:
    """Names of the diffusers transformer classes ditmesh can parallelize."""
    return sorted(CLASSES)


def import_family(module: str):
    """Import the adapter module ``ditmesh.models.<module>`` (registering its adapters); returns it."""
    return importlib.import_module(f"{__package__}.{module}")


class Archs(Mapping):
    """The synthetic architectures by name (``ditmesh.synth.ARCHS``): the names without any import; looking one
    up imports its family's module and gives its :class:`~ditmesh.models.base.SynthArch`."""

    def __getitem__(self, name: str):
        if name not in SYNTH:
            raise KeyError(name)
        family = import_family(SYNTH[name][0])
        return next(arch for adapter in family_adapters(family) for arch in adapter.synth_archs if arch.name == name)

    def __contains__(self, name) -> bool:
        return name in SYNTH

    def __iter__(self) -> Iterator[str]:
        return iter(SYNTH)

    def __len__(self) -> int:
        return len(SYNTH)


def family_adapters(family) -> list:
    """The adapters the module ``family`` registers (those of :data:`CLASSES` that name it)."""
    from .base import adapter_for_class

    name = family.__name__.rsplit(".", 1)[-1]
    return [adapter_for_class(cls) for cls, module in CLASSES.items() if module == name]


#: every synthetic architecture by name, loaded on look-up
ARCHS = Archs()
