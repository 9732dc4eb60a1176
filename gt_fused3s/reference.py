"""The 3S attention in plain PyTorch: the ground truth of every test, the CPU
path and the fallback of the fused kernel.

    out[i, h] = sum_{e = j -> i} softmax_e(scale * <q[i, h], k[j, h]> + bias[e, h]) * v[j, h]

Edges follow PyG: ``edge_index[0]`` = source ``j``, ``edge_index[1]`` =
destination ``i``. Rows without in-neighbours give 0. Every edge is a term:
an edge listed twice counts twice, as in PyG's and DGL's message passing.
"""
from __future__ import annotations

import math

import torch
from torch import Tensor

_LOW_PRECISION = (torch.float16, torch.bfloat16)


def _check_qkv(q: Tensor, k: Tensor, v: Tensor, *, rows: bool = False) -> tuple[int, int, int]:
    """(N, H, D) of q; k, v must share q's [N, H] (``rows``: q may have
    fewer rows than k and v, the destinations being the first nodes)."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, Tensor):
            raise ValueError(f"{name} must be a torch.Tensor (got {type(t).__name__})")
        if t.dim() != 3:
            raise ValueError(f"{name} must have shape [N, H, D] (got {tuple(t.shape)})")
        if not t.is_floating_point():
            raise ValueError(f"{name} must be a floating-point tensor (got {t.dtype})")
    same_rows = k.size(0) == q.size(0) or (rows and q.size(0) <= k.size(0))
    if not same_rows or k.shape[1:] != q.shape[1:] or v.shape[:2] != k.shape[:2]:
        raise ValueError(f"q, k, v must share [N, H] and q, k must share D "
                         f"(got q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)})")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k, v must be on one device (got {q.device}, {k.device}, {v.device})")
    if q.size(1) < 1 or q.size(2) < 1:
        raise ValueError(f"q, k, v need at least one head and a head dim >= 1 (got {tuple(q.shape)})")
    return q.shape


def default_scale(head_dim: int) -> float:
    return 1.0 / math.sqrt(head_dim)


def attention_reference(q: Tensor, k: Tensor, v: Tensor, edge_index: Tensor,
                        scale: float | None = None, *, edge_bias: Tensor | None = None,
                        return_weights: bool = False, dropout_mask: Tensor | None = None,
                        compute_dtype: torch.dtype = torch.float32,
                        out_dtype: torch.dtype | None = None) -> Tensor:
    """Unfused 3S: gather, max-stabilised segment softmax, scatter-sum.

    Args:
        q, k, v: [N, H, D] (v may have its own last dim), any float dtype.
            q may have fewer rows than k and v: the destinations are then
            the first ``q.size(0)`` nodes.
        edge_index: [2, E] int64, sources in row 0, destinations in row 1.
        scale: score scale, default ``1 / sqrt(D)``.
        edge_bias: optional [E, H] bias added to the scaled scores, one row
            per edge of ``edge_index``.
        dropout_mask: optional [E, H] factors of attention dropout (0 for a
            dropped edge, 1 / (1 - p) for a kept one: ``ops.dropout_keep``),
            applied to the weights of the sum only (the returned weights are
            those before dropout, as in TransformerConv).
        return_weights: also return the softmax weights [E, H] (in
            ``compute_dtype``'s accumulation precision, fp32 or fp64).
        compute_dtype: ``float32`` (default) or ``float64`` computes every step
            in that precision. ``float16`` / ``bfloat16`` gives the reference
            *in low precision*: the rounding points of a tensor-core kernel
            (scores and probabilities rounded to that dtype, exp and sums in
            fp32); tests use its error to set the kernel's tolerance.
        out_dtype: dtype of the result, default ``q.dtype``.

    Returns:
        [N, H, Dv] (and the weights [E, H] with ``return_weights``).
        Differentiable with respect to q, k, v and edge_bias.
    """
    N, H, D = _check_qkv(q, k, v, rows=True)
    scale = default_scale(D) if scale is None else float(scale)
    low = compute_dtype in _LOW_PRECISION
    acc = torch.float32 if low else compute_dtype
    src, dst = edge_index[0].long(), edge_index[1].long()

    if low:
        qc, kc, vc = (t.to(compute_dtype).to(acc) for t in (q, k, v))
    else:
        qc, kc, vc = (t.to(acc) for t in (q, k, v))
    score = (qc.index_select(0, dst) * kc.index_select(0, src)).sum(-1) * scale   # [E, H]
    if low:
        score = score.to(compute_dtype).to(acc)
    if edge_bias is not None:   # the kernel adds it in fp32 to its fp32 scores
        score = score + edge_bias.to(acc)
    idx = dst.unsqueeze(-1).expand_as(score)
    row_max = torch.full((N, H), float("-inf"), dtype=acc, device=q.device)
    row_max = row_max.scatter_reduce(0, idx, score, reduce="amax", include_self=True)
    # A row whose scores are all -inf (e.g. by its bias) gets weights 0, as in
    # the kernel (a NaN max propagates: NaN in, NaN out).
    row_max = torch.where(row_max == float("-inf"), 0, row_max)
    p = torch.exp(score - row_max.index_select(0, dst))                              # [E, H]
    denom = torch.zeros((N, H), dtype=acc, device=q.device).index_add(0, dst, p)
    if low:
        p = p.to(compute_dtype).to(acc)
    pm = p if dropout_mask is None else p * dropout_mask.to(acc)
    msg = pm.unsqueeze(-1) * vc.index_select(0, src)                                # [E, H, Dv]
    out = torch.zeros((N, H, v.size(-1)), dtype=acc, device=q.device).index_add(0, dst, msg)
    # rows without in-neighbours (or with weights 0 only) are 0; a NaN or an
    # Inf among a row's scores or values makes it NaN, as in message passing
    has_nbr = (denom != 0).unsqueeze(-1)
    out = torch.where(has_nbr, out / torch.where(has_nbr, denom.unsqueeze(-1), 1), 0)
    out = out.to(out_dtype or q.dtype)
    if return_weights:    # every edge's row has a positive denominator
        return out, p / denom.index_select(0, dst)
    return out


def edge_feature_reference(q: Tensor, k: Tensor, v: Tensor, edge_index: Tensor, edge_attr: Tensor,
                           w_e: Tensor, scale: float, dropout_mask: Tensor | None = None
                           ) -> tuple[Tensor, Tensor]:
    """TransformerConv's attention with edge features as TransformerConv
    computes it, ``e_ij = W_e a_ij`` materialised [E, H, C] and added to the
    key and the value: the specification of
    :func:`~gt_fused3s.edge_terms.edge_feature_attention`. q, k, v [N, H, C],
    edge_attr [E, F], w_e [H, C, F]; ``dropout_mask`` [E, H] multiplies the
    weights of the sum (``ops.dropout_keep``: 0 or 1 / (1 - p)); returns
    ``(out [N, H, C], alpha [E, H])``, alpha before dropout."""
    src, dst = edge_index.long()
    n, H, C = q.shape
    e = torch.einsum("hcf,ef->ehc", w_e, edge_attr)
    s = (q[dst] * (k[src] + e)).sum(-1) * scale
    mx = torch.full((n, H), -torch.inf, dtype=s.dtype, device=s.device).scatter_reduce(
        0, dst[:, None].expand_as(s), s, "amax")
    p = torch.exp(s - mx[dst])
    alpha = p / torch.zeros(n, H, dtype=s.dtype, device=s.device).index_add(0, dst, p)[dst]
    used = alpha if dropout_mask is None else alpha * dropout_mask.to(alpha.dtype)
    out = torch.zeros(n, H, C, dtype=s.dtype, device=s.device).index_add(
        0, dst, used.unsqueeze(-1) * (v[src] + e))
    return out, alpha


def attention_dense(q: Tensor, k: Tensor, v: Tensor, mask: Tensor,
                    scale: float | None = None, *,
                    compute_dtype: torch.dtype = torch.float32,
                    out_dtype: torch.dtype | None = None) -> Tensor:
    """Masked dense softmax attention for small graphs.

    ``mask``: bool [N, N], ``mask[i, j]`` True iff ``j -> i`` is an edge
    (``BSBGraph.to_dense_mask()``), or integer [N, N] edge counts
    (``BSBGraph.to_dense_counts()``): an edge of count ``m`` weighs ``m``
    times, as a duplicated edge does in the sparse computation. Costs
    O(H N^2) memory.
    """
    N, H, D = _check_qkv(q, k, v)
    if mask.shape != (N, N) or mask.is_floating_point():
        raise ValueError(f"mask must be bool or integer [N, N] = [{N}, {N}] "
                         f"(got {mask.dtype} {tuple(mask.shape)})")
    scale = default_scale(D) if scale is None else float(scale)
    qc, kc, vc = (t.to(compute_dtype).transpose(0, 1) for t in (q, k, v))   # [H, N, D]
    score = torch.matmul(qc, kc.transpose(1, 2)) * scale                     # [H, N, N]
    if mask.dtype == torch.bool:
        score = score.masked_fill(~mask, float("-inf"))
    else:   # m copies of an edge: m exp(s) = exp(s + log m); log 0 = -inf masks
        score = score + mask.to(score.dtype).log()
    attn = torch.softmax(score, dim=-1).nan_to_num(0.0)    # empty rows: all -inf -> 0
    out = torch.matmul(attn, vc).transpose(0, 1)
    return out.to(out_dtype or q.dtype)


def sequence_reference(q: Tensor, k: Tensor, v: Tensor, mask, cu_seqlens: list[int],
                       scale: float | None = None, *, compute_dtype: torch.dtype = torch.float32,
                       out_dtype: torch.dtype | None = None, max_scores: int = 1 << 24) -> Tensor:
    """Masked softmax attention over packed documents, by row chunks.

    q, k, v: [T, H, D]; document d holds tokens ``cu_seqlens[d] ..
    cu_seqlens[d+1]-1`` (a host list) and attends within itself. ``mask``: a
    ``gt_fused3s.sequence`` mask: each chunk of queries scores its candidate
    keys (``candidate_keys``) and ``mask.allowed`` keeps the true ones, so
    memory is O(chunk x candidates), at most ``max_scores`` scores per head.
    Queries without keys give 0; NaN and Inf propagate. Differentiable.
    """
    from .sequence.masks import candidate_keys
    T, H, D = _check_qkv(q, k, v)
    scale = default_scale(D) if scale is None else float(scale)
    acc = torch.float64 if compute_dtype == torch.float64 else torch.float32
    qc, kc, vc = (t.to(compute_dtype).to(acc) for t in (q, k, v))
    pieces = []
    for d in range(len(cu_seqlens) - 1):
        s0, L = cu_seqlens[d], cu_seqlens[d + 1] - cu_seqlens[d]
        r0 = 0
        while r0 < L:
            rows = max(1, min(1024, L - r0))
            while True:
                cand = candidate_keys(mask, r0, r0 + rows, L)
                if rows == 1 or rows * max(1, cand.numel()) <= max_scores:
                    break
                rows //= 2
            i = torch.arange(r0, r0 + rows)
            qi = qc[s0 + r0:s0 + r0 + rows]                                  # [C, H, D]
            if cand.numel() == 0:
                pieces.append(torch.zeros((rows, H, v.size(-1)), dtype=acc, device=q.device))
                r0 += rows
                continue
            allowed = mask.allowed(i[:, None], cand[None, :], L).to(q.device)   # [C, K]
            kj = kc.index_select(0, cand.to(q.device) + s0)
            vj = vc.index_select(0, cand.to(q.device) + s0)
            score = torch.einsum("chd,khd->hck", qi, kj) * scale
            if compute_dtype in _LOW_PRECISION:
                score = score.to(compute_dtype).to(acc)
            score = score.masked_fill(~allowed, float("-inf"))
            mx = score.amax(-1, keepdim=True)
            mx = torch.where(mx == float("-inf"), 0, mx)
            p = torch.exp(score - mx)
            den = p.sum(-1, keepdim=True)
            if compute_dtype in _LOW_PRECISION:
                p = p.to(compute_dtype).to(acc)
            o = torch.einsum("hck,khd->chd", p, vj)
            den = den.permute(1, 0, 2)                                          # [C, H, 1]
            pieces.append(torch.where(den != 0, o / torch.where(den != 0, den, 1), 0))
            r0 += rows
    out = torch.cat(pieces) if pieces else torch.zeros((0, H, v.size(-1)), dtype=acc, device=q.device)
    return out.to(out_dtype or q.dtype)
