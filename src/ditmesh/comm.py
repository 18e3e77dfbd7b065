"""Every collective ditmesh issues, in one place.

All collectives go through the functional API (``torch.distributed._functional_collectives``) so a
compiled region traces them without a graph break. Each call bumps a counter in :data:`COUNTS`, which
tests read to assert the exact number of collectives per denoising step (an extra all-gather is a bug).

Cross-rank rule: a collective on a group must be called by every rank of that group, in the same order,
with split sizes that every rank computes identically (they are derived from global shapes only).
"""

from __future__ import annotations

import collections
import contextlib
import math

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

#: Number of collectives issued per kind since the last reset (eager calls; a compiled graph counts
#: when it is traced). Debug-only consistency checks are counted under ``"check"``.
COUNTS: collections.Counter = collections.Counter()

#: Bytes moved per ``(kind, dtype)`` since the last reset, as :data:`COUNTS` counts calls (the send side of each
#: collective: what this rank hands to the transport). Tests read it to assert what travels (``--comm-dtype fp8``).
BYTES: collections.Counter = collections.Counter()

#: the functional all-gather: ``all_gather_single`` where torch has it (``all_gather_tensor`` is deprecated there)
_ALL_GATHER = getattr(funcol, "all_gather_single", None) or funcol.all_gather_tensor


def reset_counts() -> None:
    """Zero :data:`COUNTS` and :data:`BYTES`."""
    COUNTS.clear()
    BYTES.clear()


@contextlib.contextmanager
def count_collectives(counter: collections.Counter = COUNTS):
    """Context manager yielding a Counter of the collectives issued inside the block (``counter=BYTES``: of the bytes
    sent, by ``(kind, dtype)``)."""
    before = collections.Counter(counter)
    delta: collections.Counter = collections.Counter()
    try:
        yield delta
    finally:
        for key, value in counter.items():
            if value - before.get(key, 0):
                delta[key] = value - before.get(key, 0)


def split_sizes(length: int, parts: int) -> list[int]:
    """Sizes of ``parts`` contiguous chunks of ``length`` items; the first ``length % parts`` get one extra.

    Every rank derives the same sizes from the global length, so no sizes need to be exchanged.
    """
    base, extra = divmod(length, parts)
    return [base + (1 if i < extra else 0) for i in range(parts)]


def offsets(sizes: list[int]) -> list[int]:
    """Start offset of each chunk given chunk sizes."""
    out, acc = [], 0
    for s in sizes:
        out.append(acc)
        acc += s
    return out


def _count(kind: str, *sent: torch.Tensor) -> None:
    # Counting is host-side bookkeeping for tests; inside a compiled region it would only run at trace time.
    if not torch.compiler.is_compiling():
        COUNTS[kind] += 1
        for t in sent:
            BYTES[kind, str(t.dtype).removeprefix("torch.")] += t.numel() * t.element_size()


def all_to_all_single(x: torch.Tensor, output_split_sizes: list[int], input_split_sizes: list[int], group) -> torch.Tensor:
    """All-to-all of a 1-D buffer with per-peer element counts (even or uneven)."""
    _count("all_to_all", x)
    out = funcol.all_to_all_single(x, output_split_sizes, input_split_sizes, group)
    return _waited(out)


def all_to_all_start(x: torch.Tensor, output_split_sizes: list[int], input_split_sizes: list[int], group) -> torch.Tensor:
    """Issue an all-to-all and return its result *without waiting*: pass it to :func:`wait` before any use.

    Calls the functional op directly (not ``funcol.all_to_all_single``, which waits at once when traced),
    so the compute between this call and :func:`wait` overlaps the transfer, in eager mode and in a
    compiled graph alike. Counted as one ``"all_to_all"``.
    """
    _count("all_to_all", x)
    return torch.ops._c10d_functional.all_to_all_single(x, output_split_sizes, input_split_sizes, group_name(group))


def wait(t: torch.Tensor) -> torch.Tensor:
    """The finished result of a collective issued by :func:`all_to_all_start` (a stream wait, no host sync)."""
    return torch.ops._c10d_functional.wait_tensor(t)


def group_name(group) -> str:
    """The registered name of ``group`` (what the functional ops take); a name passes through."""
    if isinstance(group, str):
        return group
    if group is None:
        group = dist.group.WORLD
    return group.group_name


def resolve_group(group):
    """The process group ``group`` names (a registered name, as the functional ops take it); a group passes through.
    Compiled blocks hold names, not groups: a name is a constant a saved artifact can keep."""
    if isinstance(group, str):
        from torch.distributed.distributed_c10d import _resolve_process_group

        return _resolve_process_group(group)
    return group


