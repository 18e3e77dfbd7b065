"""Functions run on every rank of a gloo worker pool for the PipeFusion tests (``tests/test_pipefusion.py``)."""

from __future__ import annotations

import torch


def load(model: str, config: dict, stage_load: bool = False):
    """The pipeline in folder ``model`` (float32); ``stage_load``: its transformer(s) with only this rank's PipeFusion
    stage's block weights (``load_stage_transformer``)."""
    from diffusers import DiffusionPipeline

    if not stage_load:
        return DiffusionPipeline.from_pretrained(model, dtype=torch.float32)
    import torch.distributed as dist

    from ditmesh import ParallelConfig
    from ditmesh.parallel.pipefusion import load_stage_transformer

    names = [n for n in DiffusionPipeline.load_config(model) if n.startswith("transformer")]
    pipe = DiffusionPipeline.from_pretrained(model, dtype=torch.float32, **dict.fromkeys(names))
    parallel = ParallelConfig(**config)
    stage = parallel.coordinate(dist.get_rank(), "pp")
    pipe.register_modules(**{n: load_stage_transformer(model, stage, parallel.pp, "cpu", torch.float32, n) for n in names})
    return pipe


def pipeline_run(model: str, config: dict, steps: int = 3, height: int = 64, width: int = 64, frames: int | None = None,
                 guidance_scale: float = 5.0, max_sequence_length: int = 16, per_step: bool = False, remove: bool = False,
                 prompt="a red circle", call: dict | None = None, stage_load: bool = False, keep: dict | None = None,
                 **options):
    """Run the pipeline in folder ``model`` under ``config`` (``{}``: one process, not parallelized) with the
    PipeFusion ``options`` (``pp_patches``, ``pp_warmup``, ``pp_chunk_bytes``); ``call``: more pipeline arguments
    (a negative prompt for FLUX's true CFG); ``stage_load``: load only this rank's stage of the transformer(s);
    ``keep``: a dict that receives the pipeline (``keep["pipe"]``), for a caller that inspects it after the run.

    Returns ``(final latents, collectives of the call, collectives per step if per_step, state dict after remove if
    remove, the transformer (component name) each step ran)``.
    """
    from cases_models import call_kwargs
    from ditmesh import ParallelConfig, parallelize
    from ditmesh.api import remove as ditmesh_remove
    from ditmesh.comm import COUNTS, count_collectives

    torch.manual_seed(0)
    pipe = load(model, config, stage_load)
    pipe.set_progress_bar_config(disable=True)
    if keep is not None:
        keep["pipe"] = pipe
    if config:
        parallelize(pipe, ParallelConfig(**config), **options)
    steps_counts, experts, marks = [], [], [dict(COUNTS)]
    for name, component in pipe.components.items():
        if name.startswith("transformer") and component is not None:
            component.register_forward_pre_hook(lambda module, args, name=name: experts.append(name))
    final = {}
    kwargs = call_kwargs(final, steps, height, width, frames, max_sequence_length, guidance_scale)
    grab = kwargs["callback_on_step_end"]

    def count_step(p, i, t, kw):  # the collectives of each step, and where it ends
        now = dict(COUNTS)
        steps_counts.append({k: now.get(k, 0) - marks[-1].get(k, 0) for k in now if now.get(k, 0) != marks[-1].get(k, 0)})
        marks.append(now)
        experts.append(None)
        return grab(p, i, t, kw)

    kwargs.update(call or {}, callback_on_step_end=count_step)
    with count_collectives() as counts:
        pipe(prompt, **kwargs)
    state = None
    if remove:
        ditmesh_remove(pipe)
        state = {k: v.clone() for k, v in pipe.transformer.state_dict().items()}
    by_step, current = [], []
    for name in experts:
        if name is None:
            by_step.append(sorted(set(current)))
            current = []
        else:
            current.append(name)
    return final["latents"], dict(counts), steps_counts if per_step else None, state, by_step


