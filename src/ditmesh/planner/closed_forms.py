"""Closed-form communication and memory costs of one attention layer (or one block) per parallel method.

These are the textbook volumes the planner composes for hybrids. All sizes are in bytes and count what
ONE GPU sends; ``hidden_dim`` is heads x head_dim of the attention, ``total_seq_len`` the full sequence.
"""

from __future__ import annotations

MIB = 1024 * 1024


def _mib(n_bytes: float) -> float:
    return round(n_bytes / MIB, 2)


def _check(total_seq_len: int, num_gpus: int, hidden_dim: int, bytes_per_element: int) -> None:
    for name, value in (("total_seq_len", total_seq_len), ("num_gpus", num_gpus), ("hidden_dim", hidden_dim),
                        ("bytes_per_element", bytes_per_element)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name}={value!r} must be a positive integer")


def ring_attention_cost(total_seq_len: int, num_gpus: int, hidden_dim: int, num_heads: int,
                        bytes_per_element: int = 2) -> dict:
    """Ring attention over ``num_gpus``: each GPU keeps one chunk of Q and passes K/V chunks around the ring.

    ``num_heads`` does not change the volumes (ring splits tokens, not heads); it is reported back so the
    three closed forms share one signature.
    """
    _check(total_seq_len, num_gpus, hidden_dim, bytes_per_element)
    chunk = total_seq_len // num_gpus
    memory = chunk * hidden_dim * bytes_per_element * 3  # local Q, K and V
    per_step = chunk * hidden_dim * bytes_per_element * 2  # one K chunk + one V chunk
    total = per_step * (num_gpus - 1)
    return {
        "method": "ring",
        "num_heads": num_heads,
        "chunk_length": chunk,
        "ring_steps": num_gpus,
        "memory_per_gpu_bytes": memory,
        "memory_per_gpu_mb": _mib(memory),
        "full_kv_memory_bytes": total_seq_len * hidden_dim * bytes_per_element * 2,
        "per_step_comm_bytes": per_step,
        "total_comm_bytes": total,
        "total_comm_mb": _mib(total),
        "memory_savings_fraction": round(1 - memory / (total_seq_len * hidden_dim * bytes_per_element * 3), 4),
    }


def ulysses_attention_cost(total_seq_len: int, num_gpus: int, hidden_dim: int, num_heads: int,
                           bytes_per_element: int = 2) -> dict:
    """Ulysses over ``num_gpus``: all-to-alls turn a token shard of all heads into all tokens of a head shard.

    Four all-to-alls per attention (Q, K, V in, the output back; Q/K/V may travel fused in one call, the
    volume is the same). Each all-to-all keeps 1/num_gpus of its local tensor and sends the rest:
    ``per_all_to_all_send_bytes = chunk_length x hidden_dim x bytes x (num_gpus - 1) / num_gpus``.
    ``memory_per_gpu_bytes`` is Q, K, V after the exchange: all tokens of ``num_heads / num_gpus`` heads.
    """
    _check(total_seq_len, num_gpus, hidden_dim, bytes_per_element)
    if num_heads % num_gpus:
        raise ValueError(f"num_gpus={num_gpus} does not divide num_heads={num_heads}; Ulysses splits whole heads")
    chunk = total_seq_len // num_gpus
    local = chunk * hidden_dim * bytes_per_element
    per_a2a = local * (num_gpus - 1) // num_gpus
    total = 4 * per_a2a
    memory = total_seq_len * (hidden_dim // num_gpus) * bytes_per_element * 3
    return {
        "method": "ulysses",
        "num_heads": num_heads,
        "chunk_length": chunk,
        "heads_per_gpu": num_heads // num_gpus,
        "all_to_all_count": 4,
        "per_all_to_all_send_bytes": per_a2a,
        "memory_per_gpu_bytes": memory,
        "memory_per_gpu_mb": _mib(memory),
        "total_comm_bytes": total,
        "total_comm_mb": _mib(total),
    }


def tensor_parallel_cost(total_seq_len: int, num_gpus: int, hidden_dim: int, num_heads: int,
                         bytes_per_element: int = 2, allreduces: int = 2) -> dict:
    """Megatron tensor parallelism over ``num_gpus`` for one block with ``allreduces`` row-parallel outputs.

    Each row-parallel linear ends in an all-reduce of the full ``total_seq_len x hidden_dim`` activation; a
    ring all-reduce sends ``2 x (num_gpus - 1) / num_gpus`` times the tensor per GPU. A standard block
    (attention out-projection + MLP down-projection) has 2.
    """
    _check(total_seq_len, num_gpus, hidden_dim, bytes_per_element)
    if num_heads % num_gpus:
        raise ValueError(f"num_gpus={num_gpus} does not divide num_heads={num_heads}; tensor parallelism splits whole heads")
    tensor = total_seq_len * hidden_dim * bytes_per_element
    per_allreduce = 2 * tensor * (num_gpus - 1) // num_gpus
    total = per_allreduce * allreduces
    return {
        "method": "tp",
        "num_heads": num_heads,
        "heads_per_gpu": num_heads // num_gpus,
        "allreduce_count": allreduces,
        "allreduce_tensor_bytes": tensor,
        "per_allreduce_send_bytes": per_allreduce,
        "total_comm_bytes": total,
        "total_comm_mb": _mib(total),
        "weight_fraction_per_gpu": 1 / num_gpus,
    }
