"""How much each block's work changes from one denoising step to the next, measured exactly across ranks.

A :class:`RedundancyProbe` watches every repeated block of every transformer of a parallelized pipeline (the
adapter's block lists), every attention layer, and the key and value projections of each attention layer. At
every transformer call it records, per watched module, two sums against the same module's tensor at the
previous step of the same branch (the context's ``call_in_step``: cond and uncond are compared with
themselves): ``sum |x_t - x_{t-1}|`` and ``sum |x_{t-1}|``. Their ratio is the relative L1 change that step
caches decide on. For a block the probe measures its output and its residual (output minus input); for the first
block of a family that names one (``modulated_input``), also its modulated input, which the TeaCache-like cache
decides on.

Cross-rank rule, so that a parallel run records exactly what one process records: each rank sums over the part
of a tensor it holds, and the sums are added over the ranks that hold the other parts of the same call's
tensor: the sequence-parallel ranks (tokens), the batch ranks (dp, and cfg for a family that batches CFG) and,
for tensors split by heads (the key and value projections, and attention outputs taken before the output
projection), the tensor-parallel ranks (block outputs are whole on every tp rank).
The sums are kept on the device and added in float64 with one all-reduce per call; under sequential CFG the two
branches are computed by different cfg ranks and :meth:`RedundancyProbe.records` gathers them. Every rank of
a group must compute every call: with dp, each dp rank needs at least one image of the batch.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .comm import all_gather_object, all_reduce_sum

#: what the probe measures per watched module
QUANTITIES = ("output", "residual", "attention", "key", "value", "modulated")


def change_sums(current: torch.Tensor, previous: torch.Tensor) -> torch.Tensor:
    """``[sum |current - previous|, sum |previous|]`` in float64 over this rank's part: the two sums whose ratio is
    the relative L1 change, added over ranks before it is taken (the probe and the step caches)."""
    return torch.stack([(current - previous).abs().sum(), previous.abs().sum()]).double()


def batched_cfg(runtime) -> bool:
    """Whether a family of the pipeline runs CFG as one batched call ([uncond, cond]): its cfg ranks then hold
    halves of the same call's batch."""
    from .models import adapter_for

    return any(adapter_for(m).cfg_mode == "batched" for m in runtime.transformers.values())


@dataclass
class _Watch:
    """One watched tensor stream: where it comes from and its previous-step value per branch."""

    component: str
    name: str
    quantity: str
    previous: dict = field(default_factory=dict)  # call_in_step -> tensor of the previous step