class _StaleAttention:
    """FLUX attention over a per-layer K/V buffer, written on its own (not ditmesh's code path): the current piece's
    K/V (its text tokens at ``text_offset``, its image tokens at ``offset`` of the image) are written into the
    layer's buffer over ``[text, image]`` of ``written``, and its queries attend to the layer's buffer of ``read``
    (SDPA). PipeFusion reads and writes one buffer (the patches not yet computed in this step are read from the last
    step); displaced attention reads the last step's and writes the next step's."""

    def __init__(self, read: dict, written: dict, layer: str, state: dict):
        self.read, self.written, self.layer, self.state = read, written, layer, state

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, image_rotary_emb=None):
        from diffusers.models.embeddings import apply_rotary_emb

        heads = lambda t: t.unflatten(-1, (attn.heads, -1))  # noqa: E731  [B, S, H, D]
        q, k, v = heads(attn.to_q(hidden_states)), heads(attn.to_k(hidden_states)), heads(attn.to_v(hidden_states))
        q, k = attn.norm_q(q), attn.norm_k(k)
        joint = encoder_hidden_states is not None
        if joint:
            eq = attn.norm_added_q(heads(attn.add_q_proj(encoder_hidden_states)))
            ek = attn.norm_added_k(heads(attn.add_k_proj(encoder_hidden_states)))
            ev = heads(attn.add_v_proj(encoder_hidden_states))
            q, k, v = torch.cat([eq, q], 1), torch.cat([ek, k], 1), torch.cat([ev, v], 1)
        q = apply_rotary_emb(q, image_rotary_emb, sequence_dim=1)
        k = apply_rotary_emb(k, image_rotary_emb, sequence_dim=1)
        text, image, offset, local_text, text_offset = (self.state[n] for n in ("text", "image", "offset", "local_text",
                                                                                 "text_offset"))
        for buffers in (self.read, self.written):
            if self.state["step"] == 0 or self.layer not in buffers:
                buffers[self.layer] = (k.new_zeros(k.shape[0], text + image, *k.shape[2:]),
                                       v.new_zeros(v.shape[0], text + image, *v.shape[2:]))
        kb, vb = self.written[self.layer]
        kb[:, text_offset:text_offset + local_text] = k[:, :local_text]
        vb[:, text_offset:text_offset + local_text] = v[:, :local_text]
        n = k.shape[1] - local_text
        kb[:, text + offset:text + offset + n], vb[:, text + offset:text + offset + n] = k[:, local_text:], v[:, local_text:]
        kr, vr = self.read[self.layer]
        if self.read is not self.written:  # the piece's own K/V are fresh
            kr, vr = kr.clone(), vr.clone()
            kr[:, text_offset:text_offset + local_text], vr[:, text_offset:text_offset + local_text] = (
                k[:, :local_text], v[:, :local_text])
            kr[:, text + offset:text + offset + n], vr[:, text + offset:text + offset + n] = k[:, local_text:], v[:, local_text:]
        out = torch.nn.functional.scaled_dot_product_attention(q.transpose(1, 2), kr.transpose(1, 2), vr.transpose(1, 2))
        out = out.transpose(1, 2).flatten(2, 3).to(q.dtype)
        if not joint:
            return out
        text_out, image_out = out[:, :encoder_hidden_states.shape[1]], out[:, encoder_hidden_states.shape[1]:]
        return attn.to_out[1](attn.to_out[0](image_out)), attn.to_add_out(text_out)


def _sizes(n: int, parts: int) -> list[int]:
    base, extra = divmod(n, parts)
    return [base + (1 if j < extra else 0) for j in range(parts)]


