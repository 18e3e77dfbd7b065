"""Sana-Video (``SanaVideoTransformer3DModel``): Sana's block (``models/sana.py``) over video, with a 3-D RoPE in the
linear attention and a temporal convolution in the Mix-FFN.

Where the tokens are: ``forward`` builds Wan's RoPE table (``rope``: cos and sin ``[1, N, 1, D]``), patchifies with a
Conv3d and flattens to ``[B, N, D]`` video tokens (frame-major), runs the blocks and unpatchifies after ``proj_out``.
Each block's Mix-FFN (``GLUMBTempConv``) unflattens its tokens to ``[B, frames, height, width, C]``, runs a depthwise
3x3 convolution inside each frame and a ``(3, 1)`` convolution across frames (``conv_temp``, over ``[B, C, frames,
height * width]``). Sana's token grid therefore applies with a frame as one row: the video is split in whole frames
(uneven by at most one frame, at least one per rank), each block's ``frames`` becomes this rank's frames, and
``conv_temp`` exchanges one halo frame with each neighbour (the convolutions inside a frame need none).

Attention: ``attn1`` is linear attention, ``(sum_k v rot(k)^T) rot(q) / (sum_k k)^T q`` with ReLU feature maps and
the RoPE rotation on the numerator only; each rank sums its own keys and one all-reduce adds both sums (exact: no
softmax). ``attn2`` is cross-attention to the whole Gemma text under its mask, as diffusers' processor. A per-token
timestep (``[B, N]``) is split with the video at the entry. So a block issues one all-reduce and one halo exchange.

Tensor plan: Sana's, with the QK-norms over all heads (``rms_norm_across_heads``) as sharded norms: 2 + 4 all-reduces
a block. CFG: batched (``[uncond, cond]`` in one call), as Sana. The VAE is Wan's (``AutoencoderKLWan``), split along
height by Wan's VAE plan.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F

from .base import Gather, Layout, SequencePlan, Split, SynthArch, TokenGrid, register, spatial_latent
from .sana import SANA, SANA_TENSOR_PLAN, SanaSequenceParallelProcessor, _SANA_SCHEDULER, _SANA_TINY
from .wan import WAN_VAE_PLAN, rotate_pairs


class SanaVideoSequenceParallelProcessor(SanaSequenceParallelProcessor):
    """Sana's processor with Sana-Video's rotation: the numerator's key sums ``sum v rot(k)^T`` and the denominator's
    ``sum k`` are added over the sequence-parallel ranks in one all-reduce; cross-attention as diffusers'."""

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, rotary_emb=None):
        if encoder_hidden_states is not None:
            return self.previous(attn, hidden_states, encoder_hidden_states, attention_mask)
        if attention_mask is not None:
            raise NotImplementedError("ditmesh: Sana-Video's linear self-attention takes no attention mask")
        dtype = hidden_states.dtype
        q, k, v = (t.unflatten(2, (attn.heads, -1)) for t in self.projections(attn, hidden_states))  # [B, N, H, D]
        q, k = F.relu(q), F.relu(k)
        q_rot, k_rot = (rotate_pairs(t, *rotary_emb) for t in (q, k)) if rotary_emb is not None else (q, k)
        # [B, H, D, N] as diffusers lays them out; both sums over this rank's keys in one tensor, then one all-reduce
        q, k, q_rot, k_rot, v = (t.permute(0, 2, 3, 1) for t in (q, k, q_rot, k_rot, v))
        numerator = torch.matmul(v.float(), k_rot.float().transpose(-1, -2))  # [B, H, D, D]
        key_sum = k.sum(dim=-1, keepdim=True)  # [B, H, D, 1]
        sums = self.sp.sum(torch.cat([numerator, key_sum.to(numerator.dtype)], dim=-1))
        numerator, key_sum = sums[..., :-1], sums[..., -1:].to(k.dtype)
        z = 1 / (key_sum.transpose(-2, -1) @ q + 1e-15)
        out = (torch.matmul(numerator, q_rot.float()) * z).flatten(1, 2).transpose(1, 2).to(dtype)
        return attn.to_out[1](attn.to_out[0](out))


