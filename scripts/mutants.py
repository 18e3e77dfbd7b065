"""Mutation check: plant plausible bugs in the parallel core one at a time and run the tests that must catch each.

    make mutants                                  # the whole list, with the Makefile's set-up
    python scripts/mutants.py --list              # what is planted where, and which tests must catch it
    python scripts/mutants.py --only ring-merge-weights-swapped,cfg-branch-ranks-swapped

Each :class:`Mutant` replaces one exact snippet of a file under ``src/ditmesh`` (a snippet that no longer occurs
the expected number of times is a stale mutant: the run stops and names it). ``src/``, ``tests/`` and
``pyproject.toml`` are copied once into a temporary folder; each mutant is written into that copy, its tests run
there (``PYTHONPATH`` puts the copy's ``src`` first, and spawned ranks inherit it) with ``pytest -x``, and the
copy's file is put back. The working tree is never edited or read again, so an interrupted run leaves nothing
changed and edits made during a run do not mix into it. A mutant is *killed* when its tests fail (or time
out), *survives* when they pass. An *equivalent* mutant changes no result any test can observe; it is listed
with the reason and run too, and must survive (a kill there means the reason is wrong).

Before the mutants, the union of their tests runs once on the unchanged copy: a test that fails there would
kill every mutant for nothing. ``$DITMESH_TEST_TIMEOUT_S`` (60 here) bounds each collective's wait, so a rank
left waiting by a failed peer fails in a minute instead of hanging.

Exit status 0 when every non-equivalent mutant is killed and every equivalent one survives.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = "src/ditmesh"


@dataclass(frozen=True)
class Mutant:
    """One planted bug: ``old`` (occurring exactly ``count`` times in ``PACKAGE/file``) becomes ``new``."""

    id: str
    file: str
    old: str
    new: str
    #: pytest node ids that must fail, fastest killer first
    tests: tuple[str, ...]
    #: the bug, in words
    bug: str
    #: why no test can observe it (the parallel result is unchanged); empty for a bug that must be killed
    equivalent: str = ""
    count: int = 1


T_RING = "tests/test_ring_usp.py::test_ring_attention_even_and_uneven_lengths_matches_full_attention"
T_ULY = "tests/test_ulysses.py::test_ulysses_attention_matches_full_attention_even_and_uneven"
T_ULY_GROUPS = "tests/test_ulysses.py::test_ulysses_head_group_pipeline_matches_full_attention"
T_USP = "tests/test_ring_usp.py::test_usp_2x2_matches_full_attention_and_places_ulysses_inner"
T_FLUX_SP = "tests/test_ring_usp.py::test_flux_sequence_parallel_matches_single_process"
T_BF16 = "tests/test_attention_bf16.py::test_bf16_sequence_parallel_attention_is_as_accurate_as_one_bf16_pass"
T_WAN_TS = "tests/test_models_sp.py::test_wan_per_token_timesteps_match_single_process"
T_SD3_CN = "tests/test_models_sp.py::test_sd3_controlnet_residuals_match_single_process"
T_FLUX_TP = "tests/test_tensor_parallel.py::test_flux_tp_matches_single_process"
T_MODELS_TP = "tests/test_tensor_parallel_models.py::test_tp_matches_single_process"
T_BATCH = "tests/test_batch_parallel.py::"
T_HOME = "tests/test_family_home.py::"
T_QWEN = "tests/test_qwenimage.py::test_qwenimage_pipeline_matches_single_process"
T_QWEN_EDIT = "tests/test_qwenimage.py::test_qwenimage_edit_transformer_splits_modulate_index_with_the_image"
T_FLUX2 = "tests/test_flux2.py::test_flux2_pipeline_matches_single_process"
T_FLUX2_CACHE = "tests/test_flux2.py::test_flux2_cache_decides_as_one_process_under_ulysses"
T_PP = "tests/test_pipefusion.py::"
T_DISP = "tests/test_displaced.py::"
T_PIXART = "tests/test_pixart.py::"
T_SANA = "tests/test_sana.py::"
T_HUNYUAN = "tests/test_hunyuan_dit.py::"
T_HIDREAM = "tests/test_hidream.py::test_hidream_pipeline_matches_single_process"
T_HIDREAM_NS = "tests/test_hidream.py::test_hidream_non_square_latents_with_their_key_mask_match_single_process"
T_HIDREAM_DP = "tests/test_batch_parallel_models.py::test_hidream_dp2_three_prompts_matches_single_in_order"
T_HYV = "tests/test_hunyuan_video.py::test_hunyuan_video_pipeline_matches_single_process"
T_COGVIDEOX = "tests/test_cogvideox.py::test_cogvideox_pipeline_matches_single_process"
T_SKY = "tests/test_skyreels_v2.py::"
T_MOCHI = "tests/test_mochi.py::"
T_MOCHI_T = f"{T_MOCHI}test_mochi_transformer_with_caption_masks_matches_single_process"
T_SKY_DF = f"{T_SKY}test_skyreels_per_frame_timesteps_and_causal_mask_match_single_process"
T_LTX = "tests/test_ltx.py::"
T_ALLEGRO = "tests/test_allegro.py::"

MUTANTS: tuple[Mutant, ...] = (
    # -- ring attention: the LSE merge, round order, sizes ---------------------------------------------------------
    Mutant("ring-merge-weights-swapped", "attention/ring.py",
           "return out * weight + block_out * block_weight, new_lse",
           "return out * block_weight + block_out * weight, new_lse",
           ("tests/test_ring_usp.py::test_lse_merge_of_key_blocks_is_stable_for_large_logits", f"{T_RING}[2-16-2]"),
           "the running result and the new block are weighted by each other's share"),
    Mutant("ring-lse-in-kernel-dtype", "attention/ring.py",
           "block_out, block_lse = block_out.float(), block_lse.float()",
           "block_out, block_lse = block_out.float(), block_lse.to(block_out.dtype).float()",
           (f"{T_BF16}[ring2-even]", f"{T_BF16}[usp2x2-even]"),
           "the block's LSE is kept in the kernel's dtype (bf16) before the float32 merge"),
    Mutant("ring-merge-naive-exp", "attention/ring.py",
           "new_lse = torch.logaddexp(lse, block_lse)",
           "new_lse = torch.log(torch.exp(lse) + torch.exp(block_lse))",
           ("tests/test_ring_usp.py::test_lse_merge_of_key_blocks_is_stable_for_large_logits",
            "tests/test_ring_usp.py::test_ring_attention_with_huge_logits_stays_finite_and_exact"),
           "the LSEs are added through exp(), which overflows float32 for logits of 1e4"),
    Mutant("ring-incoming-size-from-wrong-rank", "attention/ring.py",
           "incoming_len = seq_sizes[(rank - step - 1) % world]",
           "incoming_len = seq_sizes[(rank + step + 1) % world]",
           (f"{T_RING}[4-7-3]",),
           "the arriving chunk is sized from the next rank's length, not the one it comes from"),
    Mutant("ring-direction-reversed", "attention/ring.py",
           "send_to, recv_from = (rank + 1) % world, (rank - 1) % world",
           "send_to, recv_from = (rank - 1) % world, (rank + 1) % world",
           (f"{T_RING}[4-7-3]",),
           "K/V travel the other way round the ring while receive sizes still assume the forward direction"),
    Mutant("ring-missing-last-round", "attention/ring.py",
           "for step in range(world):", "for step in range(world - 1):",
           (f"{T_RING}[2-16-2]",),
           "the loop stops before attending to the last chunk that arrived"),
    Mutant("ring-extra-exchange-round", "attention/ring.py",
           "if step < world - 1:", "if step < world:",
           (f"{T_RING}[2-16-2]",),
           "one more exchange round per layer (each rank's own chunk comes back, unused): an extra collective",
           count=2),
    # -- Ulysses: head offsets, split sizes, group order ------------------------------------------------------------
    Mutant("ulysses-head-offsets-zero", "attention/ulysses.py",
           "first = offsets(owned)", "first = [0] * world",
           (f"{T_ULY}[2-16-4-1]",),
           "every rank is sent heads counted from head 0 instead of its own first head"),
    Mutant("ulysses-regular-pack-ignores-group-start", "attention/ulysses.py",
           ".narrow(-2, head_starts[0], size)", ".narrow(-2, 0, size)",
           (f"{T_ULY_GROUPS}[2-16-4-2-2-1]",),
           "the one-copy packing of a regular head split takes each share's first heads, whatever the group"),
    Mutant("ulysses-send-splits-use-own-heads", "attention/ulysses.py",
           "in_splits = [lead_numel * xs[0].shape[-3] * head_sizes[j] * dim for j in range(world)]",
           "in_splits = [lead_numel * xs[0].shape[-3] * head_sizes[rank] * dim for j in range(world)]",
           (f"{T_ULY}[2-15-3-1]",),
           "Q/K/V send sizes counted with this rank's head count for every peer (wrong for uneven heads)"),
    Mutant("ulysses-return-splits-use-peer-length", "attention/ulysses.py",
           "out_splits = [lead_numel * seq_sizes[rank] * head_sizes[j] * dim for j in range(world)]",
           "out_splits = [lead_numel * seq_sizes[j] * head_sizes[j] * dim for j in range(world)]",
           (f"{T_ULY}[2-15-3-1]",),
           "the output's return trip expects each peer's sequence length instead of this rank's"),
    Mutant("ulysses-head-groups-joined-group-major", "attention/ulysses.py",
           "torch.cat([parts[c][j] for j in range(world) for c in range(len(groups))], dim=-2)",
           "torch.cat([parts[c][j] for c in range(len(groups)) for j in range(world)], dim=-2)",
           (f"{T_ULY_GROUPS}[2-16-4-2-2-1]",),
           "pipelined head groups are joined group by group instead of rank by rank: heads out of order"),
    Mutant("ulysses-always-two-head-groups", "attention/ulysses.py",
           "groups = head_groups(query.shape[-2], world, max(1, chunks))",
           "groups = head_groups(query.shape[-2], world, max(2, chunks))",
           (f"{T_ULY}[2-16-4-1]",),
           "two head groups whatever was asked: the same result with twice the all-to-alls (extra collectives)"),
    # -- USP ------------------------------------------------------------------------------------------------------
    Mutant("usp-ring-chunk-sizes", "attention/usp.py",
           "return [sum(seq_sizes[r : r + ulysses_degree]) for r in range(0, len(seq_sizes), ulysses_degree)]",
           "return [ulysses_degree * seq_sizes[r] for r in range(0, len(seq_sizes), ulysses_degree)]",
           (f"{T_USP}[13-3]",),
           "a ring rank's K/V length taken as ulysses x its first chunk (wrong when chunks are uneven)"),
    Mutant("usp-ulysses-group-sizes", "attention/usp.py",
           "group_sizes = seq_sizes[ring_rank * ulysses_degree : (ring_rank + 1) * ulysses_degree]",
           "group_sizes = seq_sizes[:ulysses_degree]",
           (f"{T_USP}[13-3]",),
           "every Ulysses group exchanges with the first group's chunk sizes"),
    Mutant("usp-ring-and-ulysses-rank-swapped", "parallel/sequence.py",
           "self.ulysses_degree, self.ring_rank, self.ulysses_rank,",
           "self.ulysses_degree, self.ulysses_rank, self.ring_rank,",
           (f"{T_FLUX_SP}[ulysses2xring2-uneven]",),
           "the model's USP call passes the ring rank as the Ulysses rank and back"),
    Mutant("mesh-flat-rank-axis-order", "mesh.py",
           "for axis in (a for a in AXIS_ORDER if a in axes):",
           "for axis in (a for a in reversed(AXIS_ORDER) if a in axes):",
           (f"{T_USP}[16-4]",),
           "a combined rank counts the inner axis slowest, unlike the flattened group's order"),
    # -- chunk sizes and the exit gather --------------------------------------------------------------------------
    Mutant("split-sizes-remainder-off-by-one", "comm.py",
           "return [base + (1 if i < extra else 0) for i in range(parts)]",
           "return [base + (1 if i <= extra else 0) for i in range(parts)]",
           (f"{T_RING}[2-15-3]",),
           "one chunk too many gets an extra item: the sizes no longer add up to the length"),
    Mutant("split-sizes-remainder-on-last-chunks", "comm.py",
           "return [base + (1 if i < extra else 0) for i in range(parts)]",
           "return [base + (1 if i >= parts - extra else 0) for i in range(parts)]",
           (f"{T_RING}[4-7-3]", f"{T_ULY}[4-7-6-1]", f"{T_WAN_TS}[ring2-uneven]"),
           "the extra items of an uneven split go to the last chunks instead of the first",
           equivalent="every rank derives every split, exchange and gather from this one function, so all agree "
                      "on the other placement and the gathered result is the same; no contract fixes which chunks "
                      "are longer"),
    Mutant("offsets-shifted-by-one-chunk", "comm.py",
           "        out.append(acc)\n        acc += s",
           "        acc += s\n        out.append(acc)",
           (f"{T_ULY}[2-16-4-2]",),
           "each chunk starts where it should end"),
    Mutant("uneven-gather-trims-the-wrong-end", "comm.py",
           "c.narrow(dim, 0, s) for c, s in zip(chunks, sizes)",
           "c.narrow(dim, c.size(dim) - s, s) for c, s in zip(chunks, sizes)",
           (f"{T_WAN_TS}[ulysses2-uneven]",),
           "the uneven all-gather keeps the padding of a short chunk instead of its data"),
    Mutant("sequence-split-by-ulysses-rank", "parallel/sequence.py",
           "return tensor.narrow(dim, sum(sizes[: self.rank]), sizes[self.rank])",
           "return tensor.narrow(dim, sum(sizes[: self.ulysses_rank]), sizes[self.ulysses_rank])",
           (f"{T_WAN_TS}[ring2-even]",),
           "the entry split picks the chunk of the Ulysses rank, not the sequence-parallel rank (wrong under ring)"),
    # -- where the model's tokens are: plans and processors ------------------------------------------------------
    Mutant("wan-timestep-split-on-batch-dim", "models/wan.py",
           '"timestep": Split(dim=1, stream="video", ndim=2)',
           '"timestep": Split(dim=0, stream="video", ndim=2)',
           (f"{T_WAN_TS}[ulysses2-even]",),
           "Wan 2.2 TI2V's per-token timesteps [B, N] are split along the batch"),
    Mutant("wan-per-token-timesteps-left-whole", "models/wan.py",
           '"timestep": Split(dim=1, stream="video", ndim=2)',
           '"timestep": Split(dim=1, stream="video", ndim=3)',
           (f"{T_WAN_TS}[ulysses2-even]",),
           "the timestep split expects 3-D tensors, so TI2V's per-token timesteps [B, N] are never split"),
    Mutant("wan-rope-sin-not-split", "models/wan.py",
           '{0: Split(dim=1, stream="video", ndim=4), 1: Split(dim=1, stream="video", ndim=4)}',
           '{0: Split(dim=1, stream="video", ndim=4)}',
           (f"{T_WAN_TS}[ulysses2-even]",),
           "only the cos half of Wan's RoPE table is split with the tokens"),
    Mutant("sd3-controlnet-residuals-not-split", "models/sd3.py",
           '"block_controlnet_hidden_states": Split(dim=1, stream="image", ndim=3),',
           '"block_controlnet_hidden_states": Split(dim=1, stream="image", ndim=4),',
           (f"{T_SD3_CN}[ulysses2-even]",),
           "the ControlNet residuals' split expects 4-D tensors, so the 3-D residuals stay whole"),
    Mutant("sd3-joint-order-text-first", "models/sd3.py",
           "q, k, v = torch.cat([q, eq], dim=1), torch.cat([k, ek], dim=1), torch.cat([v, ev], dim=1)",
           "q, k, v = torch.cat([eq, q], dim=1), torch.cat([ek, k], dim=1), torch.cat([ev, v], dim=1)",
           (f"{T_SD3_CN}[ulysses2-even]",),
           "SD3's processor joins [text, image] while it reads the image output first"),
    Mutant("sd3-attn2-attends-over-text-too", "models/sd3.py",
           'streams = None if joint else ("image",)', "streams = None",
           (f"{T_SD3_CN}[ulysses2-even]",),
           "SD3.5's image-only attn2 is given the lengths of both streams"),
    Mutant("flux-joint-order-image-first", "models/flux.py",
           "q, k, v = torch.cat([eq, q], dim=1), torch.cat([ek, k], dim=1), torch.cat([ev, v], dim=1)",
           "q, k, v = torch.cat([q, eq], dim=1), torch.cat([k, ek], dim=1), torch.cat([v, ev], dim=1)",
           (f"{T_FLUX_SP}[ulysses2-even]",),
           "FLUX's processor joins [image, text], so RoPE (built text first) rotates the wrong tokens"),
    Mutant("flux-output-split-order", "models/flux.py",
           "text_out, image_out = out.split_with_sizes([text_len, out.shape[1] - text_len], dim=1)",
           "image_out, text_out = out.split_with_sizes([out.shape[1] - text_len, text_len], dim=1)",
           (f"{T_FLUX_SP}[ulysses2-even]",),
           "FLUX's attention output is cut image first, though its tokens are text first"),
    Mutant("qwenimage-text-rope-not-split", "models/qwenimage.py",
           'outputs={"pos_embed": {0: Split(dim=0, stream="image", ndim=2), 1: Split(dim=0, stream="text", ndim=2)}}',
           'outputs={"pos_embed": {0: Split(dim=0, stream="image", ndim=2)}}',
           (f"{T_QWEN}[ulysses2-even]",),
           "QwenImage's text RoPE table stays whole while its text tokens are split"),
    Mutant("qwenimage-mask-without-image-keys", "models/qwenimage.py",
           "image = encoder_hidden_states_mask.new_ones(hidden_states.shape[0], self.sp.stream_length(\"image\"))",
           "image = encoder_hidden_states_mask.new_ones(hidden_states.shape[0], hidden_states.shape[1])",
           (f"{T_QWEN}[ulysses2-even]",),
           "QwenImage's text mask is extended over the local image tokens, not all of them"),
    Mutant("qwenimage-modulate-index-whole", "models/qwenimage.py",
           '"transformer_blocks.*": {"modulate_index": Split(dim=1, stream="image", ndim=2)}',
           '"transformer_blocks.*": {"modulate_index": Split(dim=1, stream="image", ndim=3)}',
           (f"{T_QWEN_EDIT}[{{'ulysses': 2}}]",),
           "an edit checkpoint's modulate_index [B, N] is never split with the image tokens"),
    Mutant("hidream-rope-ids-whole", "models/hidream.py",
           '"pe_embedder": {"ids": Split(dim=1, stream="image", ndim=3, leading=True)},', '',
           (f"{T_HIDREAM}[ulysses2-even]",),
           "HiDream's RoPE ids stay whole while the image tokens are split"),
    Mutant("hidream-rope-ids-split-whole-length", "parallel/sequence.py",
           "n = splitter.stream_length(spec.stream)", "n = value.shape[spec.dim]",
           (f"{T_HIDREAM}[ulysses2-even]",),
           "a leading split cuts the whole tensor (image and local text ids) as the image stream"),
    Mutant("hidream-llama-split-on-layers", "models/hidream.py",
           '"encoder_hidden_states_llama3": Split(dim=2, stream="llama", ndim=4)',
           '"encoder_hidden_states_llama3": Split(dim=1, stream="llama", ndim=4)',
           (f"{T_HIDREAM}[ulysses2-even]",),
           "the Llama stack is cut along its batch, not its tokens"),
    Mutant("hidream-block-llama-not-counted", "models/hidream.py",
           'ATTENTION_STREAMS = ("image", "t5", "llama", "llama")', 'ATTENTION_STREAMS = ("image", "t5", "llama")',
           (f"{T_HIDREAM}[ulysses2-uneven]",),
           "the attention's local lengths leave out the block's own Llama states"),
    Mutant("hidream-single-mask-not-split", "models/hidream.py",
           '"single_stream_blocks.*": {"hidden_states_masks": Split(dim=1, stream="image", ndim=2, leading=True)},', '',
           (f"{T_HIDREAM_NS}[ulysses2]",),
           "the single blocks' key mask (image mask, then ones over the text) stays whole"),
    Mutant("hidream-key-mask-dropped", "models/hidream.py",
           "key = key * hidden_states_masks.view(batch, -1, 1, 1)", "key = key",
           (f"{T_HIDREAM_NS}[ulysses2]",),
           "HiDream's processor leaves the padded image keys unmasked on non-square latents"),
    Mutant("hidream-shared-expert-replicated", "models/hidream.py",
           'ffs = [f"{blocks}.*.block.ff_i.experts.*", f"{blocks}.*.block.ff_i.shared_experts"]',
           'ffs = [f"{blocks}.*.block.ff_i.experts.*"]',
           (f"{T_MODELS_TP}[hidream-tiny-tp2]",),
           "the MoE's shared expert stays whole on every tp rank (exact, but the weights and all-reduces are not the "
           "plan's)"),
    Mutant("hidream-llama-batch-dim-0", "models/hidream.py",
           'batch_dims={"encoder_hidden_states_llama3": 1},', "",
           (T_HIDREAM_DP,),
           "dp and cfg cut the Llama stack [layers, B, L, D] along its layers"),
    Mutant("flux2-fused-split-at-the-full-width", "models/flux2.py",
           "local_qkv = fused.shape[-1] * qkv_dim // (qkv_dim + mlp_dim)", "local_qkv = qkv_dim",
           (f"{T_FLUX2}[tp2-ring2-uneven]",),  # under tp alone the model's own processor runs
           "FLUX.2's single processor cuts the fused projection at the whole model's Q/K/V width, not the shard's"),
    Mutant("packed-colwise-as-one-part", "parallel/tensor.py",
           "shards[name] = LinearShard(kind, parts)", "shards[name] = LinearShard(kind, (sum(parts),))",
           (f"{T_FLUX2}[tp2-even]",),
           "a packed linear is split as one range, so a rank gets Q and K of all heads instead of its share of each part"),
    Mutant("cache-residual-across-the-join", "cache.py",
           "for name, before in self._entering(cache.middle_in).items():",
           "for name, before in cache.middle_in.items():",
           (T_FLUX2_CACHE,),
           "the middle's residual is taken against the image stream alone where the single blocks carry [text, image]"),
    Mutant("qwenimage-vae-padding-not-named", "models/qwenimage.py",
           "    conv_padding=causal_conv_padding(autoencoder_kl_qwenimage.QwenImageCausalConv3d),\n",
           "    conv_padding=None,\n",
           ("tests/test_parallel_vae.py::test_wan_causal_vae_split_along_height_matches_single_process[qwen-decode-5-3-1]",),
           "the QwenImage VAE's causal convolutions are taken to pad as conv.padding says (they pad in forward)"),
    Mutant("pixart-self-attention-mask-dropped", "models/pixart.py",
           "out = self.sp.attention(q, k, v, backend=self._attention_backend, mask=attention_mask)",
           "out = self.sp.attention(q, k, v, backend=self._attention_backend)",
           (f"{T_PIXART}test_pixart_self_attention_mask_matches_single_process[ulysses2]",),
           "PixArt's sequence-parallel self-attention drops the model's attention_mask over image keys"),
    Mutant("pixart-modulated-input-shift-and-scale-swapped", "models/pixart.py",
           "shift, scale = modulation[:, 0:1], modulation[:, 1:2]",
           "scale, shift = modulation[:, 0:1], modulation[:, 1:2]",
           (f"{T_PIXART}test_pixart_modulated_input_is_what_attn1_reads_and_caches_decide_as_one_process",),
           "PixArt's modulated input (what teacache measures) takes the shift for the scale"),
    Mutant("batch-dict-inputs-left-whole", "parallel/batch.py",
           "return {key: _narrow_batch(v, batch, start, size, dim) for key, v in value.items()}", "return value",
           (f"{T_PIXART}test_pixart_alpha_micro_conditions_split_with_the_batch",),
           "dp leaves a dict of per-sample inputs (PixArt-α's added_cond_kwargs) whole on every rank"),
    Mutant("sana-key-sums-not-added-over-ranks", "models/sana.py",
           "key_sums = self.sp.sum(torch.matmul(v, k))", "key_sums = torch.matmul(v, k)",
           (f"{T_SANA}test_sana_pipeline_matches_single_process[ulysses2-uneven]",),
           "Sana's linear attention reads the key sums of its own rank's tokens only"),
    Mutant("grid-split-in-tokens-not-rows", "parallel/sequence.py",
           "if self.grid is None or stream != self.grid.stream:", "if True:",
           (f"{T_SANA}test_sana_pipeline_matches_single_process[ulysses2-uneven]",),
           "a token grid's stream is cut into token chunks that are not whole rows"),
    Mutant("grid-convolution-without-halo", "parallel/sequence.py",
           "            undo.append(add_hook(conv, ConvHook(sp.grid_rows, rows)))\n", "",
           (f"{T_SANA}test_sana_pipeline_matches_single_process[ulysses2-uneven]",),
           "the token grid's convolutions run on the local rows with zero padding at every rank border"),
    Mutant("hunyuan-keys-not-rotated", "models/pixart.py",
           "            k = apply_rotary_emb(k, image_rotary_emb, sequence_dim=1)\n", "",
           (f"{T_HUNYUAN}test_hunyuan_rope_text_masks_and_skips_matter",),
           "the sequence-parallel self-attention rotates HunyuanDiT's queries but not its keys"),
    # -- tensor parallelism -----------------------------------------------------------------------------------------
    Mutant("tp-row-bias-before-all-reduce", "parallel/tensor.py",
           "out = all_reduce_sum(F.linear(x, self.weight), self.group)\n"
           "        return out if self.bias is None else out + self.bias",
           "return all_reduce_sum(F.linear(x, self.weight, self.bias), self.group)",
           (f"{T_FLUX_TP}[flux_tiny-config0]",),
           "a row-parallel linear adds its bias on every rank before the all-reduce: counted tp times"),
    Mutant("tp-colwise-bias-of-rank-0", "parallel/tensor.py",
           "    if shard.kind == \"colwise\":\n        return 0, shard.ranges(rank, size)",
           "    if shard.kind == \"colwise\":\n        return 0, shard.ranges(0, size)",
           (f"{T_FLUX_TP}[flux_tiny-config0]",),
           "every rank keeps rank 0's slice of a column-parallel bias"),
    Mutant("tp-colwise-weight-of-rank-0", "parallel/tensor.py",
           "out.append((start + rank * chunk, chunk))", "out.append((start, chunk))",
           (f"{T_FLUX_TP}[flux_tiny-config0]",),
           "every rank keeps rank 0's rows and columns of every sharded linear"),
    Mutant("tp-packed-parts-from-zero", "parallel/tensor.py",
           "            start += part\n", "",
           ("tests/test_tensor_parallel.py::test_packed_proj_out_split_is_exact_and_a_contiguous_split_is_wrong",),
           "the packed proj_out's second part (the MLP columns) is taken from the first part's columns"),
    Mutant("tp-heads-not-divided", "parallel/tensor.py",
           "setattr(module, attr, value // size)", "setattr(module, attr, value)",
           (f"{T_MODELS_TP}[wan-tiny-tp2]",),
           "attention modules keep their full head count on a tensor-parallel rank (FLUX's processors unflatten "
           "by head_dim and never read it; Wan's cross-attention processor does)"),
    Mutant("tp-sharded-norm-local-width", "parallel/tensor.py",
           "square_sum / self.full + eps", "square_sum / x.shape[-1] + eps",
           ("tests/test_tensor_parallel_models.py::test_sharded_rms_norm_is_exact_and_a_local_norm_is_wrong",),
           "the sharded RMSNorm divides the summed squares by the local width"),
    Mutant("tp-sharded-norm-drops-scale", "parallel/tensor.py",
           "return out if self.weight is None else out * self.weight", "return out",
           (f"{T_MODELS_TP}[wan-tiny-tp2]",),
           "the sharded RMSNorm forgets its weight (no model whose norm scales are all one can show it)"),
    Mutant("tp-encoder-broadcast-from-global-rank-0", "parallel/tensor.py",
           "src = dist.get_global_rank(group, 0)", "src = 0",
           (f"{T_HOME}test_remove_gives_back_a_flux_pipeline_equal_to_one_never_parallelized[4-config0-True]",),
           "text embeddings are broadcast from global rank 0, which is not in the second tp group"),
    # -- CFG and data parallelism --------------------------------------------------------------------------------
    Mutant("cfg-branch-ranks-swapped", "parallel/batch.py",
           'ctx.skip = (ctx.branch == "cond") != (self.cfg_rank == 0)',
           'ctx.skip = (ctx.branch == "cond") == (self.cfg_rank == 0)',
           (f"{T_BATCH}test_flux_true_cfg_cfg2_matches_single_with_one_exchange_per_step",),
           "cfg rank 0 computes the uncond call and rank 1 the cond call, while the exchange assumes the opposite"),
    Mutant("cfg-exchange-cond-uncond-swapped", "parallel/batch.py",
           "cond, uncond = both[0], both[1]", "uncond, cond = both[0], both[1]",
           (f"{T_BATCH}test_flux_true_cfg_cfg2_matches_single_with_one_exchange_per_step",),
           "after the exchange the cond and uncond predictions trade places"),
    Mutant("cfg-first-call-is-uncond", "parallel/batch.py",
           '("cond", "uncond", "third")', '("uncond", "cond", "third")',
           (f"{T_BATCH}test_flux_true_cfg_cfg2_matches_single_with_one_exchange_per_step",),
           "the first call of a step is taken for the uncond branch"),
    Mutant("dp-chunk-offset-from-own-size", "parallel/batch.py",
           "start = sum(self.batch_sizes[: self.batch_rank])",
           "start = self.batch_rank * self.batch_sizes[self.batch_rank]",
           (f"{T_BATCH}test_flux_dp2_three_prompts_matches_single_same_order",),
           "a dp rank's first prompt is its rank times its own chunk size (wrong for uneven chunks)"),
    # -- the per-call context and the hook order -----------------------------------------------------------------
    Mutant("context-call-in-step-never-resets", "hooks.py",
           "self.call_in_step = self.call_in_step + 1 if same_step else 0",
           "self.call_in_step = self.call_in_step + 1 if same_step else self.call_in_step",
           (f"{T_HOME}test_step_index_comes_from_the_scheduler_not_from_counting_calls",),
           "the count of calls within a step carries over into the next step"),
    Mutant("context-ignores-the-scheduler", "hooks.py",
           "self.ctx.begin_call(self.step_index(scheduler, new_run), new_run)",
           "self.ctx.begin_call(None, new_run)",
           (f"{T_HOME}test_step_index_comes_from_the_scheduler_not_from_counting_calls",),
           "the context never learns the step index"),
    Mutant("context-never-starts-a-new-run", "hooks.py",
           "self.ctx.begin_call(self.step_index(scheduler, new_run), new_run)",
           "self.ctx.begin_call(self.step_index(scheduler, new_run), False)",
           (f"{T_HOME}test_every_pipeline_run_starts_its_steps_afresh",),
           "a pipeline run that starts at the step where the last one ended continues its call count"),
    Mutant("hook-order-sequence-outside-batch", "hooks.py",
           'ORDER = ("context", "graph", "consistency", "batch", "pipefusion", "sequence", "encode_once", "cache", "vae", "vae_chunk", "lora",\n         "chunk")',
           'ORDER = ("context", "graph", "consistency", "sequence", "batch", "pipefusion", "encode_once", "cache", "vae", "vae_chunk", "lora",\n         "chunk")',
           (f"{T_BATCH}test_flux_cfg2_x_ulysses2_matches_single",),
           "the sequence split runs outside the CFG/dp hook, so a skipped call's placeholder is one shard long"),
    Mutant("consistency-check-always-passes", "comm.py",
           "return bool(torch.equal(hi, lo))", "return True",
           ("tests/test_ulysses.py::test_consistency_check_catches_ranks_with_different_latents",),
           "the consistency check reports identical inputs whatever the ranks hold"),
    # -- step caching and the redundancy probe ---------------------------------------------------------------------
    Mutant("cache-decision-not-reduced", "cache.py",
           "            if self.group is not None:\n                sums = all_reduce_sum(sums, self.group)",
           "            pass",
           ("tests/test_cache.py::test_ranks_agree_where_their_own_shards_would_not",),
           "each rank decides on its own shard's statistic"),
    Mutant("cache-threshold-flipped", "cache.py",
           "skip = allowed and rel < config.threshold", "skip = allowed and rel > config.threshold",
           ("tests/test_cache.py::test_the_cache_skips_steps_and_stays_close_on_the_trained_pipeline",),
           "skips the steps that change most"),
    Mutant("cache-replay-drops-residual", "cache.py",
           "                value = value + residual\n", "                value = value\n",
           ("tests/test_cache.py::test_the_cache_skips_steps_and_stays_close_on_the_trained_pipeline",),
           "a skipped stretch of blocks returns its input without the blocks' cached residual"),
    Mutant("cache-branches-share-state", "cache.py",
           "return self.branches.setdefault(self.ctx.call_in_step, _Branch())",
           "return self.branches.setdefault(0, _Branch())",
           ("tests/test_cache.py::test_cfg_branches_decide_for_themselves_as_on_one_process",),
           "cond and uncond compare against each other's previous step"),
    Mutant("cache-taylor-wrong-sign", "cache.py",
           "residual = residual + (residual - earlier) * factor",
           "residual = residual - (residual - earlier) * factor",
           ("tests/test_cache.py::test_taylor_extrapolation_beats_replaying_the_last_residual",),
           "the Taylor policy extrapolates backwards"),
    Mutant("cache-batched-cfg-not-in-group", "cache.py",
           'axes = ("ring", "ulysses") + (("dp", "cfg") if batched_cfg(runtime) else ())', 'axes = ("ring", "ulysses")',
           ("tests/test_cache.py::test_sd3_batched_cfg_cache_decides_over_both_halves_of_the_batch",),
           "a batched-CFG family (SD3) decides on each cfg rank's half of the batch alone"),
    Mutant("teacache-sum-never-resets", "cache.py",
           "            if not skip:\n                state.accumulated = 0.0\n", "",
           ("tests/test_cache.py::test_teacache_accumulates_rescaled_change_and_resets_when_it_computes",),
           "the accumulated change is not reset by a computed step, so teacache skips less and less"),
    Mutant("cache-booked-inside-the-call", "cache.py",
           "            state.earlier_step, state.middle_step = state.middle_step, step\n",
           "            pass\n",
           ("tests/test_cache.py::test_step_scheduled_policies_replay_one_whole_call_graph_per_path",
            "tests/test_cache.py::test_taylor_extrapolation_beats_replaying_the_last_residual"),
           "the steps of the last computed calls are never booked, so taylor extrapolates from the wrong span"),
    # -- masks, chunked feed-forwards, the parallel VAE and LoRA under tp ---------------------------------------------
    Mutant("mask-keys-in-model-order", "parallel/sequence.py",
           "        mask = mask.index_select(-1, index)\n", "",
           ("tests/test_attention_masks.py::test_masked_sequence_parallel_attention_matches_single_process",),
           "the mask's key columns stay in the model's order while the gathered keys are in the ranks' order"),
    Mutant("chunk-last-piece-skips-the-module", "parallel/chunk.py",
           "piece = call_next((x.narrow(1, start, min(size, x.shape[1] - start)),) + tuple(args[1:]), rest)",
           "piece = (call_next((x.narrow(1, start, min(size, x.shape[1] - start)),) + tuple(args[1:]), rest)"
           " if start + size < x.shape[1] else x.narrow(1, start, x.shape[1] - start))",
           ("tests/test_chunk.py::test_chunked_feed_forwards_and_attention_equal_whole_ones_on_every_family",),
           "the last piece of a chunked feed-forward returns its input"),
    Mutant("attention-piece-keeps-the-first-mask-rows", "attention/local.py",
           "rows = mask if mask is None or mask.shape[-2] == 1 else mask.narrow(-2, start, n)",
           "rows = mask if mask is None or mask.shape[-2] == 1 else mask.narrow(-2, 0, n)",
           ("tests/test_chunk.py::test_attention_in_query_pieces_equals_whole_with_masks_and_lse",),
           "every piece of the queries is masked with the first piece's mask rows"),
    Mutant("ring-round-attention-unchunked", "attention/ring.py",
           "attention_with_lse(query, in_hand[0], in_hand[1], scale, chunk_mask, chunks)",
           "attention_with_lse(query, in_hand[0], in_hand[1], scale, chunk_mask)",
           ("tests/test_chunk.py::test_chunked_feed_forwards_and_attention_under_parallelism_equal_one_whole_process",),
           "ring rounds ignore the chunk setting (the attention never runs in pieces)"),
    Mutant("vae-chunk-upsampler-without-halo", "parallel/vae.py",
           "state, rows = self.state, ConvRows(3, 1, 1, 1)", "state, rows = self.state, ConvRows(1, 1, 0, 0)",
           ("tests/test_parallel_vae.py::test_kl_vae_in_pieces_of_rows_matches_whole",),
           "an up-sampler's pieces get no halo row: the rows at each piece's edge see zeros instead of their neighbours"),
    Mutant("vae-pieces-overwrite-rows-still-read", "parallel/vae.py",
           "band.parts = base if b <= a else [(a, band.rows(a, b).clone())] + base", "band.parts = base",
           ("tests/test_parallel_vae.py::test_kl_vae_split_in_pieces_of_rows_matches_single_process",),
           "a residual block's second convolution, written over its input piece by piece, reads the rows above a piece "
           "after the previous piece overwrote them"),
    Mutant("vae-pieces-decided-per-rank", "parallel/vae.py",
           "        if busiest <= per_piece:\n", "        if own <= per_piece:\n",
           ("tests/test_parallel_vae.py::test_kl_vae_split_in_pieces_of_rows_matches_single_process",),
           "each rank decides alone whether a layer runs in pieces: under an uneven split one rank sends raw halo rows "
           "while its neighbour expects normalized ones"),
    Mutant("tiled-vae-placeholders-never-filled", "parallel/vae.py",
           "                self.tiles[k].copy_(piece.view(self.tiles[k].shape))\n", "                pass\n",
           ("tests/test_parallel_vae.py::test_tiled_decode_spread_over_ranks_equals_one_process_tiled_decode",),
           "the gathered tiles are not copied into the placeholders: diffusers blends uninitialised tiles"),
    Mutant("vae-group-norm-without-between-rank-term", "parallel/vae.py",
           "return torch.stack([total, mean_all, m2s.sum(0) + (counts * (means - mean_all).square()).sum(0)])",
           "return torch.stack([total, mean_all, m2s.sum(0)])",
           ("tests/test_parallel_vae.py::test_kl_vae_split_along_height_matches_single_process",),
           "the group norm adds the ranks' own variances and drops the spread of their means (DistVAE's shortcut)"),
    Mutant("pp-cache-decided-only-on-stage-0", "cache.py",
           "        self.first_own = own.start\n", "        self.first_own = 0\n",
           ("tests/test_pipefusion.py::test_cached_pp_with_every_step_exact_matches_the_cached_single_process_run",),
           "under PipeFusion only the first stage takes the cache's decisions; the later stages compute every step"),
    Mutant("vae-attention-keys-from-own-rows", "parallel/vae.py",
           "key, value = attn.to_k(every.transpose(1, 2)), attn.to_v(every.transpose(1, 2))",
           "key, value = attn.to_k(own.transpose(1, 2)), attn.to_v(own.transpose(1, 2))",
           ("tests/test_parallel_vae.py::test_kl_vae_split_along_height_matches_single_process",),
           "the mid-block attention's queries see only their own rank's rows as keys and values"),
    Mutant("lora-row-parallel-a-not-reduced", "parallel/tensor.py",
           "            reduce_lora_inputs(model.get_submodule(name), group)\n", "",
           ("tests/test_lora.py::test_flux_lora_tp2_matches_single_process",),
           "a row-parallel LoRA layer adds B applied to this rank's partial A product, never summed over tp"),
    Mutant("probe-heads-not-reduced-over-tp", "redundancy.py",
           'split = split_width is not None and (always_split or first.shape[-1] == split_width)',
           'split = split_width is not None and always_split',
           ("tests/test_analyze.py::test_sequence_and_tensor_parallel_runs_record_the_single_process_numbers",),
           "attention outputs taken before the output projection (split by heads) are not summed over tp"),
    Mutant("serve-batch-pictures-out-of-order", "serve/app.py",
           'per_job = [pictures] if len(batch) == 1 else [[picture] for picture in pictures]',
           'per_job = [pictures] if len(batch) == 1 else [[picture] for picture in pictures[::-1]]',
           ("tests/test_serve.py::test_waiting_requests_that_differ_in_prompt_and_seed_share_one_call_and_get_their_"
            "own_pictures",),
           "the pictures of a shared call go back to the wrong requests"),
    Mutant("serve-batch-ignores-an-option", "serve/app.py",
           'if k not in ("prompt", "seed"))',
           'if k not in ("prompt", "seed", "steps"))',
           ("tests/test_serve.py::test_a_batch_takes_only_compatible_requests_in_order_and_a_cancelled_member_"
            "leaves_the_others_running",),
           "requests asking for different step counts share a call (one of them gets the other's steps)"),
    Mutant("serve-restarts-for-ever", "serve/app.py",
           'if failed >= self.restart_attempts:',
           'if failed >= self.restart_attempts and False:',
           ("tests/test_serve.py::test_replicas_that_keep_failing_to_restart_are_given_up_and_requests_get_503",),
           "a replica that cannot start is retried for ever and the queue waits with it"),
    # -- PipeFusion: the exact warm-up, the text with the first patch, per-branch buffers, the broadcast root --------
    Mutant("pp-warmup-ignored", "parallel/pipefusion.py",
           "return ctx.run_step < self.warmup or self.filled.get(ctx.call_in_step) != ctx.run",
           "return self.filled.get(ctx.call_in_step) != ctx.run",
           (f"{T_PP}test_warmup_over_every_step_matches_single_process",),
           "only a run's first call is exact; the warm-up steps after it run the stale pipeline"),
    Mutant("pp-text-with-every-patch", "parallel/pipefusion.py",
           "return (0, n) if index == 0 else (0, 0)", "return (0, n)",
           (f"{T_PP}test_stale_schedule_matches_its_single_process_emulation",),
           "the text tokens run through the blocks with every patch instead of with the first"),
    Mutant("pp-kv-buffers-shared-by-cfg-branches", "parallel/pipefusion.py",
           "name = (self.name, layer, self.ctx.call_in_step)", "name = (self.name, layer, 0)",
           (f"{T_PP}test_pp_composes_with_cfg_and_dp",),
           "the cond and uncond calls of a step read each other's stale K/V"),
    Mutant("pp-sends-on-the-pp-group", "parallel/pipefusion.py",
           "comm.send_start(flat, 1, self.to_next, self.chunk_bytes)",
           "comm.send_start(flat, self.stage + 1, self.group, self.chunk_bytes)",
           (f"{T_PP}test_stages_send_and_receive_on_their_own_two_rank_groups",),
           "a stage's sends share the pp group with its posted receives, which NCCL runs one after another"),
    Mutant("pp-output-broadcast-from-first-stage", "parallel/pipefusion.py",
           "comm.broadcast_pieces(sample.view(-1), pf.degree - 1, pf.group, pf.chunk_bytes)",
           "comm.broadcast_pieces(sample.view(-1), 0, pf.group, pf.chunk_bytes)",
           (f"{T_PP}test_warmup_over_every_step_matches_single_process",),
           "every rank steps on the first stage's output, which skipped the later blocks"),
    # -- displaced attention: its own fresh K/V, the warm-up, the buffers per call ----------------------------------
    Mutant("displaced-own-kv-stale", "parallel/displaced.py",
           "chunks[self.sp.rank] = kv", "pass",
           (f"{T_DISP}test_stale_schedule_matches_its_single_process_emulation[3]",),
           "with uneven chunks, a rank attends to its own K/V of the previous step instead of this step's"),
    Mutant("displaced-own-kv-stale-even", "parallel/displaced.py",
           "gathered.narrow(0, self.sp.rank * longest, longest).copy_(kv)", "pass",
           (f"{T_DISP}test_stale_schedule_matches_its_single_process_emulation[2]",),
           "with even chunks, a rank attends to its own K/V of the previous step instead of this step's"),
    Mutant("displaced-layer-count-not-reset", "parallel/displaced.py",
           "self.call, self.layers = ctx.calls, 0", "self.call = ctx.calls",
           (f"{T_DISP}test_stale_schedule_matches_its_single_process_emulation[2]",),
           "the layer count runs on across calls: no call finds its layer's buffer, every step is exact"),
    Mutant("displaced-kept-buffer-returned", "parallel/displaced.py",
           "return gathered if last else gathered.clone()", "return gathered",
           (f"{T_DISP}test_compiled_blocks_trace_once_for_every_layer_and_give_the_eager_run",),
           "an exact step returns the gather it keeps for the next step: the compiled block may reuse its memory"),
    Mutant("displaced-warmup-ignored", "parallel/displaced.py",
           "exact = ctx.run_step < self.warmup or held is None", "exact = held is None",
           (f"{T_DISP}test_warmup_over_every_step_matches_single_process",),
           "only a run's first call is exact; the warm-up steps after it read stale K/V"),
    Mutant("displaced-buffers-shared-by-cfg-branches", "parallel/displaced.py",
           "slot = (self.name, self.layers, ctx.call_in_step)", "slot = (self.name, self.layers, 0)",
           (f"{T_DISP}test_displaced_composes_with_cfg_dp_and_tp",),
           "the cond and uncond calls of a step read each other's stale K/V"),
    Mutant("displaced-graph-parity-dropped", "parallel/displaced.py",
           "self.planned = (ctx.call_in_step, exact, ctx.run_step % 2, last)",
           "self.planned = (ctx.call_in_step, exact, 0, last)",
           (f"{T_DISP}test_graphed_steps_are_captured_once_per_plan_replayed_and_give_the_ungraphed_run[2]",),
           "graphed: every step reads and writes the same buffers of one parity, and one graph serves both"),
    Mutant("displaced-graph-gathers-not-joined", "parallel/graph.py",
           "            self.displaced.join()", "            pass",
           (f"{T_DISP}test_graphed_steps_are_captured_once_per_plan_replayed_and_give_the_ungraphed_run[2]",),
           "graphed: a call's gathers are not waited before its end, so they would cross the graph's end"),
    Mutant("displaced-graph-buffer-made-per-call", "parallel/displaced.py",
           "            if out is None:  # made by", "            if True:  # made by",
           (f"{T_DISP}test_graphed_steps_are_captured_once_per_plan_replayed_and_give_the_ungraphed_run[2]",),
           "graphed: each call gathers into a new buffer, which the next step's graph never reads"),
    Mutant("hunyuan-video-stream-order", "models/hunyuan_video.py",
           "out = self.sp.attention(torch.cat([q, eq], dim=1), torch.cat([k, ek], dim=1), torch.cat([v, ev], dim=1),",
           "out = self.sp.attention(torch.cat([eq, q], dim=1), torch.cat([ek, k], dim=1), torch.cat([ev, v], dim=1),",
           (f"{T_HYV}[ulysses2-even]",),
           "HunyuanVideo's processor joins [text, video], the reverse of the order its key mask and output cut assume"),
    Mutant("hunyuan-video-mask-dropped", "models/hunyuan_video.py",
           "backend=self._attention_backend, mask=attention_mask)",
           "backend=self._attention_backend)",
           (f"{T_HYV}[ulysses2-even]",),
           "HunyuanVideo's sequence-parallel attention drops the padded-text key mask"),
    Mutant("hunyuan-video-text-not-split", "models/hunyuan_video.py",
           """"transformer_blocks.0": {"hidden_states": Split(dim=1, stream="video", ndim=3),
                                             "encoder_hidden_states": Split(dim=1, stream="text", ndim=3)}""",
           """"transformer_blocks.0": {"hidden_states": Split(dim=1, stream="video", ndim=3)}""",
           (f"{T_HYV}[ulysses2-even]",),
           "HunyuanVideo's text tokens are left whole on every rank, so each joint attention sees them once per rank"),
    Mutant("cogvideox-output-split-order", "models/cogvideox.py",
           "text_out, video_out = out.split_with_sizes([text_len, out.shape[1] - text_len], dim=1)",
           "video_out, text_out = out.split_with_sizes([out.shape[1] - text_len, text_len], dim=1)",
           (f"{T_COGVIDEOX}[ulysses2-even]",),
           "CogVideoX's attention output is cut video first, though its tokens are text first"),
    Mutant("cogvideox-rope-not-split", "models/cogvideox.py",
           'inputs={"": {"image_rotary_emb": Split(dim=0, stream="video", ndim=2)},',
           'inputs={"": {"image_rotary_emb": Split(dim=0, stream="video", ndim=3)},',
           (f"{T_COGVIDEOX}[ulysses2-even]",),
           "CogVideoX's RoPE table (cos, sin [video, D]) stays whole while its video tokens are split"),
    Mutant("cogvideox-text-not-split", "models/cogvideox.py",
           """"transformer_blocks.0": {"hidden_states": Split(dim=1, stream="video", ndim=3),
                                             "encoder_hidden_states": Split(dim=1, stream="text", ndim=3)}""",
           """"transformer_blocks.0": {"hidden_states": Split(dim=1, stream="video", ndim=3)}""",
           (f"{T_COGVIDEOX}[ulysses2-even]",),
           "CogVideoX's text tokens are left whole on every rank, so each joint attention sees them once per rank"),
    Mutant("skyreels-causal-mask-dropped", "models/wan.py",
           "backend=self._attention_backend, mask=attention_mask)", "backend=self._attention_backend, mask=None)",
           (f"{T_SKY_DF}[ulysses2-even]",),
           "the self-attention drops SkyReels-V2's block-causal mask: every frame sees the later ones"),
    Mutant("skyreels-per-token-temb-left-whole", "models/skyreels_v2.py",
           '"temb": Split(dim=2, stream="video", ndim=4)', '"temb": Split(dim=2, stream="video", ndim=5)',
           (f"{T_SKY_DF}[ulysses2-even]",),
           "diffusion forcing's per-token modulation [B, 6, N, D] is never cut with the tokens"),
    Mutant("skyreels-gather-after-final-modulation", "models/skyreels_v2.py",
           'gathers={"norm_out": Gather(dim=1, stream="video")}', 'gathers={"proj_out": Gather(dim=1, stream="video")}',
           (f"{T_SKY_DF}[ring2-uneven]",),
           "the tokens are gathered after proj_out, so the local tokens meet the whole per-token shift and scale"),
    Mutant("loop-step-not-counted", "hooks.py",
           "ctx.loop_step += 1", "ctx.loop_step += 0",
           (f"{T_SKY}test_skyreels_diffusion_forcing_pipeline_matches_single_process[cfg2-even]",),
           "a pipeline stepping copies of its scheduler stays at step 0: cfg 2 sees a third call in one step"),
    Mutant("mochi-streams-text-first", "models/mochi.py",
           'streams=("video", "text"),', 'streams=("text", "video"),',
           (f"{T_MOCHI}test_mochi_pipeline_matches_single_process[ulysses2-uneven]",),
           "the joint sequence in [text, video] order while the model's mask (and RoPE) are in [video, text]"),
    Mutant("mochi-caption-mask-dropped", "models/mochi.py",
           "torch.cat([v, tv], 1), mask=mask)", "torch.cat([v, tv], 1), mask=None)",
           (f"{T_MOCHI_T}[ulysses4-uneven]",),
           "every caption token, padding included, is a key of the joint attention"),
    Mutant("mochi-rope-sin-not-split", "models/mochi.py",
           '{0: Split(dim=0, stream="video", ndim=3), 1: Split(dim=0, stream="video", ndim=3)}',
           '{0: Split(dim=0, stream="video", ndim=3)}',
           (f"{T_MOCHI_T}[ring4-even]",),
           "only the cos half of Mochi's RoPE table is cut with the video tokens"),
    Mutant("vae-pre-padding-ignored", "parallel/vae.py",
           "    if plan.pre_padding is not None:", "    if False:",
           ("tests/test_parallel_vae.py::test_mochi_vae_split_along_height_matches_single_process[decode-5-3-2-2]",),
           "the rows Mochi's causal convolutions replicate in forward are taken for the neighbours' rows on inner ranks"),
    Mutant("tp-head-outputs-whole", "parallel/tensor.py",
           "return out.narrow(dim, rank * heads, heads)", "return out.narrow(dim, 0, heads)",
           (f"{T_MOCHI_T}[tp2-ulysses2-even]", "tests/test_ltx.py::test_ltx_pipeline_matches_single_process[tp2-even]"),
           "every tensor-parallel rank rotates its heads with the first rank's RoPE frequencies (Mochi's head slices, "
           "LTX's per-channel tables)"),
    # -- LTX-Video and Allegro: the RoPE tables and positions, per-token timesteps, masks, the tp share of the tables --
    Mutant("ltx-rope-tables-whole", "models/ltx.py",
           'outputs={"rope": {0: Split(dim=1, stream="video", ndim=3), 1: Split(dim=1, stream="video", ndim=3)}},',
           "outputs={},",
           (f"{T_LTX}test_ltx_pipeline_matches_single_process[ulysses2-uneven]",),
           "every rank rotates its LTX tokens with the whole RoPE table"),
    Mutant("ltx-per-token-timestep-whole", "models/ltx.py",
           '"timestep": Split(dim=1, stream="video", ndim=2, broadcast=True)}},', "}},",
           (f"{T_LTX}test_ltx_per_token_and_broadcast_timesteps_match_single_process[ulysses2]",),
           "LTX's per-token timesteps (image-to-video) stay whole while their tokens are split"),
    Mutant("split-broadcast-ignored", "parallel/sequence.py",
           "if spec.broadcast and value.shape[spec.dim] == 1:", "if False:",
           (f"{T_LTX}test_ltx_per_token_and_broadcast_timesteps_match_single_process[ulysses2]",),
           "a [B, 1] timestep (LTXConditionPipeline) is cut as if it had a token dim"),
    Mutant("ltx-keys-not-rotated", "models/ltx.py",
           "            k = transformer_ltx.apply_rotary_emb(k, image_rotary_emb)\n", "",
           (f"{T_LTX}test_ltx_pipeline_matches_single_process[ulysses2-uneven]",),
           "the sequence-parallel self-attention rotates LTX's queries but not its keys"),
    Mutant("ltx-rope-tables-whole-under-tp", "models/ltx.py", '    head_outputs={"rope": -1},\n', "",
           (f"{T_LTX}test_ltx_pipeline_matches_single_process[tp2-even]",),
           "a tp rank rotates its share of the heads with the whole inner dim's RoPE table"),
    Mutant("allegro-positions-whole", "models/allegro.py",
           'inputs={"": {"image_rotary_emb": Split(dim=1, stream="video", ndim=2, item=1)},', "inputs={",
           (f"{T_ALLEGRO}test_allegro_pipeline_matches_single_process[ulysses2-uneven]",),
           "Allegro's RoPE positions stay whole while their tokens are split"),
    Mutant("split-item-ignored", "parallel/sequence.py", "if spec.item is not None:", "if False:",
           (f"{T_ALLEGRO}test_allegro_pipeline_matches_single_process[ulysses2-uneven]",),
           "Allegro's RoPE frequency tables are cut like the positions they are indexed by"),
    Mutant("allegro-self-attention-mask-dropped", "models/allegro.py",
           "out = self.sp.attention(q, k, v, backend=self._attention_backend, mask=mask)",
           "out = self.sp.attention(q, k, v, backend=self._attention_backend)",
           (f"{T_ALLEGRO}test_allegro_self_attention_mask_and_rope_match_single_process[ulysses2]",),
           "Allegro's sequence-parallel self-attention drops the model's attention_mask over video keys"),
    Mutant("allegro-modulated-input-shift-and-scale-swapped", "models/allegro.py",
           "return block.norm1(hidden) * (1 + modulation[:, 1:2]) + modulation[:, 0:1]",
           "return block.norm1(hidden) * (1 + modulation[:, 0:1]) + modulation[:, 1:2]",
           (f"{T_ALLEGRO}test_allegro_modulated_input_is_what_attn1_reads_and_caches_decide_as_one_process",),
           "Allegro's modulated input (what teacache measures) takes the shift for the scale"),
)


def check_snippets(mutants) -> None:
    """Stop with one line per stale mutant (its snippet is not in its file exactly ``count`` times)."""
    stale = []
    for m in mutants:
        found = (ROOT / PACKAGE / m.file).read_text().count(m.old)
        if found != m.count:
            stale.append(f"{m.id}: its snippet occurs {found} times in {PACKAGE}/{m.file}, expected {m.count}")
    ids = [m.id for m in mutants]
    stale += [f"{i}: the id is listed twice" for i in sorted({i for i in ids if ids.count(i) > 1})]
    if stale:
        sys.exit("mutants: stale list; update scripts/mutants.py:\n  " + "\n  ".join(stale))


def copy_env(copy: Path, **extra) -> dict:
    """The environment that makes Python (and every process it spawns) import ditmesh from ``copy``."""
    return dict(os.environ, PYTHONDONTWRITEBYTECODE="1", **extra,
                PYTHONPATH=os.pathsep.join(p for p in (str(copy / "src"), os.environ.get("PYTHONPATH")) if p))


def run_tests(tests, copy: Path, timeout_s: float, collective_timeout_s: float) -> tuple[str, float, str]:
    """Run pytest on ``tests`` in the copy; returns (outcome, seconds, output).

    Outcome: ``failed`` (a test failed), ``passed``, ``timeout`` or ``error`` (pytest could not run them).
    """
    env = copy_env(copy, DITMESH_TEST_TIMEOUT_S=str(collective_timeout_s))
    cmd = [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", *tests]
    start = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=copy, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)  # its own process group: the ranks go with it on a timeout
    try:
        out, _ = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        return "timeout", time.monotonic() - start, out
    outcome = {0: "passed", 1: "failed"}.get(proc.returncode, "error")
    return outcome, time.monotonic() - start, out


def verdict(m: Mutant, outcome: str) -> tuple[str, bool]:
    """(what happened, whether it is what the list says should happen)."""
    caught = outcome in ("failed", "timeout")
    if outcome == "error":
        return "ERROR", False
    if m.equivalent:
        return ("KILLED (listed equivalent)", False) if caught else ("equivalent", True)
    return ("killed" + (" (timeout)" if outcome == "timeout" else ""), True) if caught else ("SURVIVED", False)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--list", action="store_true", help="print the mutants and exit")
    parser.add_argument("--only", default="", help="comma-separated mutant ids to run")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per mutant (default 300)")
    parser.add_argument("--collective-timeout", type=float, default=60.0,
                        help="seconds a rank waits in one collective (default 60)")
    parser.add_argument("--no-baseline", action="store_true", help="skip the run of the tests on the unchanged tree")
    args = parser.parse_args(argv)

    mutants = MUTANTS
    if args.only:
        wanted = args.only.split(",")
        unknown = [w for w in wanted if w not in {m.id for m in MUTANTS}]
        if unknown:
            parser.error(f"unknown mutant id(s) {', '.join(unknown)}; see --list")
        mutants = tuple(m for m in MUTANTS if m.id in wanted)
    check_snippets(mutants)
    if args.list:
        for m in mutants:
            print(f"{m.id}  [{m.file}]  {m.bug}" + (f"\n    equivalent: {m.equivalent}" if m.equivalent else ""))
            print("    tests: " + " ".join(t.removeprefix("tests/") for t in m.tests))
        print(f"{len(mutants)} mutants ({sum(bool(m.equivalent) for m in mutants)} listed equivalent)")
        return 0

    started = time.monotonic()
    # SIGTERM (a CI timeout, kill) unwinds like Ctrl-C, so the temporary copy is removed
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    with tempfile.TemporaryDirectory(prefix="ditmesh-mutants-") as tmp:
        copy = Path(tmp)
        for part in ("src", "tests"):
            shutil.copytree(ROOT / part, copy / part, ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
        shutil.copy2(ROOT / "pyproject.toml", copy / "pyproject.toml")
        probe = subprocess.run([sys.executable, "-c", "import ditmesh; print(ditmesh.__file__)"], text=True,
                               capture_output=True, cwd=copy, env=copy_env(copy))
        if not probe.stdout.startswith(str(copy)):
            sys.exit(f"mutants: the tests would not import the mutated copy (got {probe.stdout.strip() or probe.stderr})")
        if not args.no_baseline:
            union = list(dict.fromkeys(t for m in mutants for t in m.tests))
            outcome, seconds, out = run_tests(union, copy, args.timeout * 3, args.collective_timeout)
            print(f"baseline: {len(union)} tests on the unchanged tree {outcome} in {seconds:.0f} s", flush=True)
            if outcome != "passed":
                print(out[-3000:])
                sys.exit("mutants: the selected tests fail without any mutant; fix them first")
        rows, ok_count = [], 0
        for i, m in enumerate(mutants, 1):
            path = copy / PACKAGE / m.file
            original = path.read_text()
            path.write_text(original.replace(m.old, m.new))
            try:
                outcome, seconds, out = run_tests(m.tests, copy, args.timeout, args.collective_timeout)
            finally:
                path.write_text(original)
            word, ok = verdict(m, outcome)
            ok_count += ok
            rows.append((m, word, seconds))
            print(f"[{i:2d}/{len(mutants)}] {word:<10} {seconds:5.0f} s  {m.id}", flush=True)
            if not ok:
                print("    " + "\n    ".join(out.strip().splitlines()[-8:]))
    to_kill = [r for r in rows if not r[0].equivalent]
    killed = sum(word.startswith("killed") for _, word, _ in to_kill)
    equivalent = len(rows) - len(to_kill)
    print(f"\nmutation score: {killed}/{len(to_kill)} killed ({100 * killed / max(1, len(to_kill)):.0f}%), "
          f"{equivalent} listed equivalent, {time.monotonic() - started:.0f} s in all")
    for m, word, _ in rows:
        if word not in ("killed", "killed (timeout)", "equivalent"):
            print(f"  {word}: {m.id} ({m.bug})")
    return 0 if ok_count == len(rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
