"""Cosmos 3 Omni (``Cosmos3OmniTransformer``, ``Cosmos3OmniPipeline``): a mixture of transformers over one packed,
unbatched sequence, a causal text ("understanding") prefix followed by generation tokens (vision, then sound, then
action).

Where the tokens are: ``forward`` embeds the text ids, patchifies and projects the vision latents (and packs the sound
and action latents), adds each noisy token's timestep embedding and scatters everything into one ``[N, D]`` buffer by
the index lists the pipeline gives; it builds the mRoPE table over the whole sequence, then cuts buffer and table at
``und_len``: ``und_seq`` (the text prefix) and ``gen_seq`` (every generation token, whatever its modality). The decoder
layers take ``(und_seq, gen_seq, rotary_emb)`` and return the two sequences; ``norm`` and ``norm_moe_gen`` close them,
and the heads read the predictions back from the joined sequence by index.

Sequence plan: two streams, ``und`` and ``gen`` (tokens along dim 0: the class has no batch), cut at the input of
``layers.0`` (after all the packing, so the index lists stay global and untouched) and gathered at the outputs of
``norm`` and ``norm_moe_gen`` (before the heads' global indexing). Everything between is per token except attention:
the routing of the mixture is by stream, not by token type, so a rank's contiguous shard of each stream runs the same
norms, MLPs and projections as one process. The forward hands every layer the whole RoPE table (four tensors, two per
stream), so the processor cuts it to the rank's tokens of each stream (``base.token_range``).

Attention (``Cosmos3PackedMoTAttention``, two softmax attentions per layer): the text attends causally to itself, and
the generation tokens attend to every key, the text's (through ``k_norm_und_for_gen`` where the checkpoint has it) and
their own. The processor runs both through ``sp.attention``: the causal one over the ``und`` stream under the whole
lower-triangular mask (``[und_len, und_len]``: the text prefix is short), the full one over ``[und, gen]`` keys with
the local text tokens given queries too, whose rows are dropped (PRX's way: sequence parallelism exchanges queries
with the keys). Grouped-query key/value heads are repeated to the query heads before the exchange. Ulysses, ring and
USP are exact (the causal mask goes through their masked path, reordered like the keys).

Tensor plan: per layer both pathways' Q/K/V column-parallel and their output projections row-parallel, both MLPs
column -> row (4 all-reduces a layer); the QK-norms act per head. The key/value heads must divide by tp.

Step caches: the layers carry both streams (the generation stream first: dbcache decides on its change, the text
prefix being the same at every step). Refused: cfg and dp (a call is one packed sample, and the pipeline masks the cond
call's predictions into new tensors before its uncond call, so the cfg exchange, which fills the cond prediction after
the uncond call, cannot reach them), PipeFusion (not tested on its unbatched two-stream layers).
"""

from __future__ import annotations

import dataclasses
import math

import torch

from .base import (AttentionSelector, BlockList, Gather, Layout, ModelAdapter, SequencePlan, SequenceProcessor, Split,
                   SynthArch, TensorPlan, register, replace_forward, spatial_latent, temporal_latent, token_range)