class _SkippedMiddleBlocks:
    """A step cache with ``first=1`` on FLUX's blocks, written on its own (not ditmesh's code path): at a ``skipped``
    step every block after the first returns its inputs and the last adds the residual that they produced for the
    current piece's tokens at the last step they ran; at other steps the residual of the piece's tokens is kept, in
    buffers over the whole text and image (``state``'s piece: ``text_offset`` and ``offset``). FLUX's double and
    single blocks take and return the same pair, ``(encoder_hidden_states, hidden_states)``."""

    def __init__(self, blocks, skipped: tuple, state: dict):
        self.blocks, self.skipped, self.state = list(blocks), set(skipped), state
        self.kept, self.entering = {}, None
        for i, block in enumerate(self.blocks):
            block.forward = self.wrap(i, block.forward)

    def pieces(self, name: str, tensor: torch.Tensor):
        """The current piece's run of ``tensor``'s stream in the kept whole buffer (made on first use)."""
        st = self.state
        whole = st["text"] if name == "encoder_hidden_states" else st["image"]
        start = st["text_offset"] if name == "encoder_hidden_states" else st["offset"]
        if name not in self.kept or st["step"] == 0:
            self.kept[name] = tensor.new_zeros(tensor.shape[0], whole, *tensor.shape[2:])
        return self.kept[name].narrow(1, start, tensor.shape[1])

    def wrap(self, index: int, forward):
        last = index == len(self.blocks) - 1

        def run(hidden_states, encoder_hidden_states, *args, **kwargs):
            named = {"encoder_hidden_states": encoder_hidden_states, "hidden_states": hidden_states}
            if self.state["step"] in self.skipped:
                if last:
                    named = {n: t + self.pieces(n, t) for n, t in named.items()}
                return named["encoder_hidden_states"], named["hidden_states"]
            if index == 0:
                self.entering = named
            out = forward(hidden_states, encoder_hidden_states, *args, **kwargs)
            if last:
                for name, value in zip(("encoder_hidden_states", "hidden_states"), out):
                    self.pieces(name, value).copy_(value - self.entering[name])
            return out

        return run


def flux_stale_emulation(model: str, patches: int, warmup: int, steps: int = 3, height: int = 64, width: int = 64,
                         max_sequence_length: int = 16, displaced: bool = False,
                         skipped: tuple = ()) -> torch.Tensor:
    """Final latents of the FLUX pipeline in ``model`` on one process, under a stale schedule emulated without
    ditmesh: the first ``warmup`` steps whole; later steps as ``patches`` pieces in order, the whole transformer per
    piece, each attention over its layer's K/V buffer (:class:`_StaleAttention`). PipeFusion: the pieces are patches
    of the image tokens, the text with patch 0, one buffer read and written. ``displaced``: the pieces are the
    ranks' contiguous chunks of the text and of the image tokens (uneven by at most one, the larger first), each
    reading the buffer the last step wrote (its own tokens fresh) and writing the next step's. ``skipped``: steps at
    which a step cache with ``first=1`` skips every block after the first (:class:`_SkippedMiddleBlocks`)."""
    from diffusers import DiffusionPipeline

    from cases_models import call_kwargs

    torch.manual_seed(0)
    pipe = DiffusionPipeline.from_pretrained(model, dtype=torch.float32)
    pipe.set_progress_bar_config(disable=True)
    transformer = pipe.transformer
    state, read = {"step": -1}, {}
    written = {} if displaced else read
    for name, module in transformer.named_modules():
        if type(module).__name__ == "FluxAttention":
            module.set_processor(_StaleAttention(read, written, name, state))
    if skipped:
        _SkippedMiddleBlocks([*transformer.transformer_blocks][1:] + [*transformer.single_transformer_blocks], skipped,
                             state)
    forward = transformer.forward

    def patched(hidden_states, encoder_hidden_states, txt_ids, img_ids, **kwargs):
        state["step"] += 1
        if displaced and state["step"] > 0:  # the last step's K/V are read in this one
            for layer, (k, v) in written.items():
                read[layer] = (k.clone(), v.clone())
        image, text = hidden_states.shape[1], encoder_hidden_states.shape[1]
        count = 1 if state["step"] < warmup else patches
        sizes = _sizes(image, count)
        texts = _sizes(text, count) if displaced else [text] + [0] * (count - 1)
        outs, offset, text_offset = [], 0, 0
        for size, local_text in zip(sizes, texts):
            state.update(text=text, image=image, offset=offset, local_text=local_text, text_offset=text_offset)
            ehs = encoder_hidden_states[:, text_offset:text_offset + local_text]
            tids = txt_ids[text_offset:text_offset + local_text]
            outs.append(forward(hidden_states=hidden_states[:, offset:offset + size], encoder_hidden_states=ehs,
                                txt_ids=tids, img_ids=img_ids[offset:offset + size], **kwargs)[0])
            offset += size
            text_offset += local_text
        return (torch.cat(outs, 1),)

    transformer.forward = patched
    final = {}
    pipe("a red circle", **call_kwargs(final, steps, height, width, None, max_sequence_length, 5.0))
    return final["latents"]


