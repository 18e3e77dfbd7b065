"""Hooks around a method (a transformer's ``forward``, a pipeline's ``encode_prompt``), in one explicit order,
and the per-call context every parallel dimension reads.

Why not torch's own forward hooks for everything: a data- or CFG-parallel rank must *skip* a transformer
call, and a pre-hook cannot skip the forward. Why not diffusers' ``HookRegistry``: its order is the order of
registration, and the branch of a CFG call reaches its hooks only through stateful cache internals that
change between diffusers versions. Ours is small: a :class:`Hook` wraps the rest of the chain
(``call_next``), hooks run in the order of :data:`ORDER` whatever order they were added in, and the method
is wrapped once per object, through one instance attribute that :meth:`HookRegistry.remove` deletes when
the last hook goes. The registry hangs on that wrapper function (ours), not on the user's object, and lives
exactly as long as the object: no global table keeps a model alive.

Per-call state lives in one :class:`ForwardContext` per parallelized pipeline, shared by all its
transformers and all dimensions: the step index (the scheduler's position in its timesteps), the CFG branch
of the call, whether this rank skips it, and the token counts of each sequence stream.

What is wrapped. A transformer's ``forward``; under tensor parallelism with the broadcast text path, a
pipeline's ``encode_prompt``; for LoRA loading, a transformer's ``load_lora_adapter`` and, under tensor
parallelism, a pipeline's ``lora_state_dict`` (a classmethod bound as the class binds it). Split points inside
the model (SD3's ``pos_embed`` output, Wan's ``rope`` output and ``blocks.0`` input) and the gather at
``proj_out`` are plain torch ``register_forward_(pre_)hook`` handles. The runtime of ``parallelize`` hangs on
the ``context`` hook, so it too lives exactly as long as the model (a parallelized pipeline is freed with its
last reference; tested).

Counting steps and runs. The ``context`` hook opens each call: the step index is the scheduler's position in
its timesteps (``scheduler.step_index``, or ``begin_index`` before the first step), and ``call_in_step`` counts
the calls of that step, so sequential CFG's two calls (and a second transformer) share the step's index. A
pipeline whose scheduler keeps no index (CogVideoX's DDIM and DPM schedulers have no ``step_index``) or that
steps copies of its scheduler and never its own (SkyReels-V2's diffusion forcing keeps one per latent frame, so
``scheduler.step_index`` stays None) is counted by its loop instead: a new step where the pipeline sets its
``_current_timestep`` anew, which every diffusers denoising loop does once per iteration (a new tensor object
each step; no host sync). A new pipeline run is recognised by a new timesteps tensor on the scheduler (each run
sets it anew), and everything kept between steps (a pending CFG result, step-cache state, the probe's previous
tensors) starts afresh with it. The batch dimension writes the call's CFG branch and whether this rank skips
it; the sequence dimension writes each stream's chunk sizes; PipeFusion writes the patch it computes and keeps
its K/V buffers there. Nothing travels through private attributes on the user's model.

``remove()`` gives the pipeline back. Undo callables run in reverse: hooks and processors removed, swapped
modules put back, tensor-parallel shards all-gathered (packed parts reordered, head counts restored), fused
projections given their own storage again, compiled blocks uncompiled, text encoders that the broadcast path
kept on the CPU put back on their device, the blocks PipeFusion emptied broadcast back from their stages.
``tests/test_family_home.py`` parallelizes (tp 2 x ulysses 2 with fused Q/K/V, ring 2, cfg 2; SD3 and Wan 2.2
under tp 2; FLUX and Wan 2.2 under pp 2), removes, and checks that every component's state dict, every module's
attributes and processors, and the outputs equal a pipeline that was never parallelized. A transformer loaded
as a shard (``load_sharded_transformer``) never held its whole weights; ``remove()`` takes its collectives off
and raises an error that says so.
"""

from __future__ import annotations

import functools
import inspect
import weakref
from dataclasses import dataclass, field