def _waited(t: torch.Tensor) -> torch.Tensor:
    # Eager funcol results are AsyncCollectiveTensors; waiting here keeps callers simple. Traced
    # (compiled) results are plain tensors and the compiler places the wait itself.
    return t.wait() if isinstance(t, funcol.AsyncCollectiveTensor) else t


def all_gather_uneven(x: torch.Tensor, dim: int, sizes: list[int], group) -> torch.Tensor:
    """Concatenate every rank's ``x`` along ``dim``, where rank ``j`` holds ``sizes[j]`` items on ``dim``.

    Chunks are padded to the largest size for the transfer and trimmed after it.
    """
    longest = max(sizes)
    local = x.size(dim)
    if local < longest:
        pad_shape = list(x.shape)
        pad_shape[dim] = longest - local
        x = torch.cat([x, x.new_zeros(pad_shape)], dim=dim)
    _count("all_gather", x)
    gathered = _waited(_ALL_GATHER(x.contiguous(), gather_dim=dim, group=group))
    if longest * len(sizes) == sum(sizes):
        return gathered
    chunks = gathered.split(longest, dim=dim)
    return torch.cat([c.narrow(dim, 0, s) for c, s in zip(chunks, sizes)], dim=dim)


def all_gather_object(obj, group=None) -> list:
    """Gather a picklable object from every rank (host-side, for reports; not for hot paths)."""
    if not dist.is_initialized():
        return [obj]
    COUNTS["object"] += 1
    out = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out


def check_identical(t: torch.Tensor, group=None) -> bool:
    """True when ``t`` is bit-identical on every rank of ``group`` (compares a float64 digest)."""
    COUNTS["check"] += 1
    flat = t.detach().reshape(-1).to(torch.float64)
    weights = torch.arange(1, flat.numel() + 1, dtype=torch.float64, device=flat.device)
    digest = torch.stack([flat.sum(), (flat * weights).sum(), flat.abs().max() if flat.numel() else flat.sum()])
    digest = torch.cat([digest, torch.tensor([float(flat.numel())], dtype=torch.float64, device=flat.device)])
    hi, lo = digest.clone(), digest.clone()
    dist.all_reduce(hi, op=dist.ReduceOp.MAX, group=group)
    dist.all_reduce(lo, op=dist.ReduceOp.MIN, group=group)
    return bool(torch.equal(hi, lo))


def all_reduce_sum(x: torch.Tensor, group) -> torch.Tensor:
    """Sum ``x`` over the ranks of ``group`` (functional: returns a new tensor)."""
    _count("all_reduce", x)
    return _waited(funcol.all_reduce(x, "sum", group))


def all_reduce_max(x: torch.Tensor, group) -> torch.Tensor:
    """``x`` reduced with MAX over ``group`` (a traceable functional collective, counted as ``all_reduce``)."""
    _count("all_reduce", x)
    return _waited(funcol.all_reduce(x, "max", group))


def ring_exchange_start(send: list[torch.Tensor], recv: list[torch.Tensor], send_to: int, recv_from: int, group) -> list:
    """Post one ring round: send ``send`` to group rank ``send_to`` and receive ``recv`` from ``recv_from``.

    Returns the pending work handles; pass them to :func:`ring_exchange_wait` after the compute this
    transfer overlaps. Counted once per round as ``"ring_p2p"``, however many tensors travel together.
    Peers are ranks *within* ``group``, so one ring works on any sub-mesh.
    Zero-size tensors are left out (both sides know the sizes from global shapes, so both skip them).

    Async on every backend: NCCL runs the batch on its own stream and ``wait`` only orders the current
    stream after it (no host sync); gloo runs the sends and receives on its own threads.

    Cross-rank rule: every rank of the ring posts the same rounds in the same order, and a rank's
    receive sizes equal its predecessor's send sizes.
    """
    # P2POp takes global ranks on every torch version (its ``group_peer`` argument is newer than 2.5)
    group = resolve_group(group)
    dst, src = dist.get_global_rank(group, send_to), dist.get_global_rank(group, recv_from)
    ops = [dist.P2POp(dist.isend, t.contiguous(), dst, group=group) for t in send if t.numel()]
    ops += [dist.P2POp(dist.irecv, t, src, group=group) for t in recv if t.numel()]
    if not ops:
        return []
    _count("ring_p2p", *(t for t in send if t.numel()))
    return dist.batch_isend_irecv(ops)