from .flux_like import _WAN22_VAE
from .wan import WAN_VAE_PLAN


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``x`` ``[N, H, D]`` rotated by the table ``cos``/``sin`` ``[N, D]`` (halves swapped, as the class rotates)."""
    half = x.shape[-1] // 2
    swapped = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos.unsqueeze(1) + swapped * sin.unsqueeze(1)


class Cosmos3SequenceParallelProcessor(SequenceProcessor):
    """Processor for ``Cosmos3PackedMoTAttention`` whose two attentions run sequence-parallel (module docstring)."""

    def __call__(self, attn, und_seq, gen_seq, rotary_emb):
        heads, kv_heads, dim = attn.num_attention_heads, attn.num_key_value_heads, attn.head_dim
        und, gen = und_seq.shape[0], gen_seq.shape[0]
        q_und = attn.norm_q(attn.to_q(und_seq).view(und, heads, dim))
        k_und = attn.norm_k(attn.to_k(und_seq).view(und, kv_heads, dim))
        v_und = attn.to_v(und_seq).view(und, kv_heads, dim)
        k_und_for_gen = attn.k_norm_und_for_gen(k_und) if attn.k_norm_und_for_gen is not None else k_und
        q_gen = attn.norm_added_q(attn.add_q_proj(gen_seq).view(gen, heads, dim))
        k_gen = attn.norm_added_k(attn.add_k_proj(gen_seq).view(gen, kv_heads, dim))
        v_gen = attn.add_v_proj(gen_seq).view(gen, kv_heads, dim)

        # the forward hands every layer the whole table: this rank's rows of each stream
        cos_und, sin_und, cos_gen, sin_gen = rotary_emb
        first_und, text = token_range(self.sp, "und", und)
        first_gen, _ = token_range(self.sp, "gen", gen)
        cos_und, sin_und = cos_und.narrow(0, first_und, und), sin_und.narrow(0, first_und, und)
        cos_gen, sin_gen = cos_gen.narrow(0, first_gen, gen), sin_gen.narrow(0, first_gen, gen)
        q_und, k_und, k_und_for_gen = (_rotate(t, cos_und, sin_und) for t in (q_und, k_und, k_und_for_gen))
        q_gen, k_gen = _rotate(q_gen, cos_gen, sin_gen), _rotate(k_gen, cos_gen, sin_gen)

        groups = heads // kv_heads  # grouped-query heads, repeated as SDPA's enable_gqa pairs them
        k_und, k_und_for_gen, v_und, k_gen, v_gen = (t.repeat_interleave(groups, dim=1) if groups > 1 else t
                                                     for t in (k_und, k_und_for_gen, v_und, k_gen, v_gen))
        causal = torch.ones(1, 1, text, text, dtype=torch.bool, device=und_seq.device).tril()
        causal_out = self.sp.attention(q_und[None], k_und[None], v_und[None], backend=self._attention_backend,
                                       streams=("und",), mask=causal)[0]
        # the generation queries over [text, generation] keys; the local text tokens' queries are dropped after
        full_out = self.sp.attention(torch.cat([k_und_for_gen, q_gen])[None], torch.cat([k_und_for_gen, k_gen])[None],
                                     torch.cat([v_und, v_gen])[None], backend=self._attention_backend)[0, und:]
        return attn.to_out(causal_out.flatten(-2, -1)), attn.to_add_out(full_out.flatten(-2, -1))


def cosmos3_inputs(model, text: int, latent: tuple[int, int, int], noisy_frames=None, sound: int = 0,
                   action: int = 0, noisy_actions=None, generator=None, device="cpu", dtype=torch.float32,
                   timestep: float = 700.0) -> dict:
    """The inputs of one Cosmos3OmniPipeline transformer call, packed as the pipeline packs them: ``text`` text ids,
    then a vision latent of ``latent`` = (frames, height, width) latent cells (padded to whole patches), then
    ``sound`` sound tokens and ``action`` action tokens (each only where the model generates them). ``noisy_frames``
    and ``noisy_actions``: the latent frames and action steps being denoised (default all; the others condition the
    call, as an image-to-video first frame). Positions: the text's along all three mRoPE axes, the vision's (frame +
    offset, row, column), the sound's and actions' along time after the text."""
    cfg = model.config
    rand = lambda *shape: torch.randn(*shape, generator=generator).to(device, dtype)  # noqa: E731
    frames, height, width = latent
    p = cfg.latent_patch_size
    grid = (frames, math.ceil(height / p), math.ceil(width / p))
    vision = math.prod(grid)
    noisy = list(range(frames)) if noisy_frames is None else list(noisy_frames)
    arange = lambda a, b: torch.arange(a, b, device=device)  # noqa: E731
    per_frame = grid[1] * grid[2]
    t, h, w = torch.meshgrid(torch.arange(grid[0]), torch.arange(grid[1]), torch.arange(grid[2]), indexing="ij")
    positions = [torch.arange(text).expand(3, -1), torch.stack([t.flatten() + text + 4, h.flatten(), w.flatten()])]
    inputs = dict(
        input_ids=torch.randint(0, cfg.vocab_size, (text,), generator=generator).to(device),
        text_indexes=arange(0, text), und_len=text, vision_tokens=[rand(1, cfg.latent_channel, *latent)],
        vision_token_shapes=[grid], vision_sequence_indexes=arange(text, text + vision),
        vision_mse_loss_indexes=torch.cat([arange(text + f * per_frame, text + (f + 1) * per_frame) for f in noisy]
                                          or [arange(0, 0)]),
        vision_timesteps=torch.full((len(noisy) * per_frame,), timestep, device=device),
        vision_noisy_frame_indexes=[torch.tensor(noisy, dtype=torch.long, device=device)], return_dict=False)
    start = text + vision
    if sound and cfg.sound_gen:
        inputs.update(sound_tokens=[rand(cfg.sound_dim, sound)], sound_token_shapes=[(sound, 1, 1)],
                      sound_sequence_indexes=arange(start, start + sound),
                      sound_mse_loss_indexes=arange(start, start + sound),
                      sound_timesteps=torch.full((sound,), timestep, device=device),
                      sound_noisy_frame_indexes=[arange(0, sound)])
        positions.append(torch.arange(sound).expand(3, -1) + text + 4)
        start += sound
    if action and cfg.action_gen:
        steps = list(range(action)) if noisy_actions is None else list(noisy_actions)
        inputs.update(action_tokens=[rand(action, cfg.action_dim)], action_token_shapes=[(action, 1, 1)],
                      action_sequence_indexes=arange(start, start + action),
                      action_mse_loss_indexes=torch.tensor(steps, dtype=torch.long, device=device) + start,
                      action_timesteps=torch.full((len(steps),), timestep, device=device),
                      action_noisy_frame_indexes=[torch.tensor(steps, dtype=torch.long, device=device)],
                      action_domain_ids=[torch.tensor([1], device=device)])
        positions.append(torch.arange(action).expand(3, -1) + text + 5)
        start += action
    inputs.update(position_ids=torch.cat(positions, dim=1).to(device), sequence_length=start)
    return inputs


def cosmos3_example_inputs(model, height, width, batch, text_len, generator, device, dtype, frames=None) -> dict:
    """Transformer inputs of one Cosmos3OmniPipeline text-to-video step (one packed sample, whatever ``batch``): the
    Wan 2.2 VAE's latent (16x spatial, 4x temporal; default 189 frames), every frame noisy, after ``text_len`` text
    tokens."""
    latent = ((frames or 189) - 1) // 4 + 1, height // 16, width // 16
    return cosmos3_inputs(model, text_len, latent, generator=generator, device=device, dtype=dtype)


def cosmos3_layout(config: dict, height: int, width: int, frames: int, text_tokens: int) -> Layout:
    """Token counts of a Cosmos3OmniPipeline call: the Wan 2.2 VAE divides by 16 and time by 4, then
    ``latent_patch_size`` patches (padded to whole ones); the text prefix is split with the vision tokens."""
    eighths = spatial_latent(height, width, 16, "Cosmos 3's 16x VAE")
    lf, lh, lw = temporal_latent(frames, 4, "Cosmos 3's 4x temporal VAE"), eighths[0] // 2, eighths[1] // 2
    p = config.get("latent_patch_size", 2)
    vision = lf * math.ceil(lh / p) * math.ceil(lw / p)
    return Layout(vision, text_tokens, vision + text_tokens, (config.get("latent_channel", 48), lf, lh, lw))


class _WholeSequence:
    """The runtime the planner's trace gives the sequence processor: SDPA over the tokens it is handed, all of them."""

    @staticmethod
    def attention(query, key, value, backend=None, streams=None, mask=None):
        q, k, v = (t.transpose(1, 2) for t in (query, key, value))
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask).transpose(1, 2)