#: Hook names, outermost first. A hook's place in the chain comes from this list, never from when it was
#: added. ``timeline`` times a phase of a call: the run's timeline of ``generate`` (``ditmesh.runtime.trace``) or a
#: served request's phases (``ditmesh.serve.phases``); ``context`` opens the per-call state; ``graph`` replays
#: everything inside it from a CUDA graph; ``consistency`` sees the full, replicated inputs; ``batch`` (dp/cfg)
#: splits or skips the call before ``pipefusion`` runs a transformer call as patches through the pipeline stages (on
#: a block: skips the blocks of other stages and passes activations between stages; ``ditmesh.parallel.pipefusion``),
#: then ``sequence`` splits each patch's tokens over the sequence-parallel ranks; ``prompt_cache`` answers a
#: pipeline's ``encode_prompt`` of a prompt it encoded before (``ditmesh.serve.phases``); ``encode_once`` wraps a
#: pipeline's ``encode_prompt``; ``cache`` wraps a transformer block (step caching, ``ditmesh.cache``); ``vae`` wraps
#: a VAE's decode/encode and its layers (``ditmesh.parallel.vae``); ``vae_chunk`` runs a VAE's residual blocks and
#: up-samplers on pieces of rows (``ditmesh.parallel.vae_chunk``); ``lora`` wraps the LoRA loading of a pipeline
#: (``lora_state_dict``) and of a transformer (``load_lora_adapter``), ``ditmesh.parallel.lora``; ``chunk`` runs a
#: feed-forward on pieces of the sequence (``ditmesh.parallel.chunk``); ``pictures`` makes an image processor's PIL
#: pictures from 8-bit pixels rounded on the device (``ditmesh.serve.phases``).
ORDER = ("timeline", "context", "graph", "consistency", "batch", "pipefusion", "sequence", "prompt_cache", "encode_once",
         "cache", "vae", "vae_chunk", "lora", "chunk", "pictures")


class Hook:
    """One named behaviour around a method call. Subclasses set :attr:`name` (one of :data:`ORDER`)."""

    name: str = ""

    def __call__(self, owner, call_next, args: tuple, kwargs: dict):
        """Run around the rest of the chain: ``call_next(args, kwargs)`` runs the inner hooks and the method."""
        return call_next(args, kwargs)


class HookRegistry:
    """The hooks around one method of one object (``forward`` of a module by default)."""

    def __init__(self, owner, method: str):
        self.owner_ref = weakref.ref(owner)
        self.method = method
        self.hooks: dict[str, Hook] = {}
        #: whether ``method`` was already an instance attribute (then it is put back rather than deleted)
        self.had_instance_attr = method in vars(owner)
        # The class's function (or classmethod), not a bound method: the registry must not hold its owner alive
        # (the weak map keeps registries by owner).
        self._func = vars(owner)[method] if self.had_instance_attr else inspect.getattr_static(type(owner), method)
        self.wrapper = None
        #: what the innermost hook calls instead of the method, when set (a compiled version of it: the hooks
        #: around it stay eager, so they can take decisions on the host)
        self.inner = None

    def original(self, owner):
        """``owner.method`` as it was before any hook, bound to ``owner``."""
        return self._func if self.had_instance_attr else self._func.__get__(owner, type(owner))

    # -- adding and removing -----------------------------------------------------------------------
    def add(self, hook: Hook) -> None:
        """Add ``hook`` at its place in :data:`ORDER`; the first hook wraps the method."""
        if hook.name not in ORDER:
            raise ValueError(f"hook name {hook.name!r} has no place in the order; known: {', '.join(ORDER)}")
        if hook.name in self.hooks:
            raise ValueError(f"a hook named {hook.name!r} is already on {type(self.owner_ref()).__name__}.{self.method}")
        self.hooks[hook.name] = hook
        if len(self.hooks) == 1:
            owner = self.owner_ref()

            def call(*args, **kwargs):
                return self._call(*args, **kwargs)

            wrapper = functools.wraps(self.original(owner))(call)
            setattr(wrapper, _REGISTRY_ATTR, self)
            self.wrapper = wrapper
            setattr(owner, self.method, wrapper)

    def remove(self, name: str) -> None:
        """Remove the hook ``name``; with the last one, the method is exactly what it was before."""
        del self.hooks[name]
        if not self.hooks:
            owner = self.owner_ref()
            if owner is not None and vars(owner).get(self.method) is self.wrapper:  # someone else's wrapper stays
                if self.had_instance_attr:
                    setattr(owner, self.method, self._func)
                else:
                    delattr(owner, self.method)

    def get(self, name: str) -> Hook | None:
        """The hook called ``name``, or None."""
        return self.hooks.get(name)

    # -- running -----------------------------------------------------------------------------------
    def chain(self) -> list[Hook]:
        """The hooks, outermost first."""
        return [self.hooks[n] for n in ORDER if n in self.hooks]

    def _call(self, *args, **kwargs):
        chain = self.chain()
        owner = self.owner_ref()
        original = self.inner or self.original(owner)

        def run(i: int, args: tuple, kwargs: dict):
            if i == len(chain):
                return original(*args, **kwargs)
            return chain[i](owner, lambda a, k: run(i + 1, a, k), args, kwargs)

        return run(0, args, kwargs)