def ring_shift_start(send: list[torch.Tensor], recv_shapes: list[tuple], send_to: int, recv_from: int, world: int,
                     group) -> list[torch.Tensor]:
    """The round of :func:`ring_exchange_start` as functional all-to-alls, one a tensor, whose only non-empty splits
    go to ``send_to`` and come from ``recv_from``: what compiled code uses, since dynamo cannot trace P2P work handles
    (a graph break) and the functional op can be compiled whole and saved (``ditmesh.aot``). Returns the pending
    results (``recv_shapes``), each to pass to :func:`wait` after the compute the transfer overlaps. Every rank of
    ``group`` takes part in each all-to-all, so no tensor is left out, empty or not; not counted (compiled code)."""
    pending = []
    for t, shape in zip(send, recv_shapes):
        into, out_of = [0] * world, [0] * world
        into[send_to], out_of[recv_from] = t.numel(), math.prod(shape)
        pending.append(all_to_all_start(t.reshape(-1), out_of, into, group))
    return pending


def ring_exchange_wait(works: list) -> None:
    """Wait for the work handles of :func:`ring_exchange_start` (on CUDA: a stream dependency, no host sync)."""
    for work in works:
        work.wait()


def exchange_rows(sends: dict[int, torch.Tensor], recvs: dict[int, torch.Tensor], group) -> None:
    """Point-to-point, all at once: send ``sends[q]`` to group rank ``q`` and receive ``recvs[q]`` (filled in place)
    from ``q``; waits for all of it. Counted once as ``"halo"`` (the parallel VAE's halo rows of a convolution).

    Cross-rank rule: ``q`` sends to this rank exactly when this rank receives from ``q``, with the same element
    count; both sides derive the sizes from global shapes.
    """
    ops = [dist.P2POp(dist.isend, t.contiguous(), dist.get_global_rank(group, q), group=group)
           for q, t in sends.items() if t.numel()]
    ops += [dist.P2POp(dist.irecv, t, dist.get_global_rank(group, q), group=group) for q, t in recvs.items() if t.numel()]
    if not ops:
        return
    _count("halo")
    for work in dist.batch_isend_irecv(ops):
        work.wait()


def broadcast_tensors(obj, src: int, group, device: torch.device):
    """Broadcast ``obj`` (a tensor, or a tuple/list holding tensors and small picklable values) from global rank ``src``.

    The structure and tensor shapes travel first as one pickled object, then each tensor in one broadcast;
    non-source ranks pass anything (e.g. None) and get the source's value, tensors on ``device``. For
    per-prompt data such as text embeddings, not for per-step hot paths.
    """
    is_src = dist.get_rank() == src
    single = isinstance(obj, torch.Tensor)
    items = [obj] if single else list(obj) if is_src else None
    if is_src:
        skeleton = [("tensor", tuple(t.shape), t.dtype) if isinstance(t, torch.Tensor) else ("value", t) for t in items]
        meta = [(single, type(obj).__name__ == "tuple", skeleton)]
    else:
        meta = [None]
    COUNTS["broadcast"] += 1
    dist.broadcast_object_list(meta, src=src, group=group)
    single, as_tuple, skeleton = meta[0]
    out = []
    for i, entry in enumerate(skeleton):
        if entry[0] == "value":
            out.append(entry[1])
            continue
        t = items[i].contiguous() if is_src else torch.empty(entry[1], dtype=entry[2], device=device)
        COUNTS["broadcast"] += 1
        dist.broadcast(t, src=src, group=group)
        out.append(t)
    if single:
        return out[0]
    return tuple(out) if as_tuple else out


