"""AnyFlow (``AnyFlowTransformer3DModel``, AnyFlowPipeline): Wan 2.1's blocks with a flow-map embedding, one source
and one target timestep per latent frame.

Where the tokens are: ``forward`` takes the latents frames-first (``[B, F, C, H, W]``) and moves the channels ahead,
builds the RoPE table (``rope``: ``{"query": f, "key": f}``, complex ``[1, 1, N, D / 2]``), patchifies and flattens to
``[B, N, D]`` video tokens, and embeds the two timesteps per frame, repeated over each frame's tokens: the blocks get
``temb`` as ``[B, N, 6, D]`` (one modulation per token) and the final norm a ``[B, N, D]`` shift and scale. The
sequence plan splits the RoPE table at ``rope``'s output (both entries), the video tokens at the first block and the
per-token modulation at every block (``forward`` hands each the whole one); it gathers the tokens at the output of
``norm_out`` (a per-token LayerNorm), because the final modulation reads the whole per-token shift and scale.

Attention: ``attn1`` is self-attention over the video: projections, QK-norms (RMS over all heads) and the complex RoPE
on local tokens, the softmax through ``sp.attention``. ``attn2`` is cross-attention to the text (and image) context
every rank holds whole: diffusers' processor, no communication. CFG: one call on ``[uncond, cond]`` (batched); the
released checkpoints fold guidance into their weights (guidance 1). Tensor plan: Wan's (Q/K/V column-, ``to_out.0``
row-parallel in both attentions, the feed-forward column -> row, the QK-norms sharded): 7 all-reduces a block.

AnyFlow-FAR (``AnyFlowFARTransformer3DModel``, AnyFlowFARPipeline; ``ANYFLOW_FAR``): the same blocks generating a video
chunk by chunk. Per chunk the pipeline makes denoising calls on the chunk's latents, whose self-attention reads a K/V
cache of the earlier chunks (the pipeline's tensors ``[2, B, H, L, D]`` per block, every head, filled in place), then
a call on every chunk so far that rewrites the cache (the chunks older than the last ``full_chunk_limit - 1``
patchified 4x coarser by ``far_patch_embedding``, "compressed", first in the sequence) under a frame-causal
flex-attention ``BlockMask`` and returns no sample. Keys are cached before the rotation, which runs over the cached and
current keys with one table. Under Ulysses a rank holds every token of its heads after the all-to-all, so the
processor hands diffusers' own ``AnyFlowCausalAttnProcessor`` those heads (already projected and normed): it writes
and reads their slots of the cache, rotates with the whole tables (the plan does not cut them), pads and runs flex
attention under the whole mask, as in one process (its padding to a multiple of 128 included: in a cache-reading call,
which has no mask, the padded zero keys enter the softmax). Under tp ``TensorPlan.head_inputs`` gives each ``attn1``
views of its rank's heads of the cache. cfg and dp (the pipeline's batched CFG) cut the cache in its batch dim (dim 1)
into views of each batch rank's samples; a call that writes the cache returns no sample, so there is nothing to gather,
and a batch too small to give every batch rank a sample is refused (``full_batches``: the pipeline takes the cache
back from every call). Ring and USP, the step caches, PipeFusion and displaced attention are refused (the adapter's
refusals say why). ``--frames`` other than the checkpoint's chunk partition makes are cut
into chunks like it (:func:`far_partition`), which ``generate`` passes to the pipeline.
"""

from __future__ import annotations

import dataclasses

import torch
from diffusers.models.transformers.transformer_anyflow import apply_rotary_emb
from diffusers.models.transformers.transformer_anyflow_far import AnyFlowCausalAttnProcessor

from ..comm import offsets, split_sizes
from .base import AttentionSelector, BlockList, Gather, ModelAdapter, SequencePlan, SequenceProcessor, Split, register
from .wan import _WAN_TINY, WAN21_14B, WAN_TENSOR_PLAN, WAN_VAE_PLAN, wan_components, wan_layout