#: the attribute of our wrapper function that holds its registry
_REGISTRY_ATTR = "ditmesh_hooks"


def _installed(owner, method: str) -> HookRegistry | None:
    fn = vars(owner).get(method)
    reg = getattr(fn, _REGISTRY_ATTR, None)
    # only our own wrapper counts (a wrapper copying our attributes, e.g. functools.update_wrapper, does not)
    return reg if reg is not None and getattr(reg, "wrapper", None) is fn else None


def registry(owner, method: str = "forward") -> HookRegistry:
    """The hook registry of ``owner.method`` (a new, empty one when no hook is installed yet)."""
    return _installed(owner, method) or HookRegistry(owner, method)


def add_hook(owner, hook: Hook, method: str = "forward"):
    """Add ``hook`` around ``owner.method``; returns the callable that removes it."""
    reg = registry(owner, method)
    reg.add(hook)
    return functools.partial(reg.remove, hook.name)


def find_hook(owner, name: str, method: str = "forward") -> Hook | None:
    """The hook ``name`` around ``owner.method``, or None."""
    reg = _installed(owner, method)
    return reg.get(name) if reg is not None else None


# -- what every hook on a transformer needs: named inputs, and the output's sample tensor -----------------------
# Pipelines call transformers with keyword arguments and ``return_dict=False`` (a tuple) or ``True`` (an output
# object with ``.sample``); these let hooks treat both the same way.
def bind_kwargs(forward, args: tuple, kwargs: dict) -> dict:
    """All call inputs by name (positional ``args`` bound to ``forward``'s parameter names)."""
    if not args:
        return kwargs
    return dict(inspect.signature(forward).bind_partial(*args, **kwargs).arguments)


def output_sample(output):
    """The sample tensor of a transformer output (tuple or ``.sample`` object)."""
    return output[0] if isinstance(output, tuple) else output.sample


def with_output_sample(output, sample):
    """``output`` with its sample tensor replaced by ``sample`` (same container kind)."""
    if isinstance(output, tuple):
        return (sample,) + tuple(output[1:])
    output.sample = sample
    return output


# -- the per-call context --------------------------------------------------------------------------------------
@dataclass
class ForwardContext:
    """Per-call state of one parallelized pipeline, shared by its transformers and every dimension.

    The ``context`` hook (outermost on every transformer) fills ``step_index`` and ``call_in_step`` at the
    start of each call and clears the rest. Cross-rank rule: everything here derives from values every rank
    holds alike (the scheduler's position, the call order, global shapes), so every rank agrees unasked.
    """

    #: the scheduler's position in its timesteps at this call (None without a scheduler, e.g. a bare model)
    step_index: int | None = None
    #: transformer calls so far at this step (0 for the first; sequential CFG makes a second)
    call_in_step: int = 0
    #: total transformer calls since parallelize (for messages)
    calls: int = 0
    #: the CFG branch of this call ("cond" / "uncond"), set by the batch dimension under sequential CFG
    branch: str | None = None
    #: this rank does not compute this call (its CFG branch or batch chunk is another rank's)
    skip: bool = False
    #: tokens of each sequence stream on each sequence-parallel rank, fixed at the first split of the stream
    stream_sizes: dict[str, list[int]] = field(default_factory=dict)
    #: pipeline calls seen (a new one starts when the scheduler's timesteps are set anew); state kept between
    #: steps (CFG pending, caches) belongs to one run
    run: int = 0
    #: a dimension needs every rank of a batch group to compute every call (step caching, the redundancy probe)
    needs_full_batches: bool = False
    #: the scheduler's timesteps of the current run (a new tensor object marks a new run)
    timesteps: object = field(default=None, repr=False)
    #: the step index of the run's first call: 0, or where an image-to-image run starts part-way (its strength)
    first_step: int = 0
    #: a pipeline that steps copies of its scheduler (SkyReels-V2's diffusion forcing, one per latent frame): the
    #: loop's ``_current_timestep`` of the last call and the iterations counted from it (:class:`ContextHook`)
    loop_timestep: object = field(default=None, repr=False)
    loop_step: int = 0
    #: PipeFusion: (index, count) of the patch the transformer computes now; (0, 1) in an exact (warm-up) call
    patch: tuple[int, int] | None = None
    #: PipeFusion's K/V buffers, one per (transformer, attention layer, call in step): K and V over the whole
    #: sequence, written patch by patch; kept between steps (a patch reads the others' K/V from the last step).
    #: Displaced attention keeps its pending K/V gathers here under the same keys (under CUDA graphs: its buffers at
    #: fixed addresses, keyed by step parity and chunk sizes too; ``parallel.displaced``)
    kv_buffers: dict = field(default_factory=dict, repr=False)

    @property
    def run_step(self) -> int:
        """The step's place in this run, counted from its first step as diffusers' step callbacks count it (a run
        that starts part-way has step_index ``first_step`` at its step 0): what step caching counts in."""
        return (self.step_index or 0) - self.first_step

    @property
    def run_steps(self) -> int | None:
        """Steps this run computes (the scheduler's timesteps from ``first_step`` on), or None without a scheduler."""
        return None if self.timesteps is None else len(self.timesteps) - self.first_step

    def begin_call(self, step_index: int | None, new_run: bool = False) -> None:
        """Start a transformer call at ``step_index`` (``new_run``: the first call of a new pipeline run)."""
        if new_run:
            self.run += 1
            self.step_index, self.call_in_step = None, 0
        same_step = step_index is not None and step_index == self.step_index and self.calls > 0 and not new_run
        self.call_in_step = self.call_in_step + 1 if same_step else 0
        self.step_index = step_index
        if new_run:
            self.first_step = step_index or 0
        self.calls += 1
        self.branch, self.skip = None, False
        self.stream_sizes = {}


