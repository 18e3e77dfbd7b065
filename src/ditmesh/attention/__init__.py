"""Attention kernels: local attention with its log-sum-exp, and the sequence-parallel variants."""

from .local import attention_with_lse, normalize_lse

__all__ = ["attention_with_lse", "normalize_lse"]
