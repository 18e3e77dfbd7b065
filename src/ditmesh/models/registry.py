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
    'ChronoEditTransformer3DModel': 'wan_variants',
    'WanVACETransformer3DModel': 'wan_variants',
    'WanAnimateTransformer3DModel': 'wan_variants',
    'HunyuanVideo15Transformer3DModel': 'hunyuan_variants',
    'LTX2VideoTransformer3DModel': 'ltx2',
    'Kandinsky5Transformer3DModel': 'kandinsky5',
    'Kandinsky6Transformer3DModel': 'kandinsky6',
    'SanaVideoTransformer3DModel': 'sana_variants',
    'SanaWMTransformer3DModel': 'sana_wm',
    'HunyuanVideoFramepackTransformer3DModel': 'hunyuan_variants',
    'CosmosTransformer3DModel': 'cosmos',
    'EasyAnimateTransformer3DModel': 'easyanimate',
    'LongCatImageTransformer2DModel': 'flux_like',
    'OvisImageTransformer2DModel': 'flux_like',
    'BriaTransformer2DModel': 'flux_like',
    'QwenImage21Transformer2DModel': 'qwenimage21',
    'BriaFiboTransformer2DModel': 'flux_like',
    'HunyuanImageTransformer2DModel': 'hunyuan_image',
    'Krea2Transformer2DModel': 'krea2',
    'Ideogram4Transformer2DModel': 'ideogram4',
    'ErnieImageTransformer2DModel': 'ernie_image',
    'AuraFlowTransformer2DModel': 'auraflow',
    'CogView3PlusTransformer2DModel': 'cogview3plus',
    'DiTTransformer2DModel': 'dit',
    'StableAudioDiTModel': 'stable_audio',
    'PRXTransformer2DModel': 'prx',
    'LuminaNextDiT2DModel': 'lumina_next',
    'AceStepTransformer1DModel': 'ace_step',
    'AnyFlowTransformer3DModel': 'anyflow',
    'AnyFlowFARTransformer3DModel': 'anyflow',
    'JoyImageEditTransformer3DModel': 'joyimage',
    'JoyImageEditPlusTransformer3DModel': 'joyimage',
    'OmniGenTransformer2DModel': 'omnigen',
    'HeliosTransformer3DModel': 'helios',
    'StableAudio3DiTModel': 'stable_audio3',
    'LongCatAudioDiTTransformer': 'longcat_audio',
    'GlmImageTransformer2DModel': 'glm_image',
    'NucleusMoEImageTransformer2DModel': 'nucleusmoe',
    'LatteTransformer3DModel': 'latte',
    'Kandinsky6SRTransformer3DModel': 'kandinsky6_sr',
    'BriaFibo2Transformer2DModel': 'bria_fibo2',
    'MotifVideoTransformer3DModel': 'motif_video',
    'Cosmos3OmniTransformer': 'cosmos3',
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
    'chronoedit-14b': ('wan_variants', "ChronoEdit-14B transformer (Wan2.1-I2V-14B's: 40 blocks, 40 heads x 128, 36 "
                                       'channels in, CLIP image tokens), full Wan VAE, small UMT5, a one-layer CLIP '
                                       'vision encoder'),
    'chronoedit-tiny': ('wan_variants', "ChronoEdit shrunk for CPU tests: diffusers' test config (2 blocks, 2 heads "
                                        "x 8) reading 36 channels and a tiny CLIP vision encoder's tokens, tiny Wan "
                                        'VAE'),
    'wan2.1-vace-14b': ('wan_variants', 'Wan2.1-VACE-14B transformer (40 blocks and 8 VACE blocks, 40 heads x 128), '
                                        'full Wan VAE, small UMT5'),
    'wan-vace-tiny': ('wan_variants', "Wan VACE shrunk for CPU tests: diffusers' test config (4 blocks, VACE blocks "
                                      'at 0 and 2, 2 heads x 12) with 96 control channels, tiny Wan VAE'),
    'wan2.2-animate-14b': ('wan_variants', 'Wan2.2-Animate-14B transformer (40 blocks, 40 heads x 128, a face '
                                           'adapter every 5 blocks, motion and face encoders), full Wan VAE, small '
                                           'UMT5, a one-layer CLIP vision encoder'),
    'wan-animate-tiny': ('wan_variants', "Wan Animate shrunk for CPU tests: diffusers' test config (2 blocks, 2 "
                                         'heads x 12, one face adapter, a 16-pixel motion encoder), tiny Wan VAE'),
    'hunyuan-video-1.5': ('hunyuan_variants', 'HunyuanVideo 1.5 (8.3B) transformer (54 dual-stream blocks, 16 heads '
                                              'x 128, 2 refiner blocks; Qwen prompt, ByT5 glyph and SigLIP image '
                                              'tokens in the text stream)'),
    'hunyuan-video-1.5-tiny': ('hunyuan_variants', "HunyuanVideo 1.5 shrunk for CPU tests: diffusers' test config (2 "
                                                   'blocks, 1 refiner block, 2 heads x 8, patch 1) reading 9 '
                                                   'channels, a tiny 16x VAE, Qwen2.5-VL text model and ByT5'),
    'ltx-2': ('ltx2', 'LTX-2 transformer (48 blocks, video 32 heads x 128 and audio 32 heads x 64 streams, 19B '
                      'params), the LTX-2 video and audio VAEs, connectors and vocoder, a 48-layer Gemma 3 of '
                      "Gemma-3-12B's width"),
    'ltx-2-tiny': ('ltx2', "LTX-2 shrunk for CPU tests: diffusers' test config (2 blocks, video 2 heads x 8, audio 2 "
                           "heads x 4), its pipeline test's VAEs, connectors and vocoder, a two-layer Gemma 3"),
    'kandinsky5-lite': ('kandinsky5', 'Kandinsky 5.0 Video Lite transformer (2 text + 32 visual blocks, 28 heads x '
                                      '64, 2B params), the HunyuanVideo VAE, a two-layer Qwen2.5-VL of '
                                      "Qwen2.5-VL-7B's width, a one-layer CLIP-L"),
    'kandinsky5-tiny': ('kandinsky5', "Kandinsky 5 shrunk for CPU tests: diffusers' pipeline test's transformer (1 "
                                      'text + 2 visual blocks, 4 heads x 4), its tiny HunyuanVideo VAE, Qwen2.5-VL '
                                      'and CLIP'),
    'kandinsky6': ('kandinsky6', 'Kandinsky 6 transformer (4 + 4 text and 60 fused video-audio blocks, video 32 '
                                 "heads x 128), Kandinsky 5's VAE, Qwen2.5-VL and CLIP-L, the MMAudio VAE (20 latent "
                                 'channels) and vocoder'),
    'kandinsky6-tiny': ('kandinsky6', 'Kandinsky 6 shrunk for CPU tests: 1 + 1 text and 2 fused blocks, video 4 '
                                      "heads x 4, audio 2 heads x 4, the released flags; Kandinsky 5's tiny VAE, "
                                      'Qwen2.5-VL and CLIP, a tiny MMAudio VAE and vocoder'),
    'sana-video-2b': ('sana_variants', 'Sana-Video 2B transformer (20 blocks, linear attention 20 heads x 112, '
                                       'cross-attention 20 x 112, Mix-FFN with a temporal convolution), Wan 2.1 VAE, '
                                       'one-layer Gemma-2'),
    'sana-video-tiny': ('sana_variants', "Sana-Video shrunk for CPU tests: diffusers' test config (2 blocks, 2 heads "
                                         'x 12), tiny Wan VAE, a 16-wide Gemma-2'),
    'sana-wm-1600m': ('sana_wm', 'Sana-WM 1600M bidirectional transformer (20 blocks of 2240: gated delta nets of 20 '
                                 'heads x 112, softmax every 4th, UCPE camera branches, Plucker rays), LTX-2 VAE, '
                                 'one-layer Gemma-2'),
    'sana-wm-tiny': ('sana_wm', "Sana-WM shrunk for CPU tests: diffusers' test config (2 blocks of 32, gated delta net "
                                "then softmax, 2 heads x 16), LTX-2's tiny VAE, a 16-wide Gemma-2"),
    'sana-wm-tiny-3h': ('sana_wm', 'sana-wm-tiny with 3 heads x 16 in both attentions (48 wide) and short convolutions '
                                   'on Q, K and V'),
    'hunyuan-video-framepack': ('hunyuan_variants', 'HunyuanVideo Framepack (FramePackI2V_HY) transformer '
                                                    "(HunyuanVideo's 20 dual + 40 single blocks, 24 heads x 128, "
                                                    'history patch embedders, SigLIP image projection), '
                                                    "HunyuanVideo's VAE, Llama and CLIP-L, a one-layer SigLIP "
                                                    'so400m-wide image encoder'),
    'hunyuan-video-framepack-tiny': ('hunyuan_variants', "HunyuanVideo Framepack shrunk for CPU tests: diffusers' "
                                                         'test config (1 dual + 1 single block, 2 heads x 10), a '
                                                         'tiny HunyuanVideo VAE, Llama, CLIP and SigLIP image '
                                                         'encoder'),
    'cosmos-1.0-7b': ('cosmos', 'Cosmos-1.0-Diffusion-7B-Text2World transformer (28 blocks, 32 heads x 128); the '
                                'transformer alone'),
    'cosmos-tiny': ('cosmos', "Cosmos shrunk for CPU tests: diffusers' test config (2 blocks, 2 heads x 12, "
                              'learnable position embedding) without the padding-mask channel; the transformer alone'),
    'easyanimate-v5.1-12b': ('easyanimate', 'EasyAnimateV5.1-12B transformer (48 blocks, 48 heads x 64, MMDiT text '
                                            'projections throughout), the Magvit VAE, a two-layer Qwen2-VL of '
                                            "Qwen2-VL-7B's width"),
    'easyanimate-tiny': ('easyanimate', "EasyAnimate shrunk for CPU tests: diffusers' test config (2 MMDiT blocks, 2 "
                                        "heads x 16), a tiny Magvit VAE (diffusers' pipeline test's) and Qwen2-VL"),
    'longcat-image-tiny': ('flux_like', "LongCat-Image shrunk for CPU tests: diffusers' test configuration (1 "
                                        'double + 1 single block, 2 heads x 16), a tiny VAE and Qwen2.5-VL'),
    'longcat-image': ('flux_like', 'LongCat-Image transformer (19 double + 38 single blocks, 24 heads x 128, text'
                                   " width 3584), FLUX.1's VAE, a one-layer Qwen2.5-VL text encoder"),
    'ovis-image-tiny': ('flux_like', "Ovis-Image shrunk for CPU tests: diffusers' test configuration (1 double +"
                                     ' 1 single block, 2 heads x 16, SwiGLU), a tiny VAE and Qwen3'),
    'ovis-image': ('flux_like', 'Ovis-Image 7B transformer (6 double + 27 single blocks, 24 heads x 128, SwiGLU, '
                                "text width 2048), FLUX.1's VAE, a one-layer Qwen3 text encoder of Qwen3-1.7B's "
                                'width'),
    'bria-tiny': ('flux_like', "Bria shrunk for CPU tests: diffusers' test configuration (1 double + 1 single "
                               'block, 2 heads x 16, RoPE axes 0 + 8 + 8, text width 64), a tiny VAE and T5'),
    'bria-3.2': ('flux_like', "Bria 3.2 transformer as diffusers' defaults (19 double + 38 single blocks, 24 heads"
                              " x 128, text width 4096), FLUX.1's VAE, a one-layer T5-XXL-wide encoder"),
    'qwenimage21-tiny': ('qwenimage21', 'Qwen-Image 2.1 shrunk for CPU tests: 2 single-stream blocks, 4 heads x '
                                        '16, text width 32; a 16x VAE 4 channels wide without residual blocks, a '
                                        'two-layer Qwen3-VL'),
    'qwenimage21': ('qwenimage21', "Qwen-Image 2.1 transformer as diffusers' defaults (32 single-stream blocks, 32"
                                   ' heads x 128, text width 4096, block-causal attention), its VAE, a two-layer '
                                   "Qwen3-VL of Qwen3-VL-8B's width"),
    'bria-fibo-tiny': ('flux_like', "Bria FIBO shrunk for CPU tests: diffusers' test configuration (1 double + 1 "
                                    'single block, 2 heads x 8, text width 64, text-encoder layers 32 wide), a tiny '
                                    'Wan 2.2 VAE and SmolLM3'),
    'bria-fibo': ('flux_like', "Bria FIBO transformer as diffusers' defaults (19 double + 38 single blocks, 24 heads "
                               'x 128, text width 4096, text-encoder layers 2048 wide), the Wan 2.2 VAE, a two-layer '
                               "SmolLM3 of SmolLM3-3B's width"),
    'hunyuan-image-tiny': ('hunyuan_image', 'HunyuanImage 2.1 shrunk for CPU tests: 2 dual + 2 single blocks, 1 '
                                            'refiner block, 4 heads x 16, a 24-wide glyph stream; a tiny 32x VAE, '
                                            'Qwen2.5-VL and ByT5'),
    'hunyuan-image-2.1': ('hunyuan_image', 'HunyuanImage 2.1 transformer (20 dual + 40 single blocks, 28 heads x '
                                           '128, 2 refiner blocks, text width 3584, ByT5 glyph stream 1472), its 32x '
                                           "VAE, a three-layer Qwen2.5-VL of Qwen2.5-VL-7B's width, a one-layer "
                                           'ByT5-small, the adaptive projected guider'),
    'krea2-tiny': ('krea2', "Krea 2 at diffusers' test configuration: 2 blocks, 4 query / 2 key-value heads x 8, 3 "
                            'tapped text layers of 16; a tiny QwenImage VAE and a 3-layer Qwen3-VL'),
    'krea2': ('krea2', "Krea 2 transformer as diffusers' defaults (28 blocks, 48 query / 12 key-value heads x 128, "
                       'FFN 16384, 12 tapped text layers of 2560), the QwenImage VAE, a 12-layer Qwen3-VL of '
                       "Qwen3-VL-4B's width whose 12 layers are the tapped ones"),
    'ideogram4-tiny': ('ideogram4', "Ideogram 4 at diffusers' test configuration (2 blocks, 4 heads x 8) with text "
                                    'features 26 wide (13 tapped layers of 2); a tiny FLUX.2 VAE and 36-layer '
                                    'Qwen3-VL'),
    'ideogram4': ('ideogram4', "Ideogram 4 transformer as diffusers' defaults (34 blocks, 18 heads x 256, FFN 12288, "
                               "text features 53248 wide) and its unconditional twin, FLUX.2's VAE, a 36-layer "
                               "Qwen3-VL of Qwen3-VL-8B's width"),
    'ernie-image-tiny': ('ernie_image', "ERNIE-Image at diffusers' test configuration: 1 block, 1 head x 16, text "
                                        'width 16; a tiny FLUX.2 VAE and Mistral 3'),
    'ernie-image': ('ernie_image', "ERNIE-Image transformer as diffusers' defaults (24 blocks, 24 heads x 128, FFN "
                                   "8192, text width 2560), FLUX.2's VAE, a two-layer Mistral 3 of Ministral-3-3B's "
                                   'width (no prompt enhancer)'),
    'auraflow-tiny': ('auraflow', "AuraFlow at diffusers' test configuration: 1 joint + 1 single block, 4 heads x 8, "
                                  'text width 32; a tiny VAE and UMT5'),
    'auraflow': ('auraflow', "AuraFlow v0.3 transformer as diffusers' defaults (4 joint + 32 single blocks, 12 heads "
                             "x 256, text width 2048), the SDXL VAE, a one-layer UMT5 of Pile-T5-XL's width"),
    'cogview3plus-tiny': ('cogview3plus', "CogView3-Plus at diffusers' test configuration: 2 blocks, 2 heads x 4, "
                                          'text width 8; a tiny VAE and T5'),
    'cogview3plus': ('cogview3plus', "CogView3-Plus-3B transformer as diffusers' defaults (30 blocks, 64 heads x 40, "
                                     'text width 4096), a 16-channel AutoencoderKL, a one-layer T5-XXL-wide encoder'),
    'dit-tiny': ('dit', "DiT at diffusers' test configuration: 1 block, 2 heads x 4, 8 classes (named cat, dog, "
                        "tree, house, car, flower, mountain, sea); a tiny VAE; no CFG (the pipeline's null class is "
                        '1000)'),
    'dit-xl-2-256': ('dit', 'DiT-XL/2-256 transformer (28 blocks, 16 heads x 72, 1000 classes), the SD VAE; classes '
                            'by id'),
    'stable-audio-tiny': ('stable_audio', "Stable Audio at diffusers' test configuration: 2 blocks, 24 heads x 4, 2 "
                                          'key-value heads; its tiny Oobleck VAE (4 Hz stereo), T5 and projection'),
    'stable-audio-open': ('stable_audio', "Stable Audio Open 1.0 transformer as diffusers' defaults (24 blocks, 24 "
                                          'heads x 64, 12 key-value heads in the cross-attention, 1024 latent '
                                          "samples), the Oobleck VAE, a one-layer T5 of T5-base's width, the "
                                          'duration projection'),
    'prx-tiny': ('prx', 'PRX shrunk for CPU tests: 2 blocks, 4 heads x 16, text width 32; a tiny VAE and T5Gemma'),
    'prx': ('prx', "PRX transformer as diffusers' defaults (16 blocks, 28 heads x 64, text width 2304), FLUX.1's "
                   "VAE, a one-layer T5Gemma encoder of T5Gemma-2B's width"),
    'lumina-next-tiny': ('lumina_next', 'Lumina-Next shrunk for CPU tests: 2 blocks, 4 query / 2 key-value heads x '
                                        '8, text width 8; a tiny VAE and Gemma'),
    'lumina-next-sft': ('lumina_next', 'Lumina-Next-SFT 2B transformer (24 blocks, 32 query / 8 key-value heads x '
                                       "72, Gemma-2B text), the SDXL VAE, a one-layer Gemma of Gemma-2B's width"),
    'ace-step-tiny': ('ace_step', "ACE-Step at diffusers' test configuration: 2 layers, 4 query / 2 key-value heads "
                                  "x 8, windows of 16; its pipeline test's condition encoder, Qwen3 and Oobleck VAE"),
    'ace-step-1.5': ('ace_step', "ACE-Step 1.5 transformer as diffusers' defaults (24 layers, 16 query / 8 key-value "
                                 'heads x 128, sliding windows of 128), its condition encoder, a one-layer Qwen3 of '
                                 "Qwen3-Embedding-0.6B's width, an Oobleck VAE of 64 channels"),
    'anyflow-14b': ('anyflow', "AnyFlow 14B transformer (Wan2.1-T2V-14B's blocks: 40 blocks, 40 heads x 128, FFN "
                               '13824; flow-map timesteps), full Wan VAE, small UMT5'),
    'anyflow-tiny': ('anyflow', "AnyFlow at diffusers' test configuration (2 blocks, 2 heads x 12, text width 16), "
                                'a tiny Wan VAE of 4 latent channels, a 16-wide UMT5'),
    'anyflow-far-1.3b': ('anyflow', "AnyFlow-FAR 1.3B transformer (Wan2.1-T2V-1.3B's blocks: 30 blocks, 12 heads x "
                                    '128, FFN 8960; chunks 1 + 3 x 6 + 2 latent frames, the last 3 full, older ones '
                                    '4x4-patched), full Wan VAE, small UMT5'),
    'anyflow-far-tiny': ('anyflow', "AnyFlow-FAR at diffusers' test configuration (2 blocks, 2 heads x 12, the last "
                                    '3 chunks full) in 4 one-frame chunks, a tiny Wan VAE of 4 latent channels, a '
                                    '16-wide UMT5'),
    'anyflow-far-tiny3': ('anyflow', 'anyflow-far-tiny with 3 heads, the last 2 chunks full, chunks of 2, 1 and 2 '
                                     'latent frames'),
    'joyimage-edit-tiny': ('joyimage', "JoyImage-Edit at diffusers' test configuration: 2 blocks, 2 heads x 16, text "
                                       'width 16; a Wan VAE 2 channels wide without residual blocks (the pipeline '
                                       'decodes 1024 x 1024) and a two-layer Qwen3-VL'),
    'joyimage-edit': ('joyimage', "JoyImage-Edit transformer as diffusers' defaults (20 dual-stream blocks, 24 heads "
                                  "x 128, text width 4096), the Wan VAE, a two-layer Qwen3-VL of Qwen3-VL-8B's width"),
    'joyimage-edit-plus-tiny': ('joyimage', "JoyImage-Edit Plus at diffusers' test configuration: 2 blocks, 2 heads x"
                                            " 16, text width 16; JoyImage-Edit's tiny Wan VAE and two-layer Qwen3-VL"),
    'joyimage-edit-plus': ('joyimage', "JoyImage-Edit Plus transformer as diffusers' defaults (20 dual-stream blocks,"
                                       ' 24 heads x 128, text width 4096), the Wan VAE, a two-layer Qwen3-VL of '
                                       "Qwen3-VL-8B's width"),
    'omnigen-tiny': ('omnigen', "OmniGen at diffusers' test configuration (4 heads x 4, a 1000-token vocabulary) with "
                                '2 layers; a tiny SDXL VAE, a local Llama tokenizer'),
    'omnigen-v1': ('omnigen', "OmniGen-v1 transformer as diffusers' defaults (32 layers, 32 heads x 96, Phi-3's "
                              '32064-token vocabulary), the SDXL VAE, a local Llama tokenizer'),
    'helios-tiny': ('helios', "Helios at diffusers' test configuration: 2 blocks, 2 heads x 12, text width 16; a "
                              'tiny Wan VAE of 4 latent channels, UMT5'),
    'helios-14b': ('helios', "Helios 14B transformer as diffusers' defaults (Wan2.1-14B's 40 blocks, 40 heads x 128, "
                             "FFN 13824; long, mid and short history), the Wan 2.1 VAE, a one-layer UMT5 of "
                             "UMT5-XXL's width"),
    'stable-audio-3-tiny': ('stable_audio3', "Stable Audio 3 at diffusers' pipeline test configuration: 2 blocks, 4 "
                                             'heads x 8, 3 memory tokens, plain attention; its tiny SAME autoencoder '
                                             '(16 Hz stereo), T5Gemma and duration embedder'),
    'stable-audio-3': ('stable_audio3', "Stable Audio 3 transformer as diffusers' defaults (24 blocks, 24 heads x 64, "
                                        'differential attention, 64 memory tokens), the SAME audio autoencoder, a '
                                        'one-layer T5Gemma encoder 768 wide, the duration embedder'),
    'longcat-audio-dit-tiny': ('longcat_audio', "LongCat-Audio-DiT at diffusers' test configuration: 2 blocks, 4 "
                                                "heads x 16, text width 32, no text ConvNeXt; its pipeline test's VAE at "
                                                '8 Hz, UMT5'),
    'longcat-audio-dit': ('longcat_audio', "LongCat-Audio-DiT transformer as diffusers' defaults (24 blocks, 24 heads x "
                                           '64, text width 768, long skip, text ConvNeXt), its audio VAE (24 kHz mono, '
                                           "2048x), a one-layer UMT5 of UMT5-base's width"),
    'glm-image-tiny': ('glm_image', "GLM-Image at diffusers' test configuration (2 heads x 8, text width 32, a "
                                    "64-token prior codebook) with 2 blocks; its pipeline test's KL VAE and "
                                    'autoregressive prior, a one-layer ByT5'),
    'glm-image': ('glm_image', "GLM-Image's diffusion transformer as diffusers' defaults (30 blocks, 64 heads x 40, "
                               'glyph text 1472 wide, a 16384-token prior codebook), a 16-channel KL VAE, a one-layer'
                               " ByT5 glyph encoder and a two-layer autoregressive GLM-Image prior of GLM-4's width"),
    'nucleusmoe-image-tiny': ('nucleusmoe', "Nucleus-MoE at diffusers' test configuration: 2 dense blocks, 4 heads x "
                                            "16, text width 16; its pipeline test's QwenImage VAE and 8-layer "
                                            'Qwen3-VL'),
    'nucleusmoe-image': ('nucleusmoe', "Nucleus-MoE image transformer as diffusers' defaults (24 blocks, 16 heads x "
                                       '128, 128 experts with expert-choice routing, text width 3584), the QwenImage '
                                       'VAE, an 8-layer Qwen3-VL of that width (the pipeline reads its 8th-last '
                                       'hidden state)'),
    'latte-tiny': ('latte', "Latte at diffusers' test configuration (1 layer, 2 heads x 4, caption 8 wide) with 2 "
                            "frames; PixArt's tiny VAE, a T5 8 wide"),
    'latte-tiny-odd': ('latte', 'latte-tiny with 2 layers, 3 heads x 8 and 3 frames, for odd position counts and '
                                'heads'),
    'latte-1': ('latte', 'Latte-1 transformer (28 spatial and 28 temporal blocks, 16 heads x 72, 16 frames), the SD '
                         "VAE, one-layer T5 of T5-XXL's width"),
    'kandinsky6-sr-tiny': ('kandinsky6_sr', "Kandinsky 6 SR at diffusers' test configuration: 2 blocks, 2 heads x "
                                            '12, patch 1 x 2 x 2; the transformer alone'),
    'kandinsky6-sr-tiny-sparse': ('kandinsky6_sr', 'kandinsky6-sr-tiny with 3 heads and a sparse NABLA (window 1 x 1 '
                                                   'x 1, threshold 0.5)'),
    'kandinsky6-sr': ('kandinsky6_sr', "Kandinsky 6 SR transformer as diffusers' defaults (32 blocks, 28 heads x 64, "
                                       "640 output channels: the distilled checkpoints' head), the transformer alone"),
    'bria-fibo2-tiny': ('bria_fibo2', "Bria FIBO 2 at diffusers' test configuration: 2 blocks (the second an "
                                      'injection block) + 1 refiner, 2 heads x 16, a 1-layer Perceiver of 4 to 8 gist '
                                      'tokens; a tiny FLUX.2 VAE and 36-layer Qwen3-VL'),
    'bria-fibo2': ('bria_fibo2', "Bria FIBO 2 transformer as diffusers' defaults (44 blocks + 2 refiners, 28 heads x "
                                 '128, 5 injection blocks, a 2-layer Perceiver of 256 to 512 gist tokens, text bundles '
                                 "7680 wide), FLUX.2's VAE, a 36-layer Qwen3-VL of Qwen3-VL-4B's width, narrow inside"),
    'motif-video-tiny': ('motif_video', "Motif-Video at diffusers' test configuration: 1 dual + 1 single block, 2 "
                                        'heads x 12, 1x1 patches, text width 32, image embeddings 4 wide; a tiny Wan '
                                        'VAE and T5Gemma 2 encoder'),
    'motif-video': ('motif_video', "Motif-Video-2B's block layout (12 dual + 16 single + 8 decoder blocks, as "
                                   "diffusers' docs give it) at diffusers' default width (24 heads x 128, text width "
                                   '4096, 33 input channels), the Wan 2.1 VAE, a one-layer T5Gemma 2 encoder of that '
                                   'width'),
    'cosmos3-omni': ('cosmos3', "Cosmos 3 Omni transformer as diffusers' defaults (36 layers, 32 query / 8 "
                              'key-value heads x 128, FFN 12288, Qwen3\'s vocabulary), the Wan 2.2 VAE, a '
                              'local byte-level tokenizer; no sound'),
    'cosmos3-omni-tiny': ('cosmos3', 'Cosmos 3 Omni shrunk for CPU tests: 2 layers, 4 query / 2 key-value heads x '
                                   '8, a 4-channel Wan 2.2 VAE, a byte-level tokenizer of ~800 tokens'),
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
    'chronoedit-14b': 40,
    'chronoedit-tiny': 2,
    'wan2.1-vace-14b': 40,
    'wan-vace-tiny': 2,
    'wan2.2-animate-14b': 40,
    'wan-animate-tiny': 2,
    'hunyuan-video-1.5': 16,
    'hunyuan-video-1.5-tiny': 2,
    'ltx-2': 32,
    'ltx-2-tiny': 2,
    'sana-video-2b': 20,
    'sana-video-tiny': 2,
    'sana-wm-1600m': 20,
    'sana-wm-tiny': 2,
    'sana-wm-tiny-3h': 3,
    'hunyuan-video-framepack': 24,
    'hunyuan-video-framepack-tiny': 2,
    'cosmos-1.0-7b': 32,
    'cosmos-tiny': 2,
    'easyanimate-v5.1-12b': 48,
    'easyanimate-tiny': 2,
    'longcat-image-tiny': 2,
    'longcat-image': 24,
    'ovis-image-tiny': 2,
    'ovis-image': 24,
    'bria-tiny': 2,
    'bria-3.2': 24,
    'qwenimage21-tiny': 4,
    'qwenimage21': 32,
    'bria-fibo-tiny': 2,
    'bria-fibo': 24,
    'hunyuan-image-tiny': 4,
    'hunyuan-image-2.1': 28,
    'krea2-tiny': 4,
    'krea2': 48,
    'ideogram4-tiny': 4,
    'ideogram4': 18,
    'ernie-image-tiny': 1,
    'ernie-image': 24,
    'auraflow-tiny': 4,
    'auraflow': 12,
    'cogview3plus-tiny': 2,
    'cogview3plus': 64,
    'dit-tiny': 2,
    'dit-xl-2-256': 16,
    'stable-audio-tiny': 24,
    'stable-audio-open': 24,
    'lumina-next-tiny': 4,
    'lumina-next-sft': 32,
    'ace-step-tiny': 4,
    'ace-step-1.5': 16,
    'anyflow-14b': 40,
    'anyflow-tiny': 2,
    'anyflow-far-1.3b': 12,
    'anyflow-far-tiny': 2,
    'anyflow-far-tiny3': 3,
    'joyimage-edit-tiny': 2,
    'joyimage-edit': 24,
    'joyimage-edit-plus-tiny': 2,
    'joyimage-edit-plus': 24,
    'omnigen-tiny': 4,
    'omnigen-v1': 32,
    'helios-tiny': 2,
    'helios-14b': 40,
    'glm-image-tiny': 2,
    'glm-image': 64,
    'nucleusmoe-image-tiny': 4,
    'latte-tiny': 2,
    'latte-tiny-odd': 3,
    'latte-1': 16,
    'motif-video-tiny': 2,
    'motif-video': 24,
    'cosmos3-omni': 32,
    'cosmos3-omni-tiny': 4,
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