class AnyFlowSequenceParallelProcessor(SequenceProcessor):
    """Processor for AnyFlow's attention layers: the self-attention (``attn1``) as diffusers' ``AnyFlowAttnProcessor``
    on local tokens with the softmax through ``sp.attention``; the cross-attention (``attn2``: local queries against
    the whole context) as diffusers'."""

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, rotary_emb=None):
        if encoder_hidden_states is not None:
            return self.previous(attn, hidden_states, encoder_hidden_states, attention_mask)
        if attention_mask is not None:
            raise NotImplementedError("AnyFlow's self-attention takes no mask; its blocks pass none")
        q = attn.norm_q(attn.to_q(hidden_states)).unflatten(2, (attn.heads, -1))
        k = attn.norm_k(attn.to_k(hidden_states)).unflatten(2, (attn.heads, -1))
        v = attn.to_v(hidden_states).unflatten(2, (attn.heads, -1))
        if rotary_emb is not None:  # heads-first, as diffusers rotates
            q = apply_rotary_emb(q.transpose(1, 2), rotary_emb["query"]).transpose(1, 2)
            k = apply_rotary_emb(k.transpose(1, 2), rotary_emb["key"]).transpose(1, 2)
        out = self.sp.attention(q, k, v, backend=self._attention_backend)
        return attn.to_out[1](attn.to_out[0](out.flatten(2, 3).type_as(q)))


