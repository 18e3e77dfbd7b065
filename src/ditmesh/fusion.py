"""Fused Q/K/V projections: one GEMM instead of three, with no second copy of the weights.

diffusers' processors for FLUX and Wan already take a fused path when ``attn.fused_projections`` is set
(``to_qkv``, and ``to_added_qkv`` for FLUX's text stream), but ``AttentionModuleMixin.fuse_projections``
keeps the three separate weights beside the fused one, which adds a third of the attention weights to
every GPU's memory (about 4 GiB for FLUX.1-dev in bf16). Here the separate linears keep working as *views*
of rows of the fused weight, so the memory stays the same and any code that still calls ``to_q`` gets the
same numbers.

The narrow products of sequence parallelism (1,152 tokens per GPU for FLUX 1024² on 4 GPUs; 128 text
tokens per GPU) run closer to the GPU's peak as one wider GEMM. Applied after tensor parallelism, it
fuses the already-sharded weights, so each rank's chunk of the output still holds its own heads of Q, K
and V in that order. Measured on 4x H200 it gained nothing (docs/lab/ulysses-overlap.md), so ``parallelize`` leaves
it off unless asked.

While fused: ``state_dict()`` lists the weights twice (``to_qkv`` and ``to_q``/``to_k``/``to_v``, one
storage); moving the model afterwards (``.to()``, CPU offload) breaks the sharing and adds a copy. An attention
layer with an adapted projection (peft's LoRA layer in place of a linear) is left unfused; a LoRA loaded afterwards
would be bypassed by the fused path, so ``parallelize``'s ``lora`` hook refuses that load
(``ditmesh.parallel.lora``). Fuse last, after moving and loading; undo (``ParallelRuntime.remove``) restores the
separate path and gives the separate linears their own storage again.
"""

from __future__ import annotations

import logging

import torch

from .models.base import ModelAdapter

#: (separate linears, the fused linear's name) that diffusers' fused path reads
_GROUPS = ((("to_q", "to_k", "to_v"), "to_qkv"), (("add_q_proj", "add_k_proj", "add_v_proj"), "to_added_qkv"))

log = logging.getLogger(__name__)


def fuse_qkv(model: torch.nn.Module, adapter: ModelAdapter) -> list:
    """Fuse the Q/K/V projections of ``model``'s self-attention layers in place; returns undo callables.

    Does nothing (returns ``[]``) for families whose processors do not read the fused path
    (``adapter.fuse_qkv`` false) and for cross-attention layers (their queries and keys read different inputs).
    """
    if not adapter.fuse_qkv:
        log.info("ditmesh: fuse_qkv: %s attention processors have no fused path; projections left separate",
                 adapter.name)
        return []
    fused = []
    for _, attn in adapter.attention_modules(model):
        if getattr(attn, "fused_projections", False) or getattr(attn, "is_cross_attention", False):
            continue
        groups = [(parts, fused_name) for parts, fused_name in _GROUPS
                  if all(isinstance(getattr(attn, p, None), torch.nn.Linear) for p in parts)]
        if not groups or groups[0][1] != "to_qkv":  # the added (text) projections alone are never fused
            continue
        present = [p for parts, _ in _GROUPS for p in parts if getattr(attn, p, None) is not None]
        if len(present) != sum(len(parts) for parts, _ in groups):
            continue  # a projection wrapped by an adapter (peft's LoRA layer) must run as it is: leave them separate
        for parts, fused_name in groups:
            setattr(attn, fused_name, _fused_linear([getattr(attn, p) for p in parts]))
        had_flag = "fused_projections" in vars(attn)
        attn.fused_projections = True
        fused.append((attn, groups, had_flag))

    def undo():
        for attn, groups, had_flag in fused:
            for parts, fused_name in groups:
                delattr(attn, fused_name)
                for part in parts:  # own storage again, so the fused weight is freed
                    _own_parameters(getattr(attn, part))
            if had_flag:
                attn.fused_projections = False
            else:
                del attn.fused_projections

    return [undo] if fused else []


def fused_parts(module: torch.nn.Module) -> list[torch.nn.Linear]:
    """The separate linears of ``module``'s fused projections (views of a fused linear's rows: the fused path does not
    call them), none when it is not fused."""
    if not getattr(module, "fused_projections", False):
        return []
    return [getattr(module, p) for parts, fused_name in _GROUPS
            if isinstance(getattr(module, fused_name, None), torch.nn.Module) for p in parts]


@torch.no_grad()
def _own_parameters(linear: torch.nn.Linear) -> None:
    for name in ("weight", "bias"):
        param = getattr(linear, name)
        if param is not None:
            setattr(linear, name, torch.nn.Parameter(param.detach().clone(), requires_grad=param.requires_grad))


@torch.no_grad()
def _fused_linear(linears: list[torch.nn.Linear]) -> torch.nn.Linear:
    """One linear whose output is the concatenation of ``linears``' outputs; they become views of its rows."""
    if len({lin.in_features for lin in linears}) != 1 or len({lin.bias is None for lin in linears}) != 1:
        raise ValueError("fused projections need linears of one input size, all with or all without a bias")
    weight = torch.cat([lin.weight for lin in linears])
    bias = None if linears[0].bias is None else torch.cat([lin.bias for lin in linears])
    fused = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None, device="meta")
    grad = linears[0].weight.requires_grad
    fused.weight = torch.nn.Parameter(weight, requires_grad=grad)
    if bias is not None:
        fused.bias = torch.nn.Parameter(bias, requires_grad=grad)
    start = 0
    for lin in linears:
        rows = lin.out_features
        lin.weight = torch.nn.Parameter(fused.weight[start : start + rows], requires_grad=grad)
        if bias is not None:
            lin.bias = torch.nn.Parameter(fused.bias[start : start + rows], requires_grad=grad)
        start += rows
    return fused
