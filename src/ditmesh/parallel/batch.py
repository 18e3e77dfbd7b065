"""The batch-level dimensions: data parallelism (``dp``) and CFG parallelism (``cfg``).

Every rank runs the whole pipeline call: text encoding, the scheduler and the VAE work on the full
batch, so latents, noise and seeds are exactly those of a 1-GPU run. Only the transformer, which does
nearly all the work, is divided:

* **Data parallelism** splits the batch (prompts x images per prompt) of every transformer call into
  contiguous chunks over the ``dp`` ranks (uneven counts are fine; a rank with no item skips the call)
  and all-gathers the outputs along the batch in order: one all-gather per transformer call.
* **CFG parallelism, batched pipelines** (SD3: one call on ``[uncond, cond]``): the same batch split,
  over the combined ``dp x cfg`` group; one all-gather per step.
* **CFG parallelism, sequential pipelines** (FLUX true CFG, Wan: a "cond" call then an "uncond" call per
  step): the cfg rank 0 computes the cond call and cfg rank 1 the uncond call; each skips the other. The
  skipped call returns a placeholder tensor that is filled in place by the one all-gather after the
  uncond call, before the pipeline combines the two predictions.

Which branch a call is comes from diffusers' ``transformer.cache_context("cond" | "uncond")``, which
FLUX and Wan pipelines enter around each call (falling back to call parity for pipelines that don't).

Cross-rank rules: every rank receives the same calls in the same order (same pipeline arguments); split
sizes come from the global batch size; skip decisions depend only on the branch and the cfg rank, so
all ranks of a sequence-parallel group skip together.
"""

from __future__ import annotations

import contextlib
import inspect

import torch

from ..comm import all_gather_uneven, split_sizes
from ..config import ConfigError
from ..mesh import ParallelMesh
from ..models.base import ModelAdapter
from .forward_io import bind_kwargs, output_sample, with_output_sample

_CFG_OFF = (
    "cfg=2 needs classifier-free guidance, but this pipeline call ran without an unconditional branch; "
    "turn guidance on (FLUX: a negative prompt with true_cfg_scale > 1, e.g. --negative-prompt '' "
    "--true-cfg-scale 4; SD3/Wan: guidance_scale > 1, e.g. --guidance 5) or use cfg=1"
)


class BatchParallel:
    """Runtime of data and CFG parallelism on one transformer."""

    def __init__(self, pipe, model: torch.nn.Module, mesh: ParallelMesh, adapter: ModelAdapter):
        self.pipe = pipe
        self.model = model
        self.adapter = adapter
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
        # per-call state
        self.context: str | None = None
        self.skip = False
        self.batch_sizes: list[int] | None = None
        self.branch: str | None = None
        # sequential CFG: the cond call's result (computed on cfg rank 0, a placeholder on cfg rank 1)
        self.pending: torch.Tensor | None = None

    # -- which branch ------------------------------------------------------------------------------
    def _branch(self) -> str:
        if self.context in ("cond", "uncond"):
            return self.context
        return "uncond" if self.pending is not None else "cond"

    def _check_guidance_on(self) -> None:
        if getattr(self.pipe, "do_classifier_free_guidance", True) is False:
            raise ConfigError(_CFG_OFF)

    # -- hooks -------------------------------------------------------------------------------------
    def pre_hook(self, kwargs: dict) -> dict:
        self.skip, self.batch_sizes, self.branch = False, None, None
        if self.cfg > 1:
            self._check_guidance_on()
        if self.sequential:
            self.branch = self._branch()
            if self.branch == "cond" and self.pending is not None:
                self.pending = None
                raise ConfigError(_CFG_OFF)
            if self.branch == "uncond" and self.pending is None:
                raise ConfigError("an unconditional transformer call came without its conditional call; "
                                  "ditmesh cfg=2 expects the pipeline to call cond then uncond each step")
            self.skip = (self.branch == "cond") != (self.cfg_rank == 0)
            if self.skip:
                return kwargs
        if self.batch_degree > 1:
            batch = kwargs["hidden_states"].shape[0]
            self.batch_sizes = split_sizes(batch, self.batch_degree)
            start = sum(self.batch_sizes[: self.batch_rank])
            size = self.batch_sizes[self.batch_rank]
            kwargs = dict(kwargs)
            for name in self.adapter.batch_inputs:
                t = kwargs.get(name)
                if isinstance(t, torch.Tensor) and t.ndim >= 1 and t.shape[0] == batch:
                    kwargs[name] = t.narrow(0, start, size)
            self.skip = size == 0
        return kwargs

    def post_hook(self, output):
        sample = output_sample(output)
        if self.batch_sizes is not None:
            sample = all_gather_uneven(sample, 0, self.batch_sizes, self.batch_group)
        if self.sequential:
            if self.branch == "cond":
                self.pending = sample  # real on cfg rank 0, a placeholder on cfg rank 1
            else:
                mine = self.pending if self.cfg_rank == 0 else sample
                both = all_gather_uneven(mine.unsqueeze(0), 0, [1, 1], self.cfg_group)
                cond, uncond = both[0], both[1]
                if self.cfg_rank == 1:
                    self.pending.copy_(cond)  # the tensor the pipeline holds as its cond prediction
                sample = uncond if self.cfg_rank == 1 else uncond.clone()
                self.pending = None
        return with_output_sample(output, sample)


def apply(pipe, model: torch.nn.Module, mesh: ParallelMesh, adapter: ModelAdapter) -> list:
    """Make ``model`` data- and/or CFG-parallel over the mesh. Returns undo callables ([] at degree 1)."""
    if mesh.size("dp") == 1 and mesh.size("cfg") == 1:
        return []
    if not adapter.batch_inputs:
        raise NotImplementedError(f"{adapter.name}: no batch plan; data/CFG parallelism is not available for it")
    bp = BatchParallel(pipe, model, mesh, adapter)
    forward = model.forward
    params = inspect.signature(forward).parameters

    def pre_hook(module, args, kwargs):
        return (), bp.pre_hook(bind_kwargs(forward, args, kwargs))

    def post_hook(module, args, kwargs, output):
        return bp.post_hook(output)

    def forward_or_skip(*args, **kwargs):
        # A skipped call does no work: it returns an uninitialized output of the right shape (filled
        # later by the CFG exchange, or discarded by the batch gather of an empty chunk).
        if not bp.skip:
            return forward(*args, **kwargs)
        placeholder = adapter.output_like(model, kwargs["hidden_states"])
        if not kwargs.get("return_dict", params["return_dict"].default if "return_dict" in params else True):
            return (placeholder,)
        from diffusers.models.modeling_outputs import Transformer2DModelOutput

        return Transformer2DModelOutput(sample=placeholder)

    original_cache_context = model.cache_context if hasattr(model, "cache_context") else None

    @contextlib.contextmanager
    def cache_context(name, *args, **kwargs):
        bp.context = name
        try:
            if original_cache_context is None:
                yield
            else:
                with original_cache_context(name, *args, **kwargs):
                    yield
        finally:
            bp.context = None

    handles = [
        # outermost: runs before the sequence split and after the sequence gather
        model.register_forward_pre_hook(pre_hook, with_kwargs=True, prepend=True),
        model.register_forward_hook(post_hook, with_kwargs=True),
    ]
    model.forward = forward_or_skip
    model.cache_context = cache_context

    def undo():
        for h in handles:
            h.remove()
        for name in ("forward", "cache_context"):
            model.__dict__.pop(name, None)

    model._ditmesh_batch = bp
    return [undo]