class RedundancyProbe:
    """Records step-to-step relative L1 change of blocks, attention outputs and K/V (see the module docstring)."""

    def __init__(self, runtime):
        from .models import adapter_for

        self.runtime = runtime
        self.ctx = runtime.context
        mesh = runtime.mesh
        batched = batched_cfg(runtime)
        batch_axes = ("dp", "cfg") if batched else ("dp",)
        token_axes = batch_axes + ("ring", "ulysses")
        self.token_group = mesh.group_of(*token_axes) if any(mesh.size(a) > 1 for a in token_axes) else None
        head_axes = token_axes + ("tp",)
        self.head_group = mesh.group_of(*head_axes) if any(mesh.size(a) > 1 for a in head_axes) else None
        self.cfg_group = mesh.group("cfg") if mesh.size("cfg") > 1 and not batched else None
        self.watches: list[_Watch] = []
        self.handles = []
        self.tp = mesh.size("tp")
        self._pending: list[tuple[int, torch.Tensor, bool]] = []  # (watch, [2] local sums, split by heads) this call
        self._run = self.ctx.run  # the pipeline run the kept tensors belong to
        self._local: dict = {}  # (component, step, call_in_step) -> [(watch index, [2] sums)]
        for component, model in runtime.transformers.items():
            adapter = adapter_for(model)
            for spec in adapter.blocks:
                for i, block in enumerate(model.get_submodule(spec.path)):
                    name = f"{spec.path}.{i}"
                    out_w = self._watch(component, name, "output")
                    res_w = self._watch(component, name, "residual")
                    self.handles.append(block.register_forward_hook(self._block_hook(spec, out_w, res_w),
                                                                    with_kwargs=True))
            if adapter.modulated_input is not None:
                first_spec = adapter.blocks[0]
                first_block = model.get_submodule(first_spec.path)[0]
                w = self._watch(component, f"{first_spec.path}.0", "modulated")
                self.handles.append(first_block.register_forward_pre_hook(
                    self._modulated_hook(adapter.modulated_input, w), with_kwargs=True))
            for name, attn in adapter.attention_modules(model):
                # an attention output as wide as all heads is split by heads under tp (some processors return it
                # before the output projection: FLUX's single blocks); one as wide as the model is whole
                head_dim = getattr(attn, "head_dim", None) or attn.inner_dim // attn.heads
                split_width = adapter.num_heads(model) * head_dim // self.tp if self.tp > 1 else None
                w = self._watch(component, name, "attention")
                self.handles.append(attn.register_forward_hook(self._tensor_hook(w, split_width)))
                for proj, quantity in (("to_k", "key"), ("to_v", "value")):
                    linear = getattr(attn, proj, None)
                    if isinstance(linear, torch.nn.Module):  # column-parallel under tp: always split by heads
                        w = self._watch(component, f"{name}.{proj}", quantity)
                        self.handles.append(linear.register_forward_hook(self._tensor_hook(w, split_width, True)))
        for model in runtime.transformers.values():
            self.handles.append(model.register_forward_hook(self._call_done))
        self.ctx.needs_full_batches = True

    def _watch(self, component: str, name: str, quantity: str) -> int:
        self.watches.append(_Watch(component, name, quantity))
        return len(self.watches) - 1

    # -- hooks -----------------------------------------------------------------------------------------------
    def _record(self, index: int, tensor: torch.Tensor, heads_split: bool = False) -> None:
        watch = self.watches[index]
        if self._run != self.ctx.run:  # a new pipeline run: nothing to compare with
            for w in self.watches:
                w.previous.clear()
        self._run = self.ctx.run
        key = self.ctx.call_in_step
        current = tensor.detach().float()
        before = watch.previous.get(key)
        if before is not None and before.shape == current.shape:
            self._pending.append((index, change_sums(current, before), heads_split))
        watch.previous[key] = current

    def _block_hook(self, spec, out_index: int, res_index: int):
        def hook(module, args, kwargs, output):
            from .hooks import bind_kwargs

            outputs = output if isinstance(output, tuple) else (output,)
            # the block's main stream: its list's first carried input (hidden_states; ERNIE-Image's x)
            main = spec.carries[0]
            position = spec.returns.index(main) if main in spec.returns else 0
            out = outputs[position]
            inp = bind_kwargs(module.forward, args, kwargs).get(main)
            self._record(out_index, out)
            if isinstance(inp, torch.Tensor) and inp.shape == out.shape:
                self._record(res_index, out - inp)

        return hook

    def _modulated_hook(self, modulated_input, index: int):
        def hook(module, args, kwargs):
            from .hooks import bind_kwargs

            self._record(index, modulated_input(module, bind_kwargs(module.forward, args, kwargs)))

        return hook

    def _tensor_hook(self, index: int, split_width: int | None, always_split: bool = False):
        def hook(module, args, output):
            tensors = output if isinstance(output, tuple) else (output,)
            first = next((t for t in tensors if isinstance(t, torch.Tensor)), None)
            if first is not None:
                split = split_width is not None and (always_split or first.shape[-1] == split_width)
                self._record(index, first, split)

        return hook

    def _call_done(self, module, args, output) -> None:
        """At the end of a transformer call: add this call's sums over the ranks that share it (one all-reduce
        per group, float64) and keep them under the call's (component, step, call in step)."""
        if not self._pending:
            return
        pending, self._pending = self._pending, []
        sums = torch.stack([s for _, s, _ in pending])  # [n, 2]
        heads = torch.tensor([split for _, _, split in pending], device=sums.device)
        token_sums = torch.where(heads[:, None], torch.zeros_like(sums), sums)
        head_sums = sums - token_sums
        if self.token_group is not None:
            token_sums = all_reduce_sum(token_sums, self.token_group)
        if self.head_group is not None:
            head_sums = all_reduce_sum(head_sums, self.head_group)
        total = (token_sums + head_sums).cpu()
        component = next(c for c, m in self.runtime.transformers.items() if m is module)
        key = (component, self.ctx.step_index, self.ctx.call_in_step)
        self._local.setdefault(key, []).extend((i, total[n].tolist()) for n, (i, _, _) in enumerate(pending))

    # -- results -----------------------------------------------------------------------------------------------
    def records(self) -> dict:
        """``{component: {branch: {quantity: {module name: [relative L1 change per step]}}}}``, identical on every
        rank. Branch ``call0`` is the first call of a step (cond), ``call1`` the second (uncond). Steps without a
        previous step (the first) have no entry; each list is ordered by step and starts at the second step."""
        local = self._local
        if self.cfg_group is not None:  # the branches were computed on different cfg ranks
            merged: dict = {}
            for part in all_gather_object(local, self.cfg_group):
                for key, values in part.items():
                    merged.setdefault(key, values)
            local = merged
        out: dict = {}
        for (component, step, call), values in sorted(local.items(), key=lambda kv: (kv[0][0], kv[0][1] or 0, kv[0][2])):
            for index, (diff, base) in values:
                watch = self.watches[index]
                series = (out.setdefault(component, {}).setdefault(f"call{call}", {})
                          .setdefault(watch.quantity, {}).setdefault(watch.name, []))
                series.append(diff / base if base else 0.0)
        return out

    def remove(self) -> None:
        """Take the probe's hooks off and drop what it kept."""
        for handle in self.handles:
            handle.remove()
        self.handles.clear()
        self.ctx.needs_full_batches = False
        for watch in self.watches:
            watch.previous.clear()
