"""Displaced patch parallelism (``displaced=True`` over the ulysses axis): every rank runs every block on its patch,
its attention reads the other patches' K/V from the previous step, gathered while the step computes.

```
 step t, rank j:  Q_j, K_j, V_j of its patch ──► attention(Q_j, [K/V of step t-1 from the others | K_j, V_j])
                                                  │
                                                  └─► all-gather (K_j, V_j) started ──► waited at this layer in step t+1
```

- **Patches** are sequence parallelism's token chunks: the ``sequence`` step splits every stream of the plan over the
  ulysses ranks (contiguous, uneven by at most one token) and gathers the exit, as for Ulysses; only the attention
  differs. Each rank keeps all of its heads (no all-to-all).
- **Text tokens** of joint-attention families (FLUX, SD3) are split like the image tokens: a rank's own text chunk
  is fresh, the other ranks' text K/V are one step stale like their image K/V. (PipeFusion has every text K/V fresh
  because its patch 0 carries the whole text through one pipeline; here every rank runs every block, and a whole
  text stream on every rank would add its tokens to every rank's work: 512 text tokens beside 1024 image tokens per
  rank for FLUX 1024^2 at 4 ranks.) Wan's cross-attention reads the text embeddings, which every rank holds whole.
- **K/V buffers.** Per transformer, attention layer and call of the step (a CFG branch), ``ForwardContext.
  kv_buffers`` holds the all-gather of the layer's K/V (K and V stacked, each rank's chunk padded to the longest)
  issued in the previous step, not yet waited for. A stale call waits for it (at the layer's next use, a whole step
  after the start), puts its fresh K/V in its own place, attends, and starts the gather the next step reads. The
  gather writes a fresh output tensor, so the step reading the old one never races the transfer filling the new one:
  one persistent buffer per layer and branch, and at one layer at a time two transient whole-sequence K/V (the waited
  gather and the assembled K/V the attention reads). The run's last step starts no gather.
- **Exact calls.** The first ``warmup`` steps of a run, and a transformer's first call of a run for each call of the
  step (Wan 2.2's second expert), gather the K/V synchronously and attend to this step's K/V of every rank: the
  result of one process. Their gather is the buffer of the next step. Without a scheduler every call is exact.
- **Keys in rank order.** The attention's keys are the ranks' chunks one after another (``[text_0, image_0, text_1,
  image_1, ...]``), not the model's order: attention without a mask does not depend on the order of its keys. A
  mask is refused.
- **Compile.** The buffer exchange (:meth:`Displaced.exchange`: a dict lookup, the wait, the start) runs outside the
  compiled graphs (``torch.compiler.disable``; a graph break in each attention): its collective is started in one
  step and waited in the next, across graph calls, and its buffers are host state between steps. CUDA graphs are
  refused with displaced attention.

Collectives per transformer call, per attention layer: one all-gather (``all_gather``, waited at once) in an exact
call, one started all-gather (``kv_async``, waited a step later) in a stale one, none in a stale call of the run's last
step; and the exit's gather as under sequence parallelism.

Cross-rank rule: exact or stale is decided from the step, run and call in step (the same on every rank) and from
which buffers exist (the same on every rank); every rank starts and waits the same gathers in the same layer order.
"""

from __future__ import annotations

import torch
from diffusers.models.attention_dispatch import dispatch_attention_fn

from .. import comm
from ..config import ConfigError
from ..hooks import ForwardContext
from ..models.base import ModelAdapter
from .pipefusion import LayerAttention, drop_buffers
from .sequence import SequenceParallel