def scheduler_step_index(scheduler) -> int | None:
    """The scheduler's position in its timesteps: the index of the step being computed, or None if unknown.

    diffusers' schedulers hold ``step_index`` (None until their first ``step()`` of a run, then the index of
    the next step) and ``begin_index`` (set by image-to-image pipelines that start part-way).
    """
    if scheduler is None or not hasattr(scheduler, "step_index"):
        return None
    index = scheduler.step_index
    if index is None:
        index = getattr(scheduler, "begin_index", None) or 0
    return int(index)


class ContextHook(Hook):
    """Outermost hook of every transformer: opens the per-call :class:`ForwardContext`.

    It also holds what owns the context (the ``runtime`` of ``ditmesh.parallelize``), so that a model's own
    hooks lead to its runtime and nothing else needs to.
    """

    name = "context"

    def __init__(self, ctx: ForwardContext, pipe=None, runtime=None):
        self.ctx = ctx
        self.runtime = runtime
        self.pipe_ref = weakref.ref(pipe) if pipe is not None else (lambda: None)

    def __call__(self, owner, call_next, args, kwargs):
        scheduler = getattr(self.pipe_ref(), "scheduler", None)
        # a pipeline run sets the scheduler's timesteps anew: a new tensor object marks a new run
        timesteps = getattr(scheduler, "timesteps", None)
        new_run = timesteps is not None and timesteps is not self.ctx.timesteps
        if new_run:
            self.ctx.timesteps = timesteps
        self.ctx.begin_call(self.step_index(scheduler, new_run), new_run)
        return call_next(args, kwargs)

    def step_index(self, scheduler, new_run: bool) -> int | None:
        """The step of this call: the scheduler's position; for a pipeline whose scheduler keeps none (CogVideoX's
        DDIM and DPM schedulers have no ``step_index``) or that never steps its own scheduler (its index stays None,
        no ``begin_index``) but steps copies of it (SkyReels-V2's diffusion forcing: one scheduler per latent
        frame), the iterations of its loop, counted where the pipeline sets its ``_current_timestep`` anew (every
        diffusers denoising loop does, once per iteration, before its transformer calls: a new tensor object each
        step, the same for every call within a step; the last one is held, so a new step's object cannot reuse
        its id). No host sync."""
        index = scheduler_step_index(scheduler)
        current = getattr(self.pipe_ref(), "_current_timestep", None)
        stepped = (getattr(scheduler, "step_index", None) is not None
                   or getattr(scheduler, "begin_index", None) is not None)
        if scheduler is None or current is None or stepped:
            return index
        ctx = self.ctx
        if new_run or ctx.loop_timestep is None:
            ctx.loop_step = 0
        elif current is not ctx.loop_timestep:
            ctx.loop_step += 1
        ctx.loop_timestep = current
        return ctx.loop_step