# -- PipeFusion's point-to-point messages: one flat buffer per patch and stage boundary, in pieces ---------------
def pieces(flat: torch.Tensor, chunk_bytes: int) -> tuple[torch.Tensor, ...]:
    """``flat`` (1-D) as consecutive views of at most ``chunk_bytes`` bytes each (at least one element each).

    Large single messages have hung NCCL point-to-point transfers (xDiT's PipeFusion over 64 MB), so no message
    is bigger than the caller's limit. Both sides cut the same element count the same way.
    """
    return flat.split(max(1, chunk_bytes // flat.element_size())) if flat.numel() else ()


def send_start(flat: torch.Tensor, peer: int, group, chunk_bytes: int) -> list:
    """Send the 1-D ``flat`` to group rank ``peer`` in pieces (:func:`pieces`) without waiting; returns the work
    handles (wait on them before ``flat`` is changed or freed). Counted once per piece as ``"pp_send"``.

    Cross-rank rule: ``peer`` posts :func:`recv_start` with a buffer of the same element count and ``chunk_bytes``.
    """
    dst = dist.get_global_rank(group, peer)
    works = []
    for piece in pieces(flat, chunk_bytes):
        COUNTS["pp_send"] += 1
        works.append(dist.isend(piece, dst, group=group))
    return works


def recv_start(flat: torch.Tensor, peer: int, group, chunk_bytes: int) -> list:
    """Receive into the 1-D ``flat`` from group rank ``peer`` in pieces, without waiting (the counterpart of
    :func:`send_start`); returns the work handles. Counted once per piece as ``"pp_recv"``."""
    src = dist.get_global_rank(group, peer)
    works = []
    for piece in pieces(flat, chunk_bytes):
        COUNTS["pp_recv"] += 1
        works.append(dist.irecv(piece, src, group=group))
    return works


def broadcast_pieces(flat: torch.Tensor, root: int, group, chunk_bytes: int) -> None:
    """Broadcast the 1-D ``flat`` (filled in place on the others) from group rank ``root`` in pieces of at most
    ``chunk_bytes``; waits. Counted once per piece as ``"broadcast"``."""
    src = dist.get_global_rank(group, root)
    for piece in pieces(flat, chunk_bytes):
        COUNTS["broadcast"] += 1
        dist.broadcast(piece, src, group=group)


def all_gather_start(x: torch.Tensor, group, kind: str = "all_gather", out: torch.Tensor | None = None) -> torch.Tensor:
    """Issue an all-gather of ``x`` along dim 0 (every rank's ``x`` of the same shape, rank order) and return its result
    *without waiting*: pass it to :func:`wait` before any use, in this step or a later one (displaced attention waits
    at the layer's next use, a step later). Counted once as ``kind``. ``out``: the tensor it writes (a buffer at a
    fixed address, which a CUDA graph's replays write again), else a new one.

    Calls the functional op directly, as :func:`all_to_all_start` does, so the compute between the start and the wait
    overlaps the transfer."""
    _count(kind, x)
    group = dist.group.WORLD if group is None else group
    args = (x.contiguous(), dist.get_world_size(group), group_name(group))
    if out is not None:
        return torch.ops._c10d_functional.all_gather_into_tensor_out(*args, out=out)
    return torch.ops._c10d_functional.all_gather_into_tensor(*args)


# -- fp8 payloads (``comm_dtype="fp8"``): rows of a tensor as float8_e4m3fn bytes with a float32 scale each ---------
#: the largest finite float8_e4m3fn value: a row's largest magnitude maps to it
FP8_MAX = 448.0


def fp8_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` ``[..., D]`` quantized per row of its last dim: ``(q float8_e4m3fn [..., D], scale float32 [..., 1])`` with
    ``scale = amax(|row|) / 448`` (an all-zero row gets a tiny scale and stays zero) and ``q = row / scale``, so that
    ``q * scale`` is the row as it arrives. Computed in float32 from ``x``'s values, so a row gives the same bytes
    wherever it is cut from (a sequence shard or the whole tensor)."""
    rows = x.float()
    scale = rows.abs().amax(-1, keepdim=True).clamp(min=torch.finfo(torch.float32).tiny) / FP8_MAX
    return (rows / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn), scale


def fp8_round(x: torch.Tensor) -> torch.Tensor:
    """``x`` as a receiver gets it when it travels in fp8 (:func:`fp8_pack` then :func:`fp8_unpack`), in ``x``'s dtype:
    the one-process emulation of ``comm_dtype="fp8"`` applies this where the tensors would travel."""
    q, scale = fp8_rows(x)
    return (q.float() * scale).to(x.dtype)


def fp8_pack(x: torch.Tensor, dim: int) -> torch.Tensor:
    """``x`` (any shape, ``dim`` elements per row, rows contiguous) as one 1-D uint8 payload of ``dim + 4`` bytes per
    row: the row's float8_e4m3fn bytes, then its float32 scale's bytes (:func:`fp8_rows`). Rows stay in order, so a
    payload of ``n`` elements splits at ``n // dim * (dim + 4)`` bytes, and gloo, which has no float8 type, moves
    the bytes as they are."""
    q, scale = fp8_rows(x.reshape(-1, dim))
    return torch.cat([_bytes(q).reshape(-1, dim), _bytes(scale).reshape(-1, 4)], dim=-1).reshape(-1)


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """``t``'s elements as 1-D bytes. Through a flat, contiguous copy where needed: a dtype view needs a last stride
    of 1, which a size-1 dim need not have (inductor lays out ``amax(keepdim=True)``'s ``[rows, 1]`` with a large
    one)."""
    return t.reshape(-1).contiguous().view(torch.uint8)


def fp8_unpack(payload: torch.Tensor, dim: int, dtype: torch.dtype) -> torch.Tensor:
    """The 1-D ``payload`` of :func:`fp8_pack` back to its values, ``[rows * dim]`` in ``dtype``."""
    rows = payload.view(-1, dim + 4)
    q = rows[:, :dim].view(torch.float8_e4m3fn)
    scale = rows[:, dim:].contiguous().view(torch.float32)
    return (q.float() * scale).to(dtype).reshape(-1)


def fp8_bytes(numel: int, dim: int) -> int:
    """Bytes of :func:`fp8_pack`'s payload for ``numel`` elements in rows of ``dim``."""
    return numel // dim * (dim + 4)

