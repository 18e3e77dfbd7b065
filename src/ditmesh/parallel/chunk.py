"""Chunked feed-forwards and attention: cap the largest activations of a long sequence, exactly.

A transformer block's feed-forward acts on each token alone, and its hidden layer is the widest activation of the
block (FLUX and SD3: 4x the model width; Wan: 13,824 of 5,120). A ``chunk`` hook on each module the family names
in ``ModelAdapter.token_wise`` runs the module on consecutive pieces of at most ``chunk`` tokens (dim 1) and
concatenates the results: the same numbers, with the hidden activation of one piece alive at a time instead of
the whole sequence's.

``chunk="auto"`` (CUDA) picks, per call, the largest piece whose hidden activation fits in a tenth of the memory
the device reports free when the hook is installed; on other devices ``auto`` leaves the modules whole. Under
tensor parallelism a row-parallel feed-forward all-reduces once per piece.

Attention under the same setting runs on pieces of at most ``chunk`` queries, each against all keys
(``attention.local.in_query_chunks``), so a kernel that materialises the scores (the CPU math path, the masked CUDA
path's bias ``[B, H, S_q, S_k]``) holds one piece's; ``auto`` sizes a piece so that its float32 scores fit the same
share of free memory. The flash kernels hold no scores, so there the pieces save little and cost little. Under
sequence parallelism the pieces cut the local attention after the all-to-all (Ulysses), each ring round's
(ring), or both (USP): the collectives stay the same. At sequence degree 1 the adapter's processor is installed
with a :class:`LocalAttention` (diffusers' dispatcher on each piece), the processor the sequence step installs
with its own runtime otherwise.
"""

from __future__ import annotations

import torch
from diffusers.models.attention_dispatch import dispatch_attention_fn

from ..attention.local import QueryChunks, in_query_chunks
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
        out = None  # written piece by piece: the whole output and one piece are alive, never all pieces and a copy
        for start in range(0, x.shape[1], size):
            piece = call_next((x.narrow(1, start, min(size, x.shape[1] - start)),) + tuple(args[1:]), rest)
            if out is None:
                out = piece.new_empty(piece.shape[0], x.shape[1], *piece.shape[2:])
            out.narrow(1, start, piece.shape[1]).copy_(piece)
        return out


def budget_of(chunk, device: torch.device) -> int | None:
    """Bytes one piece's activation may take under ``chunk="auto"`` on ``device`` (None for a token count, or
    ``auto`` off CUDA, where nothing is chunked)."""
    if chunk != "auto" or device.type != "cuda":
        return None
    free, _ = torch.cuda.mem_get_info(device)
    return int(free * AUTO_SHARE)


def query_chunks(chunk, device: torch.device) -> QueryChunks | None:
    """The attention pieces of the ``chunk`` setting (None: attention runs whole)."""
    if chunk is None:
        return None
    if chunk == "auto":
        budget = budget_of(chunk, device)
        return None if budget is None else QueryChunks(budget=budget)
    return QueryChunks(tokens=chunk)


def dispatched_attention(q, k, v, mask, backend, chunks: QueryChunks | None):
    """diffusers' attention dispatcher with ``backend`` on pieces of the queries (``chunks``; None: one call)."""
    return in_query_chunks(lambda q, k, v, m: dispatch_attention_fn(q, k, v, attn_mask=m, backend=backend),
                           q, k, v, mask, chunks)


class LocalAttention:
    """The runtime the adapters' processors call at sequence degree 1 when attention is chunked: :meth:`attention`
    has :meth:`~ditmesh.parallel.sequence.SequenceParallel.attention`'s signature and runs diffusers' dispatcher on
    pieces of the queries. The mask is in the model's token order, which is the local one."""

    def __init__(self, chunks: QueryChunks):
        self.query_chunks = chunks

    def attention(self, query, key, value, backend=None, streams=None, mask=None):
        return dispatched_attention(query, key, value, mask, backend, self.query_chunks)

    def whole_query_attention(self, query, key, value):
        """:meth:`~ditmesh.parallel.sequence.SequenceParallel.whole_query_attention` at degree 1: every key is here."""
        return dispatched_attention(query, key, value, None, None, self.query_chunks)


def apply(model: torch.nn.Module, adapter, chunk, device: torch.device, attention: QueryChunks | None = None) -> list:
    """Put a :class:`ChunkHook` on every module of ``model`` the adapter names token-wise and, with ``attention``
    (the query pieces, given at sequence degree 1; the sequence step takes them otherwise), the adapter's processor
    with a :class:`LocalAttention` on its attention layers; returns undo callables ([] when ``chunk`` is None, or
    ``auto`` off CUDA). ``chunk`` is checked by ``parallelize``."""
    if chunk is None or (chunk == "auto" and device.type != "cuda"):
        return []
    budget = budget_of(chunk, device)
    undo = []
    if adapter.token_wise:
        patterns = [name_pattern(p) for p in adapter.token_wise]
        for name, module in model.named_modules():
            if any(p.match(name) for p in patterns):
                tokens = None if chunk == "auto" else chunk
                undo.append(add_hook(module, ChunkHook(tokens, budget, hidden_width(module))))
        if not undo:
            raise ConfigError(f"chunk: none of {', '.join(adapter.token_wise)} is a module of {type(model).__name__}")
    if attention is not None:
        undo.append(adapter.set_processors(model, LocalAttention(attention)))
    return undo
