"""Ring / USP cases executed on every rank of a gloo worker pool (module-level so workers can import them)."""

from __future__ import annotations

import torch
import torch.distributed as dist


def reference_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Softmax attention over all keys in float64, ``[B, S, H, D]`` layout (the ground truth)."""
    qh, kh, vh = (t.double().transpose(1, 2) for t in (q, k, v))
    probs = torch.softmax(qh @ kh.transpose(-1, -2) / q.shape[-1] ** 0.5, dim=-1)
    return (probs @ vh).transpose(1, 2)


def _random_qkv(seq_len: int, heads: int, seed: int, logit_scale: float):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(2, seq_len, heads, 8, generator=g) for _ in range(3))
    return q * logit_scale, k, v


def _shard(t: torch.Tensor, sizes: list[int], index: int) -> torch.Tensor:
    return t[:, sum(sizes[:index]) : sum(sizes[:index]) + sizes[index]]


def _rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    assert out.shape == ref.shape, (out.shape, ref.shape)
    return float((out.double() - ref).norm() / ref.norm()) if ref.numel() else 0.0


def ring_attention_case(seq_len: int, heads: int, seed: int = 0, logit_scale: float = 1.0):
    """Ring attention over the world group on this rank's chunk vs float64 full attention.

    Returns (relative error, collective counts, output is finite).
    """
    from ditmesh.attention.ring import ring_attention
    from ditmesh.comm import count_collectives, split_sizes

    rank, world = dist.get_rank(), dist.get_world_size()
    q, k, v = _random_qkv(seq_len, heads, seed, logit_scale)
    sizes = split_sizes(seq_len, world)
    with count_collectives() as counts:
        out = ring_attention(*(_shard(t, sizes, rank) for t in (q, k, v)), sizes, rank, dist.group.WORLD)
    ref = _shard(reference_attention(q, k, v), sizes, rank)
    return _rel_err(out, ref), dict(counts), bool(torch.isfinite(out).all())


def usp_attention_case(seq_len: int, heads: int, ring: int, ulysses: int, seed: int = 0):
    """USP attention on a ring x ulysses mesh vs float64 full attention; also checks the rank placement.

    Returns (relative error, collective counts, placement facts).
    """
    from ditmesh import ParallelConfig
    from ditmesh.attention.usp import usp_attention
    from ditmesh.comm import count_collectives, split_sizes
    from ditmesh.mesh import ParallelMesh

    mesh = ParallelMesh.build(ParallelConfig(ring=ring, ulysses=ulysses), torch.device("cpu"))
    sp_rank = mesh.flat_rank("ring", "ulysses")
    sp_group = mesh.group_of("ring", "ulysses")
    placement = {
        # the DeviceMesh's own layout of the 2-D sub-mesh, row-major
        "device_mesh_index": mesh.device_mesh["ring", "ulysses"].mesh.flatten().tolist().index(dist.get_rank()),
        "sp_rank": sp_rank,
        "rank_in_sp_group": dist.get_rank(sp_group),
        "ring_group_ranks": dist.get_process_group_ranks(mesh.group("ring")),
        "ulysses_group_ranks": dist.get_process_group_ranks(mesh.group("ulysses")),
    }
    q, k, v = _random_qkv(seq_len, heads, seed, 1.0)
    sizes = split_sizes(seq_len, ring * ulysses)
    with count_collectives() as counts:
        out = usp_attention(*(_shard(t, sizes, sp_rank) for t in (q, k, v)), sizes, ulysses, mesh.rank("ring"),
                            mesh.rank("ulysses"), mesh.group("ring"), mesh.group("ulysses"))
    ref = _shard(reference_attention(q, k, v), sizes, sp_rank)
    return _rel_err(out, ref), dict(counts), placement


def flux_latents_and_call_counts(model: str, config: dict, steps: int, height: int, width: int, text_len: int):
    """Run a FluxPipeline with ditmesh on this rank.

    Returns (final latents, the collectives of each transformer call (one Counter per call, the exit
    gather included), the collectives of the whole pipeline call, the text/image token counts).
    """
    from diffusers import FluxPipeline

    from ditmesh import ParallelConfig, parallelize
    from ditmesh.comm import COUNTS, count_collectives

    torch.manual_seed(0)
    pipe = FluxPipeline.from_pretrained(model, dtype=torch.float32)
    pipe.set_progress_bar_config(disable=True)
    parallelize(pipe, ParallelConfig(**config))
    per_call, tokens, final = [], {}, {}

    def before(module, args, kwargs):
        # registered after ditmesh's hooks: runs after the split, and its post-hook after the gather
        final["before"] = dict(COUNTS)

    def after(module, args, kwargs, output):
        per_call.append({k: v - final["before"].get(k, 0) for k, v in COUNTS.items() if v != final["before"].get(k, 0)})

    def entry(module, args, kwargs):
        tokens.update(text=kwargs["encoder_hidden_states"].shape[1], image=kwargs["hidden_states"].shape[1])

    pipe.transformer.register_forward_pre_hook(entry, with_kwargs=True, prepend=True)
    pipe.transformer.register_forward_pre_hook(before, with_kwargs=True)
    pipe.transformer.register_forward_hook(after, with_kwargs=True)

    def grab(p, i, t, kw):
        final["latents"] = kw["latents"].clone()
        return kw

    with count_collectives() as total:
        pipe("a red circle", height=height, width=width, num_inference_steps=steps, guidance_scale=3.5,
             generator=torch.Generator().manual_seed(42), max_sequence_length=text_len, output_type="latent",
             callback_on_step_end=grab)
    return final["latents"], per_call, dict(total), tokens


def bf16_attention_case(method: str, seq_len: int, heads: int, logit_scale: float, ring: int = 1, ulysses: int = 1,
                        seed: int = 0):
    """Sequence-parallel attention (``method``: ring, ulysses or usp) in bfloat16 on this rank's chunk, and the same
    kernel in one pass over the whole sequence in bfloat16, both against float64 attention of the same bf16 inputs.

    The local kernel is what the method runs in a pipeline: ``attention_with_lse`` for ring and USP (they merge
    through the LSE), torch's SDPA for Ulysses. Returns (parallel error, single-pass error, output dtype), the
    errors as (squared error, squared reference) sums over this rank's rows, so the caller can add up the ranks.
    """
    import torch.nn.functional as F

    from ditmesh import ParallelConfig
    from ditmesh.attention.local import attention_with_lse
    from ditmesh.attention.ring import ring_attention
    from ditmesh.attention.ulysses import ulysses_attention
    from ditmesh.attention.usp import usp_attention
    from ditmesh.comm import split_sizes
    from ditmesh.mesh import ParallelMesh

    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(1, seq_len, heads, 32, generator=g) for _ in range(3))
    q, k, v = (q * logit_scale).bfloat16(), k.bfloat16(), v.bfloat16()
    ref = reference_attention(q, k, v)

    def sdpa(q_, k_, v_):
        return F.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (q_, k_, v_))).transpose(1, 2)

    mesh = ParallelMesh.build(ParallelConfig(ring=ring, ulysses=ulysses), torch.device("cpu"))
    rank = mesh.flat_rank("ring", "ulysses")
    sizes = split_sizes(seq_len, ring * ulysses)
    local = [_shard(t, sizes, rank) for t in (q, k, v)]
    if method == "ring":
        out, single = ring_attention(*local, sizes, rank, mesh.group("ring")), attention_with_lse(q, k, v)[0]
    elif method == "ulysses":
        out, single = ulysses_attention(*local, sizes, rank, mesh.group("ulysses"), sdpa), sdpa(q, k, v)
    else:
        out = usp_attention(*local, sizes, ulysses, mesh.rank("ring"), mesh.rank("ulysses"), mesh.group("ring"),
                            mesh.group("ulysses"))
        single = attention_with_lse(q, k, v)[0]
    ref = _shard(ref, sizes, rank)

    def sums(x):
        return float((x.double() - ref).pow(2).sum()), float(ref.pow(2).sum())

    return sums(out), sums(_shard(single, sizes, rank)), str(out.dtype)