def stage_weights(model: str, config: dict, stage_load: bool = False, **options) -> dict:
    """After ``parallelize``: the parameter elements this rank holds in each transformer block (and each block's whole
    count, from the files), and the stages."""
    from diffusers import DiffusionPipeline

    from ditmesh import ParallelConfig, parallelize
    from ditmesh.hooks import find_hook
    from ditmesh.models import adapter_for

    whole = DiffusionPipeline.from_pretrained(model, dtype=torch.float32).transformer
    full = [sum(p.numel() for p in b.parameters()) for b in adapter_for(whole).block_modules(whole)]
    pipe = load(model, config, stage_load)
    parallelize(pipe, ParallelConfig(**config), **options)
    blocks = adapter_for(pipe.transformer).block_modules(pipe.transformer)
    held = [sum(p.numel() for p in b.parameters()) for b in blocks]
    stages = find_hook(blocks[0], "pipefusion").pf.stages
    return {"full": full, "held": held, "stages": [(s.start, s.stop) for s in stages]}


def stage_loaded_elsewhere(model: str) -> None:
    """Parallelize at pp 2 a transformer loaded with stage 0's blocks on every rank (wrong on rank 1)."""
    from diffusers import DiffusionPipeline

    from ditmesh import ParallelConfig, parallelize
    from ditmesh.parallel.pipefusion import load_stage_transformer

    pipe = DiffusionPipeline.from_pretrained(model, dtype=torch.float32, transformer=None)
    pipe.register_modules(transformer=load_stage_transformer(model, 0, 2, "cpu", torch.float32))
    parallelize(pipe, ParallelConfig(pp=2))


def check_pipefusion(pools, path: str, steps: int = 3, **call) -> None:
    """PipeFusion (pp 2, 3 patches) on the batched-CFG pipeline in folder ``path`` (one transformer call a step), from
    the test process: warm-up over every step equals one process (rel. err <= 1e-5); the stale schedule (warm-up 1)
    runs 3 patches a call after it, every rank on the same prediction, near the exact run but not on it. Each step's
    sends and broadcasts are counted."""
    from ditmesh.testing import rel_err

    ref = pipeline_run(path, {}, steps=steps, **call)[0]
    for warmup in (steps, 1):
        results = pools(2).run(pipeline_run, path, {"pp": 2}, steps=steps, per_step=True, pp_warmup=warmup,
                               pp_patches=3, **call)
        assert torch.equal(results[0][0], results[1][0])
        for rank, (latents, _, per_step, _, _) in enumerate(results):
            assert rel_err(latents, ref) <= 1e-5 if warmup == steps else 1e-6 < rel_err(latents, ref) < 0.2
            kind = "pp_send" if rank == 0 else "pp_recv"
            assert per_step == [{kind: 1 if step < warmup else 3, "broadcast": 1} for step in range(steps)]


def neighbour_ranks(model: str, config: dict) -> dict:
    """This rank's PipeFusion stage, the global ranks of its two-rank groups with the previous and the next stage
    (None at the ends) and of its pp group, for ``config``; and the group (its global ranks) of every point-to-point
    send and receive of a 2-step pipeline run of ``model`` under ``config`` (1 exact step, 1 stale)."""
    import torch.distributed as dist

    from ditmesh import ParallelConfig
    from ditmesh.mesh import ParallelMesh

    mesh = ParallelMesh.build(ParallelConfig(**config), torch.device("cpu"))
    ranks = lambda g: None if g is None else dist.get_process_group_ranks(g)  # noqa: E731
    previous, following = mesh.neighbour_groups("pp")
    assert mesh.neighbour_groups("pp") == (previous, following)  # created once
    messages = []
    isend, irecv = dist.isend, dist.irecv

    def recorded(kind, fn):
        def call(tensor, peer, group=None, **kwargs):
            messages.append((kind, ranks(group or dist.group.WORLD), peer))
            return fn(tensor, peer, group=group, **kwargs)
        return call

    dist.isend, dist.irecv = recorded("send", isend), recorded("recv", irecv)
    try:
        pipeline_run(model, config, steps=2, pp_warmup=1)
    finally:
        dist.isend, dist.irecv = isend, irecv
    return {"stage": mesh.rank("pp"), "previous": ranks(previous), "next": ranks(following),
            "pp": ranks(mesh.group("pp")), "messages": messages}