def cosmos3_meta_trace(model: torch.nn.Module):
    """Make ``model`` traceable on the meta device for the planner, at the cost sequence parallelism runs: the mRoPE
    table (computed with autocast off on the positions' device, which the meta device does not have) comes back as
    empty tables of its shape, and the attention layers run the sequence processor over the whole sequence (its full
    attention over ``[text, generation]`` queries and keys, which the planner counts as the split sequence's). Returns
    the undo."""
    def tables(position_ids, device, dtype):
        samples = position_ids.shape[1] if position_ids.ndim == 3 else position_ids.shape[0]
        empty = position_ids.new_empty(samples, position_ids.shape[-1], model.config.head_dim, dtype=dtype)
        return empty, empty

    undo = (replace_forward(model.rotary_emb, tables), COSMOS3.set_processors(model, _WholeSequence()))
    return lambda: [u() for u in undo]


def cosmos3_unsupported(model, config) -> str | None:
    """Tensor parallelism shards the key/value heads too: their count must divide by tp."""
    kv_heads = model.config.num_key_value_heads
    if config.tp > 1 and kv_heads % config.tp:
        return (f"tp={config.tp} cannot shard Cosmos 3's {kv_heads} key/value heads; use a tp that divides "
                f"{kv_heads}, or ulysses/ring")
    return None


