"""Chunked feed-forwards: cap the largest activation of a long sequence, exactly.

A transformer block's feed-forward acts on each token alone, and its hidden layer is the widest activation of the
block (FLUX and SD3: 4x the model width; Wan: 13,824 of 5,120). A ``chunk`` hook on each module the family names
in ``ModelAdapter.token_wise`` runs the module on consecutive pieces of at most ``chunk`` tokens (dim 1) and
concatenates the results: the same numbers, with the hidden activation of one piece alive at a time instead of
the whole sequence's.

``chunk="auto"`` (CUDA) picks, per call, the largest piece whose hidden activation fits in a tenth of the memory
the device reports free when the hook is installed; on other devices ``auto`` leaves the modules whole. Under
tensor parallelism a row-parallel feed-forward all-reduces once per piece.
"""

from __future__ import annotations

import torch

from ..config import ConfigError
from ..hooks import Hook, add_hook
from ..models.base import name_pattern

#: the share of free device memory the hidden activation of one piece may take under ``auto``
AUTO_SHARE = 0.1


def hidden_width(module: torch.nn.Module) -> int:
    """The widest output of the linear layers in ``module``: a feed-forward's hidden width."""
    return max((m.out_features for m in module.modules() if isinstance(m, torch.nn.Linear)), default=1)


class ChunkHook(Hook):
    """Run a token-wise module on pieces of at most ``tokens`` tokens (``tokens`` None: per call, from ``budget``
    bytes for the hidden activation)."""

    name = "chunk"

    def __init__(self, tokens: int | None, budget: int | None, width: int):
        self.tokens, self.budget, self.width = tokens, budget, width
        #: calls that ran in more than one piece
        self.split_calls = 0

    def piece(self, x: torch.Tensor) -> int:
        if self.tokens is not None:
            return self.tokens
        per_token = x.shape[0] * self.width * x.element_size()
        return max(1, self.budget // per_token)

    def __call__(self, owner, call_next, args, kwargs):
        x = args[0] if args else kwargs.get("hidden_states")
        if not isinstance(x, torch.Tensor) or x.dim() < 3:
            return call_next(args, kwargs)
        size = self.piece(x)
        if x.shape[1] <= size:
            return call_next(args, kwargs)
        self.split_calls += 1
        rest = kwargs if args else {k: v for k, v in kwargs.items() if k != "hidden_states"}
        pieces = [call_next((part,) + tuple(args[1:]), rest) for part in x.split(size, dim=1)]
        return torch.cat(pieces, dim=1)


def apply(model: torch.nn.Module, adapter, chunk, device: torch.device) -> list:
    """Put a :class:`ChunkHook` on every module of ``model`` the adapter names token-wise; returns undo callables
    ([] when ``chunk`` is None, or ``auto`` off CUDA). ``chunk`` is checked by ``parallelize``."""
    if chunk is None or not adapter.token_wise:
        return []
    budget = None
    if chunk == "auto":
        if device.type != "cuda":
            return []
        free, _ = torch.cuda.mem_get_info(device)
        budget = int(free * AUTO_SHARE)
    patterns = [name_pattern(p) for p in adapter.token_wise]
    undo = []
    for name, module in model.named_modules():
        if any(p.match(name) for p in patterns):
            tokens = None if chunk == "auto" else chunk
            undo.append(add_hook(module, ChunkHook(tokens, budget, hidden_width(module))))
    if not undo:
        raise ConfigError(f"chunk: none of {', '.join(adapter.token_wise)} is a module of {type(model).__name__}")
    return undo
