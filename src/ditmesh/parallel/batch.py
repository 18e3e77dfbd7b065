"""The batch-level dimensions: data parallelism (``dp``) and CFG parallelism (``cfg``).

Every rank runs the whole pipeline call: text encoding, the scheduler and the VAE work on the full
batch, so latents, noise and seeds are exactly those of a 1-GPU run. Only the transformer, which does
nearly all the work, is divided:

* **Data parallelism** splits the batch (prompts x images per prompt) of every transformer call into
  contiguous chunks over the ``dp`` ranks (uneven counts are fine; a rank with no item skips the call)
  and all-gathers the outputs along the batch in order: one all-gather per transformer call. A transformer
  that takes one tensor per sample in lists (the adapter's ``sample_lists``) has those lists sliced, and its list
  of per-sample outputs is gathered stacked; a plain list with one entry per sample (``batch_lists``: JoyImage-Edit
  Plus's image grids) is sliced with the batch.
* **CFG parallelism, batched pipelines** (SD3: one call on ``[uncond, cond]``): the same batch split,
  over the combined ``dp x cfg`` group; one all-gather per step.
* **CFG parallelism, sequential pipelines** (FLUX true CFG, Wan: a "cond" call then an "uncond" call per
  step): the cfg rank 0 computes the cond call and cfg rank 1 the uncond call; each skips the other. The
  skipped call returns a placeholder tensor that is filled in place by the one all-gather after the
  uncond call, before the pipeline combines the two predictions.

Which branch a call is comes from the call's place in its denoising step: the per-call context holds the
scheduler's step index and how many transformer calls that step has had (the first is "cond", the second
"uncond"; every sequential-CFG pipeline of diffusers calls them in that order). Without a scheduler (a
bare transformer), calls alternate.

The ``batch`` hook sits outside the ``sequence`` hook (``hooks.ORDER``): it sees the full inputs, and a
skipped call returns a full-size placeholder without running anything inside it (no split, no gather).

Cross-rank rules: every rank receives the same calls in the same order (same pipeline arguments); split
sizes come from the global batch size; skip decisions depend only on the branch and the cfg rank, so
all ranks of a sequence-parallel group skip together.
"""

from __future__ import annotations

import inspect

import torch

from ..comm import all_gather_uneven, split_sizes
from ..config import ConfigError
from ..hooks import ForwardContext, Hook, add_hook, bind_kwargs, output_sample, with_output_sample
from ..mesh import ParallelMesh
from ..models.base import ModelAdapter


def cfg_off_message(adapter: ModelAdapter) -> str:
    """The one-line error for cfg=2 on a call without an unconditional branch."""
    return ("cfg=2 needs classifier-free guidance, but this pipeline call ran without an unconditional branch; "
            f"turn guidance on ({adapter.name}: {adapter.cfg_hint}) or use cfg=1")