def sana_video_example_inputs(model, height, width, batch, text_len, generator, device, dtype, frames=None) -> dict:
    """Transformer inputs of one SanaVideoPipeline step: the Wan VAE's latents (8x smaller, ``(frames - 1) // 4 + 1``
    latent frames; default 81 frames), Gemma text under the mask of a prompt filling half of it."""
    cfg = model.config
    rand = lambda *shape: torch.randn(*shape, generator=generator).to(device, dtype)  # noqa: E731
    mask = torch.zeros(batch, text_len)
    mask[:, : max(1, text_len // 2)] = 1
    return dict(hidden_states=rand(batch, cfg.in_channels, ((frames or 81) - 1) // 4 + 1, height // 8, width // 8),
                encoder_hidden_states=rand(batch, text_len, cfg.caption_channels),
                encoder_attention_mask=mask.to(device, dtype), timestep=torch.full((batch,), 700.0).to(device, dtype),
                return_dict=False)


def sana_video_layout(config: dict, height: int, width: int, frames: int, text_tokens: int) -> Layout:
    """Token counts of a SanaVideoPipeline call: the Wan VAE (8x, 4x in time), then ``patch_size`` patches; the text is
    cross-attention context only."""
    pt, ph, pw = config.get("patch_size", (1, 2, 2))
    lh, lw = spatial_latent(height, width, 32, "SanaVideoPipeline (it checks multiples of 32)")
    if frames < 1 or (frames - 1) % 4:
        raise ValueError(f"frames={frames} must be 4k+1 for Sana-Video's 4x temporal VAE; try "
                         f"{max(1, (frames - 1) // 4 * 4 + 1)}")
    latent_frames = (frames - 1) // 4 + 1
    video = latent_frames // pt * (lh // ph) * (lw // pw)
    return Layout(video, text_tokens, video, (config.get("in_channels", 16), latent_frames, lh, lw))


def sana_video_frame_width(model, inputs: dict) -> int:
    """Tokens per frame (one row of Sana-Video's token grid): the latent's height times width over the patch."""
    _, ph, pw = model.config.patch_size
    return inputs["hidden_states"].shape[-2] // ph * (inputs["hidden_states"].shape[-1] // pw)


def sana_video_sequence_traffic(config: dict, layout: Layout, bpe: int, tp: int) -> list:
    """What Sana-Video's sequence parallelism exchanges per sample and call: per block the linear attention's sums
    (``[H / tp, D, D + 1]`` float32, all-reduced) and one frame of the Mix-FFN's output channels from each neighbour."""
    heads, dim, layers = config["num_attention_heads"] // tp, config["attention_head_dim"], config["num_layers"]
    _, rows, cols = layout.latent_shape[1:]
    _, ph, pw = config.get("patch_size", (1, 2, 2))
    frame = rows // ph * (cols // pw) * config["num_attention_heads"] * dim
    return [("all_reduce", layers * heads * dim * (dim + 1) * 4, layers), ("halo", layers * 2 * frame * bpe, layers)]


# -- synthetic architectures ---------------------------------------------------------------------------------
SANA_VIDEO_2B = SynthArch(
    name="sana-video-2b",
    description="Sana-Video 2B transformer (20 blocks, linear attention 20 heads x 112, cross-attention 20 x 112, "
                "Mix-FFN with a temporal convolution), Wan 2.1 VAE, one-layer Gemma-2",
    pipeline="SanaVideoPipeline",
    transformer_class="SanaVideoTransformer3DModel",
    transformer=dict(in_channels=16, out_channels=16, num_attention_heads=20, attention_head_dim=112, num_layers=20,
                     num_cross_attention_heads=20, cross_attention_head_dim=112, cross_attention_dim=2240,
                     caption_channels=2304, mlp_ratio=3.0, patch_size=[1, 2, 2], qk_norm="rms_norm_across_heads"),
    vae={},  # AutoencoderKLWan's defaults: the Wan 2.1 VAE
    clip={},
    t5=dict(hidden_size=2304, intermediate_size=1024, num_hidden_layers=1, num_attention_heads=8, num_key_value_heads=4,
            head_dim=256),  # Gemma-2 2B's width, one layer
    scheduler=_SANA_SCHEDULER,
    scheduler_class="DPMSolverMultistepScheduler",
    default_dtype="bfloat16",
    default_size=(480, 832),
    max_sequence_length=300,
    default_frames=81,
)

#: diffusers' test configuration of the class (2 blocks, 2 heads x 12, cross-attention 2 x 12, text 16)
SANA_VIDEO_TINY = dataclasses.replace(
    SANA_VIDEO_2B,
    name="sana-video-tiny",
    description="Sana-Video shrunk for CPU tests: diffusers' test config (2 blocks, 2 heads x 12), tiny Wan VAE, a "
                "16-wide Gemma-2",
    transformer=dict(in_channels=16, out_channels=16, num_attention_heads=2, attention_head_dim=12, num_layers=2,
                     num_cross_attention_heads=2, cross_attention_head_dim=12, cross_attention_dim=24,
                     caption_channels=16, mlp_ratio=2.5, dropout=0.0, attention_bias=False, sample_size=8,
                     patch_size=[1, 2, 2], norm_elementwise_affine=False, norm_eps=1e-6,
                     qk_norm="rms_norm_across_heads", rope_max_seq_len=32),
    vae=dict(base_dim=8, num_res_blocks=1),
    t5=dict(_SANA_TINY.t5, hidden_size=16, intermediate_size=32),
    default_dtype="float32",
    default_size=(64, 64),
    max_sequence_length=16,
    default_frames=9,
)


def sana_video_components(arch: SynthArch, kit) -> dict:
    """SanaVideoPipeline's other components: the Wan VAE and a Gemma-2 text encoder with its tokenizer."""
    import diffusers

    return dict(vae=kit.make(diffusers.AutoencoderKLWan, arch.vae, 1), **kit.gemma2_text_encoder(arch))


SANA_VIDEO = register(dataclasses.replace(
    SANA,
    name="sana-video",
    class_names=("SanaVideoTransformer3DModel",),
    num_heads=lambda model: model.config.num_attention_heads,
    sequence_plan=SequencePlan(
        streams=("video",),
        inputs={"": {"timestep": Split(dim=1, stream="video", ndim=2, broadcast=True)},
                "transformer_blocks.0": {"hidden_states": Split(dim=1, stream="video", ndim=3)}},
        outputs={"rope": {0: Split(dim=1, stream="video", ndim=4), 1: Split(dim=1, stream="video", ndim=4)}},
        gathers={"proj_out": Gather(dim=1, stream="video")},
        grid=TokenGrid("video", width=sana_video_frame_width, rows={"transformer_blocks.*": "frames"},
                       convs=("transformer_blocks.*.ff.conv_temp",), enough="a video of at least {n} latent frames"),
    ),
    sequence_processor=SanaVideoSequenceParallelProcessor,
    modulated_input=None,  # its modulation is per token ([B, N, 6, D]), not Sana's
    sequence_traffic=sana_video_sequence_traffic,
    example_inputs=sana_video_example_inputs,
    layout=sana_video_layout,
    tensor_plan=dataclasses.replace(SANA_TENSOR_PLAN, sharded_norms=tuple(
        f"transformer_blocks.*.{attn}.{norm}" for attn in ("attn1", "attn2") for norm in ("norm_q", "norm_k"))),
    output_channel_dim=1,
    frame_step=4,
    fps=16,
    pipelines=("SanaVideoPipeline", "SanaImageToVideoPipeline"),
    synth_archs=(SANA_VIDEO_2B, SANA_VIDEO_TINY),
    synth_components=sana_video_components,
    vae=WAN_VAE_PLAN,
))