def anyflow_example_inputs(model, height, width, batch, text_len, generator, device, dtype, frames=None) -> dict:
    """Transformer inputs of one AnyFlowPipeline step: frames-first latents of ``(frames - 1) // 4 + 1`` latent frames
    8x smaller (the Wan VAE; default 81 frames), the source and target timesteps per latent frame, UMT5 text."""
    cfg = model.config
    latent_frames = ((frames or 81) - 1) // 4 + 1
    rand = lambda *shape: torch.randn(*shape, generator=generator).to(device, dtype)  # noqa: E731
    return dict(hidden_states=rand(batch, latent_frames, cfg.in_channels, height // 8, width // 8),
                timestep=torch.full((batch, latent_frames), 700.0).to(device, dtype),
                r_timestep=torch.full((batch, latent_frames), 400.0).to(device, dtype),
                encoder_hidden_states=rand(batch, text_len, cfg.text_dim), return_dict=False)


def anyflow_layout(config: dict, height: int, width: int, frames: int, text_tokens: int):
    """Wan's token counts, the latent shape frames-first as AnyFlow takes it."""
    layout = wan_layout(config, height, width, frames, text_tokens)
    channels, latent_frames, *rest = layout.latent_shape
    return dataclasses.replace(layout, latent_shape=(latent_frames, channels, *rest))


def anyflow_modulated_input(block: torch.nn.Module, named: dict) -> torch.Tensor:
    """The input of an AnyFlow block's self-attention: ``norm1`` shifted and scaled by the per-token modulation
    (``temb`` ``[B, N, 6, D]``, this rank's tokens), as the block computes it."""
    shift, scale = (block.scale_shift_table + named["temb"].float())[:, :, :2].unbind(2)
    hidden = named["hidden_states"]
    return (block.norm1(hidden.float()) * (1 + scale) + shift).type_as(hidden)


# -- synthetic architectures ---------------------------------------------------------------------------------
_FLOW_MAP = dict(gate_value=0.25, deltatime_type="r")

ANYFLOW_14B = dataclasses.replace(
    WAN21_14B,
    name="anyflow-14b",
    description="AnyFlow 14B transformer (Wan2.1-T2V-14B's blocks: 40 blocks, 40 heads x 128, FFN 13824; flow-map "
                "timesteps), full Wan VAE, small UMT5",
    pipeline="AnyFlowPipeline",
    transformer_class="AnyFlowTransformer3DModel",
    transformer={**{k: v for k, v in WAN21_14B.transformer.items() if k != "qk_norm"}, **_FLOW_MAP},
    scheduler={},
    scheduler_class="FlowMapEulerDiscreteScheduler",
)

#: diffusers' test configuration of the class (2 blocks, 2 heads x 12), with wan-tiny's VAE and UMT5 narrowed to it:
#: ``generate`` runs AnyFlowPipeline on it end to end
ANYFLOW_TINY = dataclasses.replace(
    _WAN_TINY,
    name="anyflow-tiny",
    description="AnyFlow at diffusers' test configuration (2 blocks, 2 heads x 12, text width 16), a tiny Wan VAE of 4 "
                "latent channels, a 16-wide UMT5",
    pipeline=ANYFLOW_14B.pipeline,
    transformer_class=ANYFLOW_14B.transformer_class,
    transformer=dict(patch_size=[1, 2, 2], num_attention_heads=2, attention_head_dim=12, in_channels=4,
                     out_channels=4, text_dim=16, freq_dim=256, ffn_dim=32, num_layers=2, cross_attn_norm=True,
                     rope_max_seq_len=32, **_FLOW_MAP),
    vae=dict(_WAN_TINY.vae, z_dim=4, latents_mean=[0.0] * 4, latents_std=[1.0] * 4),  # the 4 latent channels
    t5=dict(_WAN_TINY.t5, d_model=16),
    scheduler={},
    scheduler_class="FlowMapEulerDiscreteScheduler",
)

_PER_TOKEN = Split(dim=1, stream="video", ndim=4)

ANYFLOW = register(
    ModelAdapter(
        name="anyflow",
        class_names=("AnyFlowTransformer3DModel",),
        num_heads=lambda model: model.config.num_attention_heads,
        sequence_plan=SequencePlan(
            streams=("video",),
            inputs={"blocks.0": {"hidden_states": Split(dim=1, stream="video", ndim=3)},
                    "blocks.*": {"temb": _PER_TOKEN}},
            outputs={"rope": {None: Split(dim=2, stream="video", ndim=4)}},
            gathers={"norm_out": Gather(dim=1, stream="video")},
        ),
        attention=AttentionSelector(paths=("blocks.*.attn1", "blocks.*.attn2")),
        sequence_processor=AnyFlowSequenceParallelProcessor,
        blocks=(BlockList("blocks", ("hidden_states",), ("hidden_states",), ("video",)),),
        token_wise=("blocks.*.ffn",),
        modulated_input=anyflow_modulated_input,
        example_inputs=anyflow_example_inputs,
        layout=anyflow_layout,
        text_tokens=512,  # UMT5, cross-attention only
        tensor_plan=dataclasses.replace(WAN_TENSOR_PLAN, per_rank_attrs={
            f"blocks.*.{attn}": ("heads", "inner_dim") for attn in ("attn1", "attn2")}),
        batch_inputs=("hidden_states", "timestep", "r_timestep", "encoder_hidden_states",
                      "encoder_hidden_states_image"),
        cfg_mode="batched",
        output_channel_dim=2,
        out_channels=lambda model: model.config.out_channels,
        frame_step=4,
        pipelines=("AnyFlowPipeline",),
        synth_archs=(ANYFLOW_14B, ANYFLOW_TINY),
        synth_components=wan_components,
        vae=WAN_VAE_PLAN,
        pp_refusal="its blocks take the per-token modulation whole from forward, cut per block; PipeFusion is not "
                   "tested on it",
    )
)


# -- AnyFlow-FAR: the chunk-wise autoregressive sibling ------------------------------------------------------
class _HeadsOnly:
    """The attention layer diffusers' ``AnyFlowCausalAttnProcessor`` sees after the Ulysses all-to-all: ``heads``
    heads whose Q, K and V (projected, normed, side by side in one ``[B, S, 3 * width]`` input) are taken by slicing,
    and no output projection: the processor's cache, rotation, padding and flex attention run on them as they are."""

    norm_q = norm_k = None

    def __init__(self, heads: int, width: int):
        self.heads = heads
        self.to_q = lambda x: x[..., :width]
        self.to_k = lambda x: x[..., width:2 * width]
        self.to_v = lambda x: x[..., 2 * width:]
        self.to_out = (torch.nn.Identity(), torch.nn.Identity())


class AnyFlowFARSequenceParallelProcessor(SequenceProcessor):
    """Processor for AnyFlow-FAR's attention layers. The self-attention (``attn1``): Q/K/V projections and the QK-norms
    (RMS over all heads) on local tokens, the Ulysses all-to-all, then diffusers' own causal processor on every token of
    this rank's heads (``_HeadsOnly``): it writes or reads this rank's heads' slots of the K/V cache, rotates Q and K
    with the whole RoPE tables, pads and runs flex attention under the whole frame-causal ``BlockMask``, exactly as in
    one process. The cross-attention (``attn2``) as diffusers'."""

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, rotary_emb=None,
                 kv_cache=None, kv_cache_flag=None):
        if encoder_hidden_states is not None:
            return self.previous(attn, hidden_states, encoder_hidden_states, attention_mask)
        whole = dict(attention_mask=attention_mask, rotary_emb=rotary_emb, kv_cache_flag=kv_cache_flag)
        if not hasattr(self.sp, "ulysses_rank"):
            if hasattr(self.sp, "sp"):  # a runtime over split tokens (displaced attention): refused by options
                raise NotImplementedError(f"AnyFlow-FAR's attention runs under ulysses, not "
                                          f"{type(self.sp).__name__}")
            return self.previous(attn, hidden_states, kv_cache=kv_cache, **whole)  # one process (chunked attention)
        dtype = hidden_states.dtype  # the QK-norms compute in float32; diffusers casts back before the heads split
        q = attn.norm_q(attn.to_q(hidden_states)).to(dtype).unflatten(2, (attn.heads, -1))
        k = attn.norm_k(attn.to_k(hidden_states)).to(dtype).unflatten(2, (attn.heads, -1))
        v = attn.to_v(hidden_states).unflatten(2, (attn.heads, -1))
        # this rank's heads after the all-to-all: the contiguous share ulysses_attention gives it, at this offset
        first = offsets(split_sizes(attn.heads, self.sp.ulysses_degree))[self.sp.ulysses_rank]

        def causal(q, k, v):  # [B, S, h, D]: every token of this rank's h heads
            heads = q.shape[2]
            cache = None if kv_cache is None else {name: t.narrow(2, first, heads) for name, t in kv_cache.items()}
            packed = torch.cat([q.flatten(2), k.flatten(2), v.flatten(2)], dim=2)
            out = self.previous(_HeadsOnly(heads, packed.shape[2] // 3), packed, kv_cache=cache, **whole)
            return out.unflatten(2, (heads, -1))

        out = self.sp.attention(q, k, v, local=causal)
        return attn.to_out[1](attn.to_out[0](out.flatten(2, 3).type_as(q)))


class _SdpaCausalProcessor(AnyFlowCausalAttnProcessor):
    """diffusers' causal processor with PyTorch's SDPA in place of flex attention, which the meta device does not run:
    the planner's trace (:func:`far_meta_trace`) of a step that reads the K/V cache, which attends under no mask."""

    _attention_backend = "native"
    _SUPPORTED_BACKENDS = ("native",)


def far_meta_trace(model):
    """The planner's trace of a steady-state step on the meta device: every self-attention through
    :class:`_SdpaCausalProcessor` (the same padded queries, cached and current keys). Returns the undo."""
    layers = [block.attn1 for block in model.blocks]
    previous = [layer.processor for layer in layers]
    for layer in layers:
        layer.set_processor(_SdpaCausalProcessor())

    def undo():
        for layer, processor in zip(layers, previous):
            layer.set_processor(processor)

    return undo


def far_partition(config, frames: int | None) -> list[int]:
    """The chunk partition of a ``frames``-frame video: the checkpoint's ``chunk_partition`` where it covers the
    ``(frames - 1) // 4 + 1`` latent frames (or ``frames`` is None), else its first chunk, then chunks of its longest
    one, the rest last (the released 1 + 3 x 6 + 2 for 81 frames). ValueError (one line) for fewer chunks than
    AnyFlowFARPipeline's cache takes (``full_chunk_limit - 1``), naming the fewest frames that work."""
    partition = list(config.get("chunk_partition", (1, 3, 3, 3, 3, 3, 3, 2)))
    if frames is None or (frames - 1) // 4 + 1 == sum(partition):
        return partition
    latent, longest = (frames - 1) // 4 + 1, max(partition)
    first = min(partition[0], latent)
    rest = latent - first
    chunks = [first] + [longest] * (rest // longest) + ([rest % longest] if rest % longest else [])
    fewest = config.get("full_chunk_limit", 3) - 1
    if len(chunks) < fewest:
        enough = 4 * (partition[0] + longest * (fewest - 2)) + 1  # the first chunk, full ones, then one frame
        raise ValueError(f"frames={frames} makes {len(chunks)} chunk(s) of latent frames but AnyFlow-FAR's pipeline "
                         f"needs at least {fewest} (full_chunk_limit - 1); use --frames {enough} or more")
    return chunks


def far_kv_cache(config, partition, batch: int, height: int, width: int, device, dtype) -> dict:
    """An empty K/V cache of a ``height`` x ``width`` latent, as AnyFlowFARPipeline allocates it for ``batch``
    samples: per block the last ``full_chunk_limit`` chunks' full tokens and the older chunks' compressed ones, each
    room for its longest chunk, keys and values stacked in front, every head."""
    (_, ph, pw), (_, ch, cw) = config["patch_size"], config["compressed_patch_size"]
    limit, longest = config["full_chunk_limit"], max(partition)
    rooms = {"full_cache": limit * longest * (height // ph) * (width // pw),
             "compressed_cache": (len(partition) - limit + 1) * longest * (height // ch) * (width // cw)}
    shape = (2, batch, config["num_attention_heads"])
    return {block: {name: torch.zeros(*shape, room, config["attention_head_dim"], device=device, dtype=dtype)
                    for name, room in rooms.items()}
            for block in range(config["num_layers"])}


def far_example_inputs(model, height, width, batch, text_len, generator, device, dtype, frames=None) -> dict:
    """One denoising step of AnyFlowFARPipeline in its steady state: the last chunk's latents (frames-first, 8x
    smaller) attending to every earlier chunk through a full K/V cache (zeros: the cost is the same), the source and
    target timesteps per frame, UMT5 text."""
    cfg = model.config
    partition = far_partition(cfg, frames)
    rand = lambda *shape: torch.randn(*shape, generator=generator).to(device, dtype)  # noqa: E731
    timestep = torch.full((batch, partition[-1]), 700.0)
    return dict(hidden_states=rand(batch, partition[-1], cfg.in_channels, height // 8, width // 8),
                timestep=timestep.to(device, dtype), r_timestep=(timestep * 0.6).to(device, dtype),
                encoder_hidden_states=rand(batch, text_len, cfg.text_dim), chunk_partition=partition,
                kv_cache=far_kv_cache(cfg, partition, batch, height // 8, width // 8, device, dtype),
                kv_cache_flag={"num_cached_chunks": len(partition) - 1, "is_cache_step": False}, return_dict=False)


def far_layout(config: dict, height: int, width: int, frames: int, text_tokens: int):
    """One step's tokens: the last chunk's video tokens (the queries; the keys add the cached chunks), its latent
    frames-first."""
    partition = far_partition(config, frames)
    layout = anyflow_layout(config, height, width, 4 * (partition[-1] - 1) + 1, text_tokens)
    return layout


def far_call_arguments(pipeline, kwargs: dict) -> dict:
    """The chunk partition of ``--frames`` (:func:`far_partition`) passed to AnyFlowFARPipeline, which otherwise takes
    only the checkpoint's frame count."""
    return dict(kwargs, chunk_partition=far_partition(pipeline.transformer.config, kwargs.get("num_frames")))


#: the released AnyFlow-FAR checkpoint (nvidia/AnyFlow-FAR-Wan2.1-1.3B-Diffusers): Wan2.1-T2V-1.3B's blocks, the
#: compressed-frame patch embedding, 21 latent frames in chunks 1 + 3 x 6 + 2, the last three chunks at full size
ANYFLOW_FAR_1_3B = dataclasses.replace(
    ANYFLOW_14B,
    name="anyflow-far-1.3b",
    description="AnyFlow-FAR 1.3B transformer (Wan2.1-T2V-1.3B's blocks: 30 blocks, 12 heads x 128, FFN 8960; chunks "
                "1 + 3 x 6 + 2 latent frames, the last 3 full, older ones 4x4-patched), full Wan VAE, small UMT5",
    pipeline="AnyFlowFARPipeline",
    transformer_class="AnyFlowFARTransformer3DModel",
    transformer=dict(patch_size=[1, 2, 2], compressed_patch_size=[1, 4, 4], full_chunk_limit=3,
                     num_attention_heads=12, attention_head_dim=128, in_channels=16, out_channels=16, text_dim=4096,
                     freq_dim=256, ffn_dim=8960, num_layers=30, cross_attn_norm=True, eps=1e-6,
                     rope_max_seq_len=1024, chunk_partition=[1, 3, 3, 3, 3, 3, 3, 2], **_FLOW_MAP),
)

#: diffusers' test configuration of the class (2 blocks, 2 heads x 12, the last 3 chunks full), in 4 one-frame
#: chunks: the 4th chunk is the first to read compressed past frames
ANYFLOW_FAR_TINY = dataclasses.replace(
    ANYFLOW_TINY,
    name="anyflow-far-tiny",
    description="AnyFlow-FAR at diffusers' test configuration (2 blocks, 2 heads x 12, the last 3 chunks full) in 4 "
                "one-frame chunks, a tiny Wan VAE of 4 latent channels, a 16-wide UMT5",
    pipeline=ANYFLOW_FAR_1_3B.pipeline,
    transformer_class=ANYFLOW_FAR_1_3B.transformer_class,
    transformer=dict(ANYFLOW_TINY.transformer, compressed_patch_size=[1, 4, 4], full_chunk_limit=3,
                     chunk_partition=[1, 1, 1, 1]),
    default_frames=13,
)

#: an awkward one of ours: 3 heads (2 + 1 over two Ulysses ranks), the last 2 chunks full, chunks of 2, 1 and 2 frames
ANYFLOW_FAR_TINY3 = dataclasses.replace(
    ANYFLOW_FAR_TINY,
    name="anyflow-far-tiny3",
    description="anyflow-far-tiny with 3 heads, the last 2 chunks full, chunks of 2, 1 and 2 latent frames",
    transformer=dict(ANYFLOW_FAR_TINY.transformer, num_attention_heads=3, full_chunk_limit=2,
                     chunk_partition=[2, 1, 2]),
    default_frames=17,
)

ANYFLOW_FAR = register(
    dataclasses.replace(
        ANYFLOW,
        name="anyflow-far",
        class_names=("AnyFlowFARTransformer3DModel",),
        # the RoPE tables stay whole: the processor rotates after the all-to-all, cached keys with the current ones
        sequence_plan=dataclasses.replace(ANYFLOW.sequence_plan, outputs={}),
        sequence_processor=AnyFlowFARSequenceParallelProcessor,
        example_inputs=far_example_inputs,
        layout=far_layout,
        tensor_plan=dataclasses.replace(ANYFLOW.tensor_plan, head_inputs={"blocks.*.attn1": {"kv_cache": 2}}),
        call_arguments=far_call_arguments,
        pipelines=("AnyFlowFARPipeline",),
        synth_archs=(ANYFLOW_FAR_1_3B, ANYFLOW_FAR_TINY, ANYFLOW_FAR_TINY3),
        ring_refusal="its K/V cache holds every past token of a head, read whole by each chunk's queries, and its "
                     "frame-causal mask is a flex-attention BlockMask over the whole sequence, which ring attention "
                     "(dense masks over rotating key blocks) does not take",
        # the K/V cache carries the batch in dim 1: each batch rank gets views of its samples', filled in place
        batch_inputs=(*ANYFLOW.batch_inputs, "kv_cache"),
        batch_dims={"kv_cache": 1},
        full_batches=True,
        cache_refusal="after each chunk a call writes the K/V cache inside the blocks and returns no sample; a "
                      "skipped span would leave the cache unwritten",
        pp_refusal="its blocks write and read a K/V cache across calls; PipeFusion is not tested on it",
        modulated_input=None,
        meta_trace=far_meta_trace,
    )
)