def cosmos3_components(arch: SynthArch, kit) -> dict:
    """Cosmos3OmniPipeline's other components: the Wan 2.2 VAE layout and a byte-level BPE tokenizer (Qwen's) with a
    chat template, ``<|vision_start|>`` (the start of generation) and its end-of-text token; no sound tokenizer and no
    guardrail (``enable_safety_checker`` off in the folder's config, so the pipeline builds none)."""
    import diffusers
    import transformers

    words = ("video", "seconds", "long", "resolution", "This", "The", "is", "not", "of", "system", "user",
             "assistant", "helpful", "generate", "from", "prompt", "videos", "images", "You", "are", "who", "will")
    vocab, merges = kit.byte_bpe(("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>"), words)
    tokenizer = transformers.Qwen2Tokenizer(vocab=vocab, merges=merges, eos_token="<|endoftext|>",
                                            pad_token="<|endoftext|>")
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>", "<|vision_start|>"]})
    tokenizer.chat_template = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
                               "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    if len(tokenizer) > arch.transformer["vocab_size"]:
        raise ValueError(f"{arch.name}: its tokenizer has {len(tokenizer)} tokens, more than the transformer's "
                         f"vocab_size {arch.transformer['vocab_size']}")
    return dict(vae=kit.make(diffusers.AutoencoderKLWan, arch.vae, 1), text_tokenizer=tokenizer)


COSMOS3_TENSOR_PLAN = TensorPlan(
    colwise=tuple(f"layers.*.self_attn.{proj}" for proj in ("to_q", "to_k", "to_v", "add_q_proj", "add_k_proj",
                                                           "add_v_proj"))
    + tuple(f"layers.*.{mlp}.{proj}" for mlp in ("mlp", "mlp_moe_gen") for proj in ("gate_proj?", "up_proj")),
    rowwise=("layers.*.self_attn.to_out", "layers.*.self_attn.to_add_out", "layers.*.mlp.down_proj",
             "layers.*.mlp_moe_gen.down_proj"),
    per_rank_attrs={"layers.*.self_attn": ("num_attention_heads", "num_key_value_heads")},
)

_STREAMS = {"und_seq": Split(dim=0, stream="und", ndim=2), "gen_seq": Split(dim=0, stream="gen", ndim=2)}

# -- synthetic architectures ---------------------------------------------------------------------------------
COSMOS3_OMNI = SynthArch(
    name="cosmos3-omni",
    description="Cosmos 3 Omni transformer as diffusers' defaults (36 layers, 32 query / 8 key-value heads x 128, "
                "FFN 12288, Qwen3's vocabulary), the Wan 2.2 VAE, a local byte-level tokenizer; no sound",
    pipeline="Cosmos3OmniPipeline",
    transformer_class="Cosmos3OmniTransformer",
    transformer=dict(hidden_size=4096, head_dim=128, num_attention_heads=32, num_key_value_heads=8,
                     num_hidden_layers=36, intermediate_size=12288, latent_channel=48, latent_patch_size=2,
                     patch_latent_dim=192, vocab_size=151936),
    vae=_WAN22_VAE, clip={}, t5={},
    scheduler=dict(prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=5.0),
    scheduler_class="UniPCMultistepScheduler",
    default_dtype="bfloat16",
    default_size=(720, 1280),
    max_sequence_length=256,
    default_frames=189,
    pipeline_config=dict(enable_safety_checker=False),
)

