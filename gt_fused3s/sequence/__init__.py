"""Sparse attention over sequences: structured masks computed on the fly.

    from gt_fused3s.sequence import Local, Global, sequence_attention
    out = sequence_attention(q, k, v, Local(256) | Global(3))   # q, k, v: [B, L, H, D]
"""
from .attention import sequence_attention
from .masks import BlockDilated, Dilated, Global, Local, Mask, RandomBlocks, Union, candidate_keys, kernel_code

__all__ = ["sequence_attention", "Mask", "Local", "Dilated", "BlockDilated", "Global", "RandomBlocks", "Union",
           "candidate_keys", "kernel_code"]