class BatchParallel:
    """Runtime of data and CFG parallelism on one transformer."""

    def __init__(self, pipe, model: torch.nn.Module, mesh: ParallelMesh, adapter: ModelAdapter, ctx: ForwardContext):
        self.pipe = pipe
        self.model = model
        self.adapter = adapter
        self.ctx = ctx
        self.cfg = mesh.size("cfg")
        self.sequential = self.cfg > 1 and adapter.cfg_mode == "sequential"
        # the batch is split over dp (sequential CFG) or over dp x cfg (batched CFG)
        batch_axes = ("dp",) if self.sequential or self.cfg == 1 else ("dp", "cfg")
        self.batch_degree = 1
        for axis in batch_axes:
            self.batch_degree *= mesh.size(axis)
        self.batch_rank = mesh.flat_rank(*batch_axes)
        self.batch_group = mesh.group_of(*batch_axes)
        self.cfg_rank = mesh.rank("cfg")
        self.cfg_group = mesh.group("cfg")
        # per-call state: the batch chunk sizes of this call (None: not split)
        self.batch_sizes: list[int] | None = None
        # a model taking a list of samples: its first sample, batched (what an empty chunk's placeholder is shaped like)
        self.sample_template: torch.Tensor | None = None
        # sequential CFG: the cond call's result (computed on cfg rank 0, a placeholder on cfg rank 1)
        self.pending: torch.Tensor | None = None
        self.run = ctx.run  # the pipeline run ``pending`` belongs to

    # -- which branch ------------------------------------------------------------------------------
    def _branch(self) -> str:
        if self.ctx.step_index is not None:  # the call's place in its step: cond first, then uncond
            return ("cond", "uncond", "third")[min(self.ctx.call_in_step, 2)]
        return "uncond" if self.pending is not None else "cond"

    def _check_guidance_on(self) -> None:
        if getattr(self.pipe, "do_classifier_free_guidance", True) is False:
            raise ConfigError(cfg_off_message(self.adapter))

    # -- around each call --------------------------------------------------------------------------
    def pre_hook(self, kwargs: dict) -> dict:
        """Set the call's branch and skip decision in the context; returns this rank's batch chunk of the inputs."""
        ctx = self.ctx
        self.batch_sizes = None
        if ctx.run != self.run:
            self.pending = None  # a new pipeline run: nothing is owed from the last one
        self.run = ctx.run
        if self.cfg > 1:
            self._check_guidance_on()
        if self.sequential:
            ctx.branch = self._branch()
            if ctx.branch == "third":
                raise ConfigError(f"step {ctx.step_index} called the transformer a third time; ditmesh cfg=2 expects "
                                  "one cond and one uncond call per step")
            if ctx.branch == "cond" and self.pending is not None:
                self.pending = None
                raise ConfigError(cfg_off_message(self.adapter))
            if ctx.branch == "uncond" and self.pending is None:
                raise ConfigError("an unconditional transformer call came without its conditional call; "
                                  "ditmesh cfg=2 expects the pipeline to call cond then uncond each step")
            ctx.skip = (ctx.branch == "cond") != (self.cfg_rank == 0)
            if ctx.skip:
                return kwargs
        if self.batch_degree > 1:
            samples = kwargs[self.adapter.sample_input]
            batch = len(samples) if self.adapter.sample_lists else samples.shape[0]
            self.batch_sizes = split_sizes(batch, self.batch_degree)
            if 0 in self.batch_sizes and (ctx.needs_full_batches or self.adapter.full_batches):  # all ranks refuse
                full = self.adapter.full_batches
                need = (f"{self.adapter.name} needs (its calls return more than the sample)" if full else
                        "step caching and the redundancy probe need (each rank must compute every call)")
                raise ConfigError(f"a batch of {batch} cannot give each of the {self.batch_degree} dp/cfg batch ranks an "
                                  f"image, which {need}; give at least {self.batch_degree} images or use smaller dp")
            start = sum(self.batch_sizes[: self.batch_rank])
            size = self.batch_sizes[self.batch_rank]
            kwargs = dict(kwargs)
            if self.adapter.sample_lists:  # the placeholder of an empty chunk is shaped like one sample's output
                self.sample_template = samples[0].unsqueeze(0)
            for name in self.adapter.batch_inputs:
                value = kwargs.get(name)
                sliced = name in self.adapter.sample_lists or name in self.adapter.batch_lists
                kwargs[name] = value[start:start + size] if sliced and value is not None \
                    else _narrow_batch(value, batch, start, size, self.adapter.batch_dims.get(name, 0))
            ctx.skip = size == 0
        return kwargs

    def post_hook(self, output):
        """The call's full output on every rank: batch chunks gathered; under sequential CFG, the two branches
        exchanged after the uncond call."""
        sample = output_sample(output)
        if sample is None:  # a call that returns no sample (AnyFlow-FAR's cache writes): nothing to gather
            return output
        if self.adapter.sample_lists:  # one output tensor per sample (Z-Image): gathered as one stacked batch
            sample = torch.stack(sample) if isinstance(sample, list) else sample
        if self.batch_sizes is not None:
            sample = all_gather_uneven(sample, 0, self.batch_sizes, self.batch_group)
        if self.sequential:
            if self.ctx.branch == "cond":
                self.pending = sample  # real on cfg rank 0, a placeholder on cfg rank 1
            else:
                mine = self.pending if self.cfg_rank == 0 else sample
                both = all_gather_uneven(mine.unsqueeze(0), 0, [1, 1], self.cfg_group)
                cond, uncond = both[0], both[1]
                if self.cfg_rank == 1:
                    self.pending.copy_(cond)  # the tensor the pipeline holds as its cond prediction
                sample = uncond if self.cfg_rank == 1 else uncond.clone()
                self.pending = None
        if self.adapter.sample_lists:
            sample = list(sample.unbind(0))
        return with_output_sample(output, sample)


