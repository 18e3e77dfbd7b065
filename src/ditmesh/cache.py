"""Step caching whose decisions every rank shares: compute the first blocks, skip the rest while they barely change.

Policy ``dbcache`` (``fbcache`` is its ``first=1`` case): at every transformer call the first ``first`` blocks
run. Their residual on the main stream (the block list's first carried input, ``hidden_states`` in most families:
its value after block ``first - 1`` minus its value entering block 0) is compared with the same residual at the
previous step of the same branch: ``rel = sum|r_t - r_{t-1}| / sum|r_{t-1}|``. When ``rel < threshold`` (after
``warmup`` computed steps, and at most ``max_skips`` cached steps in a row), the middle blocks are skipped: each
returns its input, and the last of them adds the residual the middle blocks produced at the last step they ran (per
carried stream, e.g. FLUX's text and image streams). The last ``last`` blocks always run.

Cross-rank rule: the two sums are taken over this rank's part of the tensor and added, in float64, over every
rank that holds another part of the same call's batch (the sequence-parallel ranks, the data-parallel ranks, and
the cfg ranks of a family that batches CFG; tensor-parallel ranks hold the whole stream), with one all-reduce per
call; the decision reads that one scalar on the host. So every rank takes the same decision, the one a single
process takes on the same batch: one process decides once per call for all the images of its batch, so the dp
ranks, which split that batch, add their sums too (a batched-CFG family's dp split can even put the two halves of
CFG, not two prompts, on two ranks). Under sequential CFG each branch decides for itself, as it does on one
process (tests/test_cache.py).

Policy ``teacache`` (TeaCache-like) decides before the first block, from the change of block 0's modulated input
(the family's ``modulated_input``: FLUX's and SD3's ``norm1`` output, Wan's shifted and scaled ``norm1``): the
relative L1 change against the previous step of the branch (reduced over ranks like ``dbcache``'s) is rescaled by a
polynomial (``poly``, highest power first; ``ditmesh analyze`` fits it to the change of the blocks' output) and
accumulated; while the sum stays below ``threshold`` the blocks from ``first`` (default 0: all of them) are skipped,
and a computed step resets it. The first ``warmup`` steps and the run's last step are always computed.

Policies decided by the step alone take no statistic and issue no collective: ``static`` skips the middle blocks at
listed steps (``ditmesh analyze --schedule`` proposes them from measured redundancy); ``taylor`` runs them every
``interval`` steps and extrapolates their residual linearly (TaylorSeer-like, first order) in between.

Under PipeFusion (pp > 1) only ``static`` and ``taylor`` run: their decision comes from the step alone, so every
stage takes it on its own, with no message, when it reaches its first block (once per call, at the first patch).
Each stage keeps the residual of its own part of the middle blocks (from the first middle block it computes to the
last) and a skip adds it there: the stages' residuals add up to the middle's, and the activations still travel
between the stages. In a call of several patches each patch reads and writes its tokens of the residual (the
patch's run of each carried stream). ``dbcache`` and ``teacache`` are refused: their statistic covers the whole
image after the first blocks, which no stage holds while patches flow.

With ``compile``, ``api.compile_blocks`` compiles each block's own forward (the registry's ``inner``) instead of
the whole block call, so this hook stays eager and the decision is taken on the host between compiled blocks.
With CUDA graphs, static and taylor decide before the call (``plan_call``, from the ``graph`` hook) and each path
gets a whole-call graph; so nothing kept here changes on the host inside a call (residuals are written in place,
counters booked at the decision). dbcache and teacache decide inside the call: while the ``graph`` hook captures a
call, :meth:`StepCache.decide_at` records the statistic's reduced sums at a cut between graphs instead of deciding
(``ditmesh.parallel.graph.DecisionCuts``), and a replay decides from them between the graphs
(:meth:`StepCache.decide_captured`), with the same rule and the same one host read as an eager call.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .comm import all_reduce_sum
from .config import ConfigError
from .options import CacheConfig
from .hooks import Hook, add_hook, bind_kwargs, find_hook
from .redundancy import batched_cfg, change_sums

def _polyval(coefficients: tuple[float, ...], x: float) -> float:
    """The polynomial with ``coefficients`` (highest power first) at ``x``."""
    value = 0.0
    for c in coefficients:
        value = value * x + c
    return value


@dataclass
class _Branch:
    """What one branch (call within a step) keeps between steps.

    The middle blocks' residuals live in buffers written in place (``middle``, and ``earlier`` for taylor): a CUDA
    graph captured once keeps reading and writing the same memory. The counters and steps are Python state,
    updated when a decision is taken, never inside the transformer call, so a replayed graph needs nothing else.
    """

    previous: torch.Tensor | None = None  # buffer: the statistic at the previous step (residual / modulated input)
    has_previous: bool = False  # whether ``previous`` holds this run's previous step (a new run keeps the buffer)
    accumulated: float = 0.0  # teacache: rescaled change summed since the blocks last ran
    middle: dict = field(default_factory=dict)  # stream -> the middle blocks' residual when they last ran
    earlier: dict = field(default_factory=dict)  # stream -> the one before (taylor)
    computed: int = 0  # calls of this run whose middle blocks ran (or are about to)
    middle_step: int = 0  # the step of the last of them
    earlier_step: int = 0  # and of the one before
    skips_in_a_row: int = 0

    def restart(self) -> None:
        """A new pipeline run: forget the counters and the statistic; keep the buffers, which the next computed
        call overwrites before any skip reads them (captured graphs keep their addresses)."""
        self.has_previous, self.accumulated, self.computed, self.skips_in_a_row = False, 0.0, 0, 0
        self.middle_step = self.earlier_step = 0


class StepCache:
    """The cache of one transformer: hooks on its blocks, the decisions and their history."""

    def __init__(self, model: torch.nn.Module, adapter, config: CacheConfig, ctx, group, name: str = "transformer"):
        self.config, self.ctx, self.group, self.name = config, ctx, group, name
        if config.policy == "teacache" and adapter.modulated_input is None:
            raise ConfigError(f"cache teacache needs the modulated input of {type(model).__name__}'s first block, "
                              f"which the {adapter.name} adapter does not name; use dbcache, taylor or static")
        blocks = [(spec, block) for spec in adapter.blocks for block in model.get_submodule(spec.path)]
        if not blocks:
            raise ConfigError(f"step caches skip blocks, and the {adapter.name} adapter declares no block lists of "
                              f"{type(model).__name__}; run without a cache")
        if config.first + config.last >= len(blocks):
            raise ConfigError(f"cache first={config.first} + last={config.last} leaves no block of the "
                              f"{len(blocks)} of {type(model).__name__} to skip; use smaller values")
        self.blocks = blocks
        self.modulated_input = adapter.modulated_input
        self.middle = range(config.first, len(blocks) - config.last)
        #: PipeFusion's state when the model runs as pipeline stages (the cache's hooks sit inside its block hooks)
        loop = find_hook(model, "pipefusion")
        self.pf = loop.pf if loop is not None else None
        own = self.pf.own if self.pf is not None else range(len(blocks))
        #: the block where this rank takes a call's decision (its first), and the middle blocks it computes
        self.first_own = own.start
        self.here = range(max(self.middle.start, own.start), min(self.middle.stop, own.stop))
        self.branches: dict[int, _Branch] = {}
        self.entry: torch.Tensor | None = None
        self.middle_in: dict = {}
        self.skip = False
        #: the decision taken before this call (``plan_call``), or None: the hooks decide
        self.planned: bool | None = None
        #: taylor: how far ahead of the last computed step a skipped call extrapolates, in units of the last span;
        #: also written into ``factor_t`` (a 0-dim float32 tensor on the residuals' device) before the call, which the
        #: replay reads, so that one captured skip path serves every factor
        self.factor = 0.0
        self.factor_t: torch.Tensor | None = None
        self.last_run: int | None = None
        #: one entry per decision: step, branch, relative change (None at warm-up), skipped
        self.history: list[dict] = []
        #: set while a CUDA graph of a call is captured in segments (``ditmesh.parallel.graph.DecisionCuts``)
        self.cuts = None
        #: also record this rank's own (unreduced) relative change, for tests: a second host read per step
        self.record_local = False
        self.undo = []
        for index, (spec, block) in enumerate(blocks):
            self.undo.append(add_hook(block, _BlockHook(self, index, spec, block.forward)))

    # -- per block -----------------------------------------------------------------------------------------
    def branch(self) -> _Branch:
        if self.ctx.run != self.last_run:
            for state in self.branches.values():  # a new pipeline run starts from nothing
                state.restart()
            self.last_run = self.ctx.run
        return self.branches.setdefault(self.ctx.call_in_step, _Branch())

    @property
    def known_in_advance(self) -> bool:
        """Whether the policy decides from the step alone, before the call (static, taylor)."""
        return self.config.policy in ("static", "taylor")

    def plan_call(self):
        """Take this call's decision before the call (static and taylor only) and return the path it takes, for a
        graph key: ``(skip, extrapolates)``. The call's hooks then use this decision."""
        self.planned = self.decide(None)
        return (self.planned, bool(self.factor))

    def end_call(self) -> None:
        self.planned = None

    def decide(self, statistic: torch.Tensor) -> bool:
        """Whether this call skips the middle blocks; identical on every rank of the computation. ``statistic`` is
        the first blocks' residual (dbcache) or block 0's modulated input (teacache); static and taylor ignore it."""
        state, config = self.branch(), self.config
        step = self.ctx.run_step  # counted from the run's first step (an img2img run starts part-way)
        self.factor = 0.0
        if self.known_in_advance:  # decided by the step alone: no statistic, no collective
            if config.policy == "static":
                skip = step in config.skip and state.computed >= 1
            else:
                skip = (step >= config.warmup and (step - config.warmup) % config.interval != 0
                        and state.computed >= 2)
                if skip:  # first order: r + (t - t1) * (r1 - r0) / (t1 - t0)
                    self.factor = (step - state.middle_step) / max(1, state.middle_step - state.earlier_step)
                    kept = next(iter(state.middle.values()), None)  # none on a pp stage without middle blocks
                    if kept is not None:
                        if self.factor_t is None or self.factor_t.device != kept.device:
                            self.factor_t = torch.zeros((), dtype=torch.float32, device=kept.device)
                        self.factor_t.fill_(self.factor)  # outside any capture: plan_call runs before the call
            self.history.append({"step": step, "branch": self.ctx.call_in_step, "rel": None, "skip": skip})
            return self._decided(state, skip, step)
        return self._decide_rel(state, step, self._rel(state, self._change(state, statistic)))

    def decide_at(self, statistic: torch.Tensor) -> bool:
        """The decision of a dynamic policy inside the call: :meth:`decide`, or, while a CUDA graph of the call is
        captured (``cuts`` set by ``ditmesh.parallel.graph``), the statistic's reduced sums recorded at a cut between
        graphs and the computing path taken; a replay then decides between its graphs (:meth:`decide_captured`)."""
        if self.cuts is None:
            return self.decide(statistic)
        self.cuts.cut(self._change(self.branch(), statistic, always=True))
        return False

    def decide_captured(self, sums: torch.Tensor) -> bool:
        """The decision of a replayed call from the sums its first graph wrote (the one host read of the step)."""
        state = self.branch()
        return self._decide_rel(state, self.ctx.run_step, self._rel(state, sums))

    def _change(self, state: _Branch, statistic: torch.Tensor, always: bool = False) -> torch.Tensor | None:
        """``[sum |change|, sum |previous|]`` of the statistic against the branch's previous step, added over the
        ranks that share the computation, and the statistic kept (in place) for the next step. None when there is
        no previous step of this run and ``always`` is off (a captured graph computes the sums whatever the run)."""
        previous = state.previous
        if previous is None or previous.shape != statistic.shape or previous.dtype != statistic.dtype:
            if self.cuts is not None:
                raise RuntimeError("the step cache has no statistic buffer of this call's shape to capture")
            state.previous, state.has_previous = statistic.detach().clone(), False
            return None
        sums = None
        if state.has_previous or always:
            sums = change_sums(statistic, previous)
            if self.record_local and self.cuts is None:
                local_diff, local_base = sums.tolist()
                self.history_local = local_diff / local_base if local_base else 0.0
            if self.group is not None:
                sums = all_reduce_sum(sums, self.group)
        previous.copy_(statistic)  # in place: a captured graph reads and writes this memory
        return sums

    @staticmethod
    def _rel(state: _Branch, sums: torch.Tensor | None) -> float | None:
        rel = None
        if sums is not None and state.has_previous:
            diff, base = sums.tolist()  # the one host read of the step
            rel = diff / base if base else 0.0
        state.has_previous = True
        return rel

    def _decide_rel(self, state: _Branch, step: int, rel: float | None) -> bool:
        config = self.config
        allowed = (rel is not None and step >= config.warmup and state.computed >= 1
                   and state.skips_in_a_row < config.max_skips)
        if config.policy == "teacache":
            steps = self.ctx.run_steps
            allowed = allowed and (steps is None or step < steps - 1)  # the last step always runs
            # a change is never negative: a fitted polynomial that dips below zero counts as no change
            state.accumulated = state.accumulated + max(0.0, _polyval(config.poly, rel)) if allowed else 0.0
            skip = allowed and state.accumulated < config.threshold
            if not skip:
                state.accumulated = 0.0
        else:
            skip = allowed and rel < config.threshold
        entry = {"step": step, "branch": self.ctx.call_in_step, "rel": rel, "skip": skip}
        if self.record_local and rel is not None:
            entry["local_rel"] = self.history_local
        self.history.append(entry)
        return self._decided(state, skip, step)

    @staticmethod
    def _decided(state: _Branch, skip: bool, step: int) -> bool:
        """Book a decision: a computed call's middle residual becomes the last one (its buffers are written by the
        call itself)."""
        state.skips_in_a_row = state.skips_in_a_row + 1 if skip else 0
        if not skip:
            state.computed += 1
            state.earlier_step, state.middle_step = state.middle_step, step
        return skip

    def patch_slice(self, spec, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor`` (a kept residual of carried ``name``) narrowed to the current PipeFusion patch's tokens; the
        whole of it outside a call of several patches."""
        pf, patch = self.pf, self.ctx.patch
        if pf is None or patch is None or patch[1] == 1:
            return tensor
        if pf.sp is not None:
            raise ConfigError("a step cache under PipeFusion with sequence parallelism runs only while every step is "
                              "exact (--pp-warmup covering all steps): a stale step's patches are split over the "
                              "sequence-parallel ranks differently from the whole sequence; raise --pp-warmup, or "
                              "drop ulysses/ring or the cache")
        offset, length = pf.patch_range(dict(zip(spec.carries, spec.streams))[name])
        return tensor.narrow(1, offset, length)

    def remove(self) -> None:
        for undo in self.undo:
            undo()
        self.undo.clear()


class _BlockHook(Hook):
    """A block's ``cache`` hook: record the entry, decide after the first blocks, skip or replay the middle."""

    name = "cache"

    def __init__(self, cache: StepCache, index: int, spec, forward):
        self.cache, self.index, self.spec, self.forward = cache, index, spec, forward

    def __call__(self, owner, call_next, args, kwargs):
        cache, index, config = self.cache, self.index, self.cache.config
        named = bind_kwargs(self.forward, args, kwargs)
        patch = cache.ctx.patch
        if index == cache.first_own and (patch is None or patch[0] == 0):  # once per call, at its first patch
            cache.entry = named[self.spec.carries[0]]  # the main stream (ERNIE-Image's ``x``, Kandinsky 5's ``visual_embed``)
            if cache.planned is not None:  # taken before the call (a graph replays this path)
                cache.skip = cache.planned
            elif cache.known_in_advance:
                cache.skip = cache.decide(None)
            else:
                cache.skip = config.policy == "teacache" and cache.decide_at(cache.modulated_input(owner, named))
        middle, here = cache.middle, cache.here
        if index in here:
            if index == here.start:
                cache.middle_in = {name: named[name] for name in self.spec.carries if named.get(name) is not None}
            if cache.skip:
                return self._replay(named, index == here.stop - 1)
        output = call_next((), named)
        if cache.cuts is not None and index == middle.start < middle.stop - 1:
            cache.cuts.cut_inside()
        if index == config.first - 1 and config.policy == "dbcache":
            hidden = self._stream(output, self.spec.carries[0])
            cache.skip = cache.decide_at(hidden - cache.entry)
        if index == here.stop - 1 and not cache.skip:
            state = cache.branch()
            taylor = config.policy == "taylor"
            for name, before in self._entering(cache.middle_in).items():
                out = self._stream(output, name)
                if out is None:
                    continue
                residual = (out - before).detach()
                kept = state.middle.get(name)
                if kept is not None and kept.dtype == residual.dtype and kept.shape != residual.shape:
                    kept = cache.patch_slice(self.spec, name, kept)  # a patch of the residual kept whole
                if kept is None or kept.shape != residual.shape or kept.dtype != residual.dtype:
                    state.middle[name] = residual.clone()
                    if taylor:
                        state.earlier[name] = residual.clone()
                    continue
                if taylor:
                    cache.patch_slice(self.spec, name, state.earlier[name]).copy_(kept)
                kept.copy_(residual)  # in place: a captured graph reads and writes this memory
            if cache.cuts is not None:  # the middle blocks' graph ends here; a skip writes these outputs instead
                cache.cuts.cut_middle({name: (before, state.middle[name], self._stream(output, name))
                                       for name, before in cache.middle_in.items() if name in state.middle},
                                      self.spec.returns)
        if index == here.stop - 1:
            cache.middle_in, cache.entry = {}, None  # nothing of this call is kept beyond the cached residuals
        return output

    def _entering(self, middle_in: dict) -> dict:
        """The middle's inputs as this block's list carries them: where the list joins streams the middle began with
        (it started in the double blocks, this is a single block), their concatenation along the tokens."""
        joins = self.spec.joins
        if not joins or not all(name in middle_in for name in joins):
            return middle_in
        return {self.spec.carries[0]: torch.cat([middle_in[name] for name in joins], dim=1)}

    def _stream(self, output, name: str):
        outputs = output if isinstance(output, tuple) else (output,)
        return outputs[self.spec.returns.index(name)] if name in self.spec.returns else None

    def _replay(self, named: dict, last: bool):
        """A skipped block returns its inputs; the last skipped one adds the middle blocks' cached residual."""
        state = self.cache.branch()
        factor = self.cache.factor_t if self.cache.factor else None  # taylor: set with the decision
        outputs = []
        for name in self.spec.returns:
            value = named.get(name)
            if last and value is not None and name in state.middle:
                residual = self.cache.patch_slice(self.spec, name, state.middle[name])
                if factor is not None:
                    earlier = self.cache.patch_slice(self.spec, name, state.earlier[name])
                    residual = residual + (residual - earlier) * factor
                value = value + residual
            outputs.append(value)
        return tuple(outputs) if len(outputs) > 1 else outputs[0]


def apply(runtime, config: CacheConfig) -> list:
    """Put a :class:`StepCache` on every transformer of ``runtime``; returns undo callables ([] when off)."""
    from .models import adapter_for

    if not config.on:
        return []
    mesh = runtime.mesh
    axes = ("ring", "ulysses", "dp") + (("cfg",) if batched_cfg(runtime) else ())  # the ranks of one call's batch
    group = mesh.group_of(*axes) if any(mesh.size(a) > 1 for a in axes) else None
    undo = []
    runtime.caches = {}
    runtime.context.needs_full_batches = True

    def release():
        runtime.context.needs_full_batches = False

    undo.append(release)
    for name, model in runtime.transformers.items():
        cache = StepCache(model, adapter_for(model), config, runtime.context, group, name)
        runtime.caches[name] = cache
        undo.append(cache.remove)
    return undo