#: diffusers' test configuration (2 heads of 6 over 1 key-value head, 32 tokens of vocabulary, 1x1 patches of 2
#: channels) cannot take a tokenizer or a VAE: the pipeline's tiny architecture is ours, 4 heads x 8 over 2 key-value
#: heads (tp 2 divides both), 2x2 patches of a 4-channel Wan 2.2 VAE
COSMOS3_OMNI_TINY = dataclasses.replace(
    COSMOS3_OMNI,
    name="cosmos3-omni-tiny",
    description="Cosmos 3 Omni shrunk for CPU tests: 2 layers, 4 query / 2 key-value heads x 8, a 4-channel Wan 2.2 "
                "VAE, a byte-level tokenizer of ~800 tokens",
    transformer=dict(hidden_size=32, head_dim=8, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2,
                     intermediate_size=48, latent_channel=4, latent_patch_size=2, patch_latent_dim=16,
                     vocab_size=1024, rope_axes_dim=[2, 1, 1], rms_norm_eps=1e-5),
    vae=dict(_WAN22_VAE, base_dim=8, decoder_base_dim=8, num_res_blocks=1, z_dim=4, latents_mean=[0.0] * 4,
             latents_std=[1.0] * 4),
    default_dtype="float32",
    default_size=(64, 64),
    max_sequence_length=64,
    default_frames=5,
    pipeline_config=dict(enable_safety_checker=False, default_use_system_prompt=False),
)

COSMOS3 = register(
    ModelAdapter(
        name="cosmos3-omni",
        class_names=("Cosmos3OmniTransformer",),
        num_heads=lambda model: model.config.num_attention_heads,
        sequence_plan=SequencePlan(
            streams=("und", "gen"),
            inputs={"layers.0": _STREAMS},
            gathers={"norm": Gather(dim=0, stream="und"), "norm_moe_gen": Gather(dim=0, stream="gen")},
            differs_from_cp_plan="the class has no _cp_plan (its seams _cp_shard_fn / _cp_gather_fn are left unset): "
                                 "both streams are cut at layers.0 and gathered at the two final norms",
        ),
        attention=AttentionSelector(class_names=("Cosmos3PackedMoTAttention",)),
        sequence_processor=Cosmos3SequenceParallelProcessor,
        # the generation tokens first: dbcache decides on the first carried stream's change, and the text prefix is
        # the same at every step; no streams named: they hold their tokens along dim 0, not the dim 1 PipeFusion sizes
        # its patches by
        blocks=(BlockList("layers", ("gen_seq", "und_seq"), ("und_seq", "gen_seq")),),
        # no token_wise: the chunked feed-forwards cut tokens along dim 1, and these MLPs take [tokens, width]
        example_inputs=cosmos3_example_inputs,
        layout=cosmos3_layout,
        text_tokens=256,
        tensor_plan=COSMOS3_TENSOR_PLAN,
        sample_input="vision_tokens",
        frame_step=4,
        fps=24,
        pipelines=("Cosmos3OmniPipeline",),
        synth_archs=(COSMOS3_OMNI, COSMOS3_OMNI_TINY),
        synth_components=cosmos3_components,
        vae=WAN_VAE_PLAN,
        unsupported=cosmos3_unsupported,
        meta_trace=cosmos3_meta_trace,
        batch_refusal="a call is one packed, unbatched sample (its pipeline keeps a prompt list's first), and the "
                      "pipeline turns the cond call's predictions into new tensors before the uncond call, which a "
                      "cond prediction made on the other cfg rank cannot reach",
        pp_refusal="its layers carry two unbatched streams (tokens along dim 0); PipeFusion is not tested on it",
        graph_refusal="its calls are not tested under capture: python lists of per-item latents and lengths that "
                      "differ between the cond and uncond calls",
    )
)