def _narrow_batch(value, batch: int, start: int, size: int, dim: int = 0):
    """This rank's batch chunk (along ``dim``) of a tensor, of each tensor of a list (ControlNet residuals) or of each
    value of a dict (PixArt-α's micro-conditions, ``added_cond_kwargs``)."""
    if isinstance(value, dict):
        return {key: _narrow_batch(v, batch, start, size, dim) for key, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_narrow_batch(v, batch, start, size, dim) for v in value)
    if isinstance(value, torch.Tensor) and value.ndim > dim and value.shape[dim] == batch:
        return value.narrow(dim, start, size)
    return value


class BatchHook(Hook):
    """The transformer's ``batch`` hook: split the batch (or pick the CFG branch), skip or run, gather."""

    name = "batch"

    def __init__(self, bp: BatchParallel, forward):
        self.bp, self.forward = bp, forward
        params = inspect.signature(forward).parameters
        self.return_dict_default = params["return_dict"].default if "return_dict" in params else True

    def __call__(self, owner, call_next, args, kwargs):
        bp = self.bp
        kwargs = bp.pre_hook(bind_kwargs(self.forward, args, kwargs))
        if bp.ctx.skip:
            # A skipped call does no work: an uninitialized output of the full size (filled later by the CFG
            # exchange, or discarded by the batch gather of an empty chunk).
            output = self.placeholder(kwargs)
        else:
            output = call_next((), kwargs)
        return bp.post_hook(output)

    def placeholder(self, kwargs: dict):
        bp = self.bp
        like = bp.sample_template.narrow(0, 0, 0) if bp.adapter.sample_lists else kwargs[bp.adapter.sample_input]
        sample = bp.adapter.output_like(bp.model, like, kwargs)
        if not kwargs.get("return_dict", self.return_dict_default):
            return (sample,)
        from diffusers.models.modeling_outputs import Transformer2DModelOutput

        return Transformer2DModelOutput(sample=sample)


def apply(pipe, model: torch.nn.Module, mesh: ParallelMesh, adapter: ModelAdapter, ctx: ForwardContext) -> list:
    """Make ``model`` data- and/or CFG-parallel over the mesh. Returns undo callables ([] at degree 1)."""
    if mesh.size("dp") == 1 and mesh.size("cfg") == 1:
        return []
    if not adapter.batch_inputs:
        raise NotImplementedError(f"{adapter.name}: no batch plan; data/CFG parallelism is not available for it")
    if mesh.size("cfg") > 1 and adapter.cfg_refusal:
        raise ConfigError(f"cfg={mesh.size('cfg')} cannot run {adapter.name}: {adapter.cfg_refusal}; use cfg=1 (dp, "
                          "ulysses, ring and tp run)")
    bp = BatchParallel(pipe, model, mesh, adapter, ctx)
    return [add_hook(model, BatchHook(bp, model.forward))]