#: diffusers transformer classes that are not diffusion transformers over latent tokens, with why ditmesh refuses them
#: (one line each: the generality table and the refusal name it)
NOT_DITS: dict[str, str] = {
    'Transformer2DModel': "VQ-Diffusion's transformer (a deprecated pipeline): discrete diffusion over VQ codebook indices, "
                          'returning per-pixel class log-probabilities, not a latent',
    'UVit2DModel': "aMUSEd's U-ViT: masked-token prediction over a VQ codebook (logits) through convolutional down and "
                   'up blocks around its transformer, not a diffusion transformer over latent tokens',
    'RFD4ProteinaTransformer': 'a protein-structure denoiser: its pair representation [B, N, N, C], updated by triangle '
                               'multiplications and biasing every attention, mixes all token pairs outside attention',
}


#: diffusion transformers of diffusers' pipelines that ditmesh has no adapter for yet, each with what it is and what
#: blocks an exact split of it (one line each: the generality table and the refusal name it); an adapter written for
#: one takes it off this table (tests/test_registry.py holds the tables apart)
NOT_ADAPTED: dict[str, str] = {
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
    'ChronoEditTransformer3DModel': ('chronoedit', 'guidance_scale', '--guidance > 1 (e.g. --guidance 5)', 4, 1),
    'WanVACETransformer3DModel': ('wan-vace', 'guidance_scale', '--guidance > 1 (e.g. --guidance 5)', 4, 1),
    'WanAnimateTransformer3DModel': ('wan-animate', 'guidance_scale', '--guidance > 1 (e.g. --guidance 5)', 4, 1),
    'HunyuanVideo15Transformer3DModel': ('hunyuan-video-1.5', 'guidance_scale', "the checkpoint's guider (guider/config.json guidance_scale > 1)", 4, 1),
    'LTX2VideoTransformer3DModel': ('ltx-2', 'guidance_scale', '--guidance > 1 (e.g. --guidance 5)', 8, 1),
    'Kandinsky5Transformer3DModel': ('kandinsky5', 'guidance_scale', '--guidance > 1 (e.g. --guidance 5)', 4, 1),
    'Kandinsky6Transformer3DModel': ('kandinsky6', 'guidance_scale', '--guidance > 1 (e.g. --guidance 5)', 4, 1),
    'SanaVideoTransformer3DModel': ('sana-video', 'guidance_scale', '--guidance > 1 (e.g. --guidance 5)', 4, 1),
    'SanaWMTransformer3DModel': ('sana-wm', 'guidance_scale', '--guidance > 1 (e.g. --guidance 5)', 8, 1),
    'HunyuanVideoFramepackTransformer3DModel': ('hunyuan-video-framepack', 'guidance_scale', '--guidance > 1 (e.g. --guidance 5)', None, 1),
    'CosmosTransformer3DModel': ('cosmos', 'guidance_scale', '--guidance > 1 (e.g. --guidance 5)', 8, 1),
    'EasyAnimateTransformer3DModel': ('easyanimate', 'guidance_scale', '--guidance > 1 (e.g. --guidance 5)', 4, 1),
    'LongCatImageTransformer2DModel': ('longcat-image', 'guidance_scale', '--guidance > 1 (e.g. --guidance 5)', None, 1),
    'OvisImageTransformer2DModel': ('ovis-image', 'guidance_scale', '--guidance > 1 (e.g. --guidance 5)', None, 1),
    'BriaTransformer2DModel': ('bria', 'guidance_scale', '--guidance > 1 (e.g. --guidance 5)', None, 1),
    'QwenImage21Transformer2DModel': ('qwenimage21', 'true_cfg_scale', "a negative prompt with --true-cfg-scale > 1 (e.g. --negative-prompt ' ' --true-cfg-scale 4)", None, 1),
    'BriaFiboTransformer2DModel': ('bria-fibo', 'guidance_scale', '--guidance > 1 (e.g. --guidance 5)', None, 1),
    'HunyuanImageTransformer2DModel': ('hunyuan-image', 'guidance_scale', "the pipeline's guider (guidance_scale > 1 on a non-distilled checkpoint)", None, 1),
    'Krea2Transformer2DModel': ('krea2', 'guidance_scale', '--guidance > 1 (e.g. --guidance 5)', None, 1),
    'Ideogram4Transformer2DModel': ('ideogram4', 'guidance_scale', '--guidance > 1 (e.g. --guidance 5)', None, 1),
    'ErnieImageTransformer2DModel': ('ernie-image', 'guidance_scale', '--guidance > 1 (e.g. --guidance 5)', None, 1),
    'AuraFlowTransformer2DModel': ('auraflow', 'guidance_scale', '--guidance > 1 (e.g. --guidance 5)', None, 1),
    'CogView3PlusTransformer2DModel': ('cogview3plus', 'guidance_scale', '--guidance > 1 (e.g. --guidance 5)', None, 1),
    'DiTTransformer2DModel': ('dit', 'guidance_scale', '--guidance > 1 (e.g. --guidance 5)', None, 1),
    'StableAudioDiTModel': ('stable-audio', 'guidance_scale', '--guidance > 1 (e.g. --guidance 5)', None, 1),
    'PRXTransformer2DModel': ('prx', 'guidance_scale', '--guidance > 1 (e.g. --guidance 5)', None, 1),
    'LuminaNextDiT2DModel': ('lumina-next', 'guidance_scale', '--guidance > 1 (e.g. --guidance 5)', None, 1),
    'AceStepTransformer1DModel': ('ace-step', 'guidance_scale', '--guidance > 1 (e.g. --guidance 5)', None, 1),
    'AnyFlowTransformer3DModel': ('anyflow', 'guidance_scale', '--guidance > 1 (e.g. --guidance 5)', 4, 1),
    'AnyFlowFARTransformer3DModel': ('anyflow-far', 'guidance_scale', '--guidance > 1 (e.g. --guidance 5)', 4, 1),
    'JoyImageEditTransformer3DModel': ('joyimage-edit', 'guidance_scale', '--guidance > 1 (e.g. --guidance 5)', None, 1),
    'JoyImageEditPlusTransformer3DModel': ('joyimage-edit-plus', 'guidance_scale', '--guidance > 1 (e.g. --guidance 5)', None, 1),
    'OmniGenTransformer2DModel': ('omnigen', 'guidance_scale', '--guidance > 1 (e.g. --guidance 5)', None, 1),
    'HeliosTransformer3DModel': ('helios', 'guidance_scale', '--guidance > 1 (e.g. --guidance 5)', 4, 1),
    'StableAudio3DiTModel': ('stable-audio-3', 'guidance_scale', '--guidance > 1 (e.g. --guidance 5)', None, 1),
    'LongCatAudioDiTTransformer': ('longcat-audio-dit', 'guidance_scale', '--guidance > 1 (e.g. --guidance 5)', None, 1),
    'GlmImageTransformer2DModel': ('glm-image', 'guidance_scale', '--guidance > 1 (e.g. --guidance 5)', None, 1),
    'NucleusMoEImageTransformer2DModel': ('nucleusmoe-image', 'guidance_scale', '--guidance > 1 (e.g. --guidance 5)', None, 1),
    'LatteTransformer3DModel': ('latte', 'guidance_scale', '--guidance > 1 (e.g. --guidance 5)', 1, 1),
    'Kandinsky6SRTransformer3DModel': ('kandinsky6-sr', 'guidance_scale', '--guidance > 1 (e.g. --guidance 5)', 4, 1),
    'BriaFibo2Transformer2DModel': ('bria-fibo2', 'guidance_scale', '--guidance > 1 (e.g. --guidance 5)', None, 1),
    'MotifVideoTransformer3DModel': ('motif-video', 'guidance_scale', "the checkpoint's guider (guider/config.json guidance_scale > 1)", 4, 1),
    'Cosmos3OmniTransformer': ('cosmos3-omni', 'guidance_scale', '--guidance > 1 (e.g. --guidance 5)', 4, 1),
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


def refusal(class_name: str) -> str | None:
    """Why ditmesh refuses the transformer class ``class_name``, one line (None: a family has it): not a diffusion
    transformer (:data:`NOT_DITS`), a DiT not adapted yet (:data:`NOT_ADAPTED`), or a class it does not know."""
    if class_name in CLASSES:
        return None
    if class_name in NOT_DITS:
        return f"ditmesh does not parallelize {class_name}: {NOT_DITS[class_name]}"
    if class_name in NOT_ADAPTED:
        return f"ditmesh has no adapter for {class_name} yet: {NOT_ADAPTED[class_name]}"
    return f"ditmesh has no adapter for {class_name}; supported transformers: {', '.join(supported_classes())}"


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


class UnknownArchError(ValueError):
    """An architecture name ``ditmesh synth`` does not know."""


def check_arch(name: str) -> None:
    """UnknownArchError, listing the known names, if ``name`` is no synthetic architecture (nothing is imported)."""
    if name not in SYNTH:
        raise UnknownArchError(f"unknown architecture {name!r}; known: {', '.join(sorted(SYNTH))}")