class Displaced:
    """Displaced attention's state for one transformer: its sequence-parallel runtime, the warm-up, its buffers
    (in the shared ``ForwardContext.kv_buffers``, keyed ``(name, layer, call in step)``)."""

    def __init__(self, sp: SequenceParallel, ctx: ForwardContext, name: str, warmup: int):
        self.sp, self.ctx, self.name, self.warmup = sp, ctx, name, warmup

    def attend(self, layer: str, query, key, value, backend=None, streams=None, mask=None):
        """This rank's queries ``[B, S_local, H, D]`` against every rank's K/V: this step's (exact call) or, for the
        other ranks, the previous step's (stale call)."""
        if mask is not None:
            raise NotImplementedError("displaced attention does not take an attention mask; run this pipeline without "
                                      "displaced (plain ulysses)")
        sizes = self.sp.seq_sizes if streams is None else self.sp.local_lengths(streams)
        keys, values = self.exchange(layer, torch.stack([key, value]), sizes)
        return dispatch_attention_fn(query, keys, values, backend=backend)

    @torch.compiler.disable
    def exchange(self, layer: str, kv: torch.Tensor, sizes: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """(K, V) over every rank's tokens, in rank order, from this rank's ``kv`` (``[2, B, S_local, H, D]``): the
        gather of this step (exact) or the previous step's with ``kv`` in this rank's place (stale); starts the
        gather the next step reads unless this is the run's last step."""
        ctx = self.ctx
        slot = (self.name, layer, ctx.call_in_step)
        held = ctx.kv_buffers.pop(slot, None)
        exact = ctx.run_step < self.warmup or held is None or held[0] != ctx.run or held[1] != sizes
        if exact and held is not None:
            comm.wait(held[2])  # a gather of an earlier run (or of other sizes), not read: its transfer is finished
        if exact:  # this step's K/V of every rank, waited at once: the next step's buffer as it is
            raw = gathered = comm.wait(comm.all_gather_start(self.padded(kv, sizes), self.sp.group))
        else:  # the previous step's (waited a step after its start), with this rank's fresh K/V in its place
            gathered = comm.wait(held[2])
        chunks = [gathered[j].narrow(2, 0, n) for j, n in enumerate(sizes)]
        chunks[self.sp.rank] = kv
        last = ctx.run_steps is None or ctx.run_step + 1 >= ctx.run_steps
        if not last:
            if not exact:
                raw = comm.all_gather_start(self.padded(kv, sizes), self.sp.group, "kv_async")
            ctx.kv_buffers[slot] = (ctx.run, sizes, raw)
        whole = torch.cat(chunks, dim=2)
        return whole[0], whole[1]

    @staticmethod
    def padded(kv: torch.Tensor, sizes: list[int]) -> torch.Tensor:
        """``kv`` padded along its tokens to the longest chunk, with a leading dim of 1 (the gather's dim 0)."""
        longest = max(sizes)
        if kv.shape[2] < longest:
            shape = list(kv.shape)
            shape[2] = longest - kv.shape[2]
            kv = torch.cat([kv, kv.new_zeros(shape)], dim=2)
        return kv.unsqueeze(0)

    def buffer_bytes(self) -> int:
        """Bytes held between steps by this transformer's buffers (what ``plan`` predicts)."""
        return sum(raw.numel() * raw.element_size() for key, (_, _, raw) in self.ctx.kv_buffers.items()
                   if key[0] == self.name)


def check_family(adapter: ModelAdapter) -> None:
    """Raise NotImplementedError for a family displaced attention cannot run: a token grid (Sana's convolutions read
    neighbouring rows, its linear attention sums over ranks) or no self-attention through the sequence processor."""
    if adapter.sequence_plan.grid is not None:
        raise NotImplementedError(f"displaced attention does not run {adapter.name}: its token grid's convolutions and "
                                  "linear attention exchange rows and sums every call; use plain ulysses")


def apply(model: torch.nn.Module, sp: SequenceParallel | None, adapter: ModelAdapter, ctx: ForwardContext, name: str,
          warmup: int) -> list:
    """Make the sequence-parallel ``model``'s attention displaced (see the module docstring); returns undo callables.
    ``sp``: the model's sequence-parallel runtime (``ulysses`` > 1, ``ring`` = 1)."""
    if sp is None:
        raise ConfigError("displaced attention needs ulysses > 1: its patches are the ulysses ranks' token chunks; "
                          "e.g. ulysses=4 with displaced")
    check_family(adapter)
    owner = Displaced(sp, ctx, name, warmup)
    restore = adapter.set_layer_processors(model, lambda layer: LayerAttention(owner, layer))
    return [restore, lambda: drop_buffers(ctx, name)]
