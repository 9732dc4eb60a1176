"""CPU stand-ins for the CUDA ops ``gt_fused3s::fwd``, ``fwd_scores``, ``bwd``, ``fwd8``, ``bwd8``, ``edge_probs``, ``gather_rows``, the
edge-term ops, the plan's builders ``bsb_build``, ``edge_slots`` and ``work_schedule``, and the sequence kernels ``seq_fwd`` / ``seq_bwd``,
with their contracts, so that the CPU suite runs everything around the
kernels: the plan, the registered ops and their fakes (``opcheck``),
autograd, torch.compile tracing, casts and padding.

``fwd`` and ``bwd`` decode the graph from the arrays they are given (the
items' windows, ``cols`` and ``bitmap``; unused items of a schedule at
capacity skipped, as the kernels do) and compute with the reference in fp32,
so a wrong array, schedule or transposed format shows up as a wrong result.
``bsb_build`` is the specification builder padded to capacity. The CUDA
kernels themselves are tested on the GPU (the ``cuda`` tests)."""
from __future__ import annotations

import torch

from gt_fused3s.graph import BSBGraph, block_bits, tcb_capacity
from gt_fused3s.reference import attention_reference

KERNEL_HEAD_DIMS = (16, 32, 64, 128, 256)


def decode(items: torch.Tensor, cols: torch.Tensor, bitmap: torch.Tensor,
           nnz_offset: torch.Tensor | None = None, slot_edge: torch.Tensor | None = None,
           slot_pos: torch.Tensor | None = None):
    """Edges [2, E] (source, destination) of a BSB as the kernels read it:
    the TCBs the items cover, in their windows, in the format's non-zero
    order. With ``nnz_offset`` and ``slot_edge``: also the caller's edge id
    of each, found as the kernels find it (first non-zero of the TCB + the
    TCB's set bits below). With ``slot_pos``: checks each non-zero's place
    in its pair's fragments (128 x + 4 lane + i, the kernels' pairs starting
    at each item's first TCB)."""
    it = items[items[:, 0] >= 0].long()
    T = bitmap.size(0)
    tcb_win = torch.full((T,), -1, dtype=torch.long)
    pair_start = torch.full((T,), -1, dtype=torch.long)   # the first TCB of each TCB's item
    for w, b, e, _ in it.tolist():
        tcb_win[b:e] = w
        pair_start[b:e] = b
    bit = torch.arange(64)
    on = ((bitmap.unsqueeze(-1) >> bit) & 1).bool()            # [T, 2, 64]
    t, word, b = on.nonzero(as_tuple=True)
    assert torch.all(tcb_win[t] >= 0), "an edge bit lies in a TCB no item covers"
    rows = tcb_win[t] * 16 + word * 8 + (b >> 3)
    srcs = cols.long()[t * 8 + (b & 7)]
    assert torch.all(srcs >= 0), "an edge bit in a padding column"
    edges = torch.stack([srcs, rows])
    if slot_edge is None:
        return edges
    first = torch.searchsorted(t, t)                            # first non-zero of each TCB
    nnz = nnz_offset.long()[t] + torch.arange(t.numel()) - first
    if slot_pos is not None:
        assert slot_pos.dtype == torch.uint8 and slot_pos.numel() == slot_edge.numel()
        x = (t - pair_start[t]) & 1
        want = (x << 7) | ((b >> 1) << 2) | (word << 1) | (b & 1)
        assert torch.equal(slot_pos.long()[nnz], want), "slot_pos: a non-zero's place in its pair"
    return edges, slot_edge.long()[nnz]


def decode8(rw_offset: torch.Tensor, cols: torch.Tensor, bitmap: torch.Tensor, windows: torch.Tensor) -> torch.Tensor:
    """Edges [2, E] (source, destination) of an 8-row format (graph8.py) as
    the 8-row kernels read it: each window once in ``windows`` (window, first
    block, end, 0), heaviest first, its blocks those of rw_offset; column c
    of a block at cols[16 block + c], row rr's bit (c % 8) * 8 + rr of word
    c // 8."""
    assert rw_offset.dtype == cols.dtype == windows.dtype == torch.int32 and bitmap.dtype == torch.int64
    T = int(rw_offset[-1])                # the blocks in use: a static build's capacity may be more
    assert cols.numel() == 16 * bitmap.size(0) and T <= bitmap.size(0)
    assert bool((bitmap[T:] == 0).all()), "a block past the windows' is unused"
    R = rw_offset.numel() - 1
    assert windows.shape == (R, 4) and torch.equal(torch.sort(windows[:, 0]).values, torch.arange(R, dtype=torch.int32))
    w = windows[:, 0].long()
    assert torch.equal(windows[:, 1], rw_offset[w]) and torch.equal(windows[:, 2], rw_offset[w + 1])
    sizes = windows[:, 2] - windows[:, 1]
    assert torch.all(sizes[:-1] >= sizes[1:]), "windows: heaviest first"
    win, t, word, b = block_bits(rw_offset, bitmap[:T])
    srcs = cols.long()[t * 16 + word * 8 + (b >> 3)]
    assert torch.all(srcs >= 0), "an edge bit in a padding column"
    return torch.stack([srcs, win * 8 + (b & 7)])


def _scores(q, k, edge_index, scale, bias=None):
    src, dst = edge_index
    s = (q.float()[dst] * k.float()[src]).sum(-1) * scale
    return s if bias is None else s + bias


def _lse(q, k, edge_index, scale, bias=None):
    dst = edge_index[1]
    s = _scores(q, k, edge_index, scale, bias)
    mx = torch.full(q.shape[:2], float("-inf")).scatter_reduce(0, dst[:, None].expand_as(s), s, "amax")
    se = torch.zeros(q.shape[:2]).index_add(0, dst, torch.exp(s - mx[dst]))
    return mx + torch.log(se)


def _reference_backward(q, k, v, do, edge_index, scale, bias=None, dp_bias=None, mask=None):
    """dq, dk, dv, dS of the attention over ``edge_index`` in fp32, written
    out (P = softmax, dS = P (dO.v - rowsum(dO * O)), dq = s dS k,
    dk = s dS^T q, dv = P^T dO; dp_bias: an extra dP per edge; mask: the
    dropout factors, dP = mask dO.v and dv = (mask P)^T dO), without
    autograd, so it also runs under dispatch modes."""
    q, k, v, do = (t.float() for t in (q, k, v, do))
    src, dst = edge_index
    N, H, _ = q.shape
    s = (q[dst] * k[src]).sum(-1) * scale                                   # [E, H]
    if bias is not None:
        s = s + bias
    p = torch.exp(s - _lse(q, k, edge_index, scale, bias)[dst])
    m = torch.ones_like(p) if mask is None else mask
    o = torch.zeros_like(v).index_add(0, dst, (p * m).unsqueeze(-1) * v[src])
    dp = (do[dst] * v[src]).sum(-1) * m
    if dp_bias is not None:
        dp = dp + dp_bias
    delta = torch.zeros_like(o[..., 0]).index_add(0, dst, p * dp)             # [N, H]
    ds = p * (dp - delta[dst])
    dq = torch.zeros_like(q).index_add(0, dst, ds.unsqueeze(-1) * k[src]) * scale
    dk = torch.zeros_like(k).index_add(0, src, ds.unsqueeze(-1) * q[dst]) * scale
    dv = torch.zeros_like(v).index_add(0, src, (p * m).unsqueeze(-1) * do[dst])
    return dq, dk, dv, ds


def _decode_with_bias(items, cols, bitmap, edge_bias, nnz_offset, slot_edge, slot_pos):
    """The decoded edges and, with a bias, each one's bias row ([E', H] fp32)."""
    if edge_bias is None:
        return decode(items, cols, bitmap), None
    assert edge_bias.dtype == torch.float32 and edge_bias.is_contiguous()
    assert nnz_offset.dtype == slot_edge.dtype == torch.int32
    assert nnz_offset.numel() == bitmap.size(0) + 1
    ei, ids = decode(items, cols, bitmap, nnz_offset, slot_edge, slot_pos)
    return ei, edge_bias[ids]


def _dropout_mask(items, cols, bitmap, nnz_offset, slot_edge, p, seed, heads):
    """The dropout factors of the decoded edges (None without dropout),
    keyed by the caller's edge id as the kernels key them."""
    if not p:
        return None
    from gt_fused3s.ops import dropout_keep
    ids = decode(items, cols, bitmap, nnz_offset, slot_edge)[1]
    return dropout_keep(seed, p, slot_edge.numel(), heads)[ids]


def _seed(seed, seed_t):
    """The ops' seed: the tensor where one is given (the kernels read it
    from device memory), else the int."""
    if seed_t is not None:
        assert seed_t.dtype == torch.int64 and seed_t.numel() == 1
        return seed_t
    return seed


def _check_permutation(slot_edge):
    """slot_edge lists every edge id once (the kernels write each edge's
    output through it)."""
    assert slot_edge.dtype == torch.int32
    assert torch.equal(torch.sort(slot_edge.long()).values, torch.arange(slot_edge.numel()))


def _check_operands(q, k, v=None, do=None):
    """q (and dO) [Nq, H, D]; k (and v) [N, H, D] with Nq <= N (a plan's
    destinations may be its first nodes)."""
    assert q.dtype in (torch.float16, torch.bfloat16) and q.size(-1) in KERNEL_HEAD_DIMS
    assert k.dtype == q.dtype and k.shape[1:] == q.shape[1:] and q.size(0) <= k.size(0)
    assert v is None or (v.dtype == q.dtype and v.shape == k.shape)
    assert do is None or (do.dtype == q.dtype and do.shape == q.shape)


def _sorted(ei):
    return torch.sort(ei[1] * (2 ** 31) + ei[0]).values


class StandIns:
    """The stand-in implementations; ``calls`` lists the ops run."""

    def __init__(self):
        self.calls: list[str] = []

    def fwd(self, q, k, v, rw_offset, cols, bitmap, window_order, items, slots, scale, out_fp32,
            edge_bias=None, nnz_offset=None, slot_edge=None, slot_pos=None, dropout_p=0.0, dropout_seed=0,
            dropout_seed_t=None):
        _check_operands(q, k, v)
        assert items.size(0) >= rw_offset.numel() - 1
        assert (nnz_offset is None) == (slot_edge is None) == (slot_pos is None)
        self.calls.append("fwd")
        ei, bias = _decode_with_bias(items, cols, bitmap, edge_bias, nnz_offset, slot_edge, slot_pos)
        mask = _dropout_mask(items, cols, bitmap, nnz_offset, slot_edge, dropout_p,
                             _seed(dropout_seed, dropout_seed_t), q.size(1))
        out = attention_reference(q, k, v, ei, scale, edge_bias=bias, dropout_mask=mask, out_dtype=torch.float32)
        return (out if out_fp32 else out.to(q.dtype)), _lse(q, k, ei, scale, bias)

    def fwd_scores(self, q, k, v, rw_offset, cols, bitmap, window_order, items, slots, scale, out_fp32,
                   edge_bias, nnz_offset, slot_edge, slot_pos, dropout_p=0.0, dropout_seed=0, dropout_seed_t=None):
        out, lse = self.fwd(q, k, v, rw_offset, cols, bitmap, window_order, items, slots, scale, out_fp32,
                            edge_bias, nnz_offset, slot_edge, slot_pos, dropout_p, dropout_seed, dropout_seed_t)
        self.calls[-1] = "fwd_scores"
        _check_permutation(slot_edge)
        ei, ids = decode(items, cols, bitmap, nnz_offset, slot_edge, slot_pos)
        scores = torch.empty(slot_edge.numel(), q.size(1))
        scores[ids] = _scores(q, k, ei, 1.0)          # raw q_i.k_j, the caller's edge order
        return out, lse, scores

    def bwd(self, do, q, k, v, out, lse, cols, bitmap, items, slots, t_cols, t_bitmap, t_items, t_slots,
            scale, grad_fp32, edge_bias=None, nnz_offset=None, slot_edge=None, slot_pos=None,
            t_nnz_offset=None, t_slot_edge=None, t_slot_pos=None, dp_bias=None, delta_extra=None, dropout_p=0.0,
            dropout_seed=0, dropout_seed_t=None):
        _check_operands(q, k, v, do)
        ei, bias = _decode_with_bias(items, cols, bitmap, edge_bias, nnz_offset, slot_edge, slot_pos)
        # the transposed format holds exactly the reversed edges (and, with
        # edge terms, finds each under the same edge id)
        t_ei, t_bias = _decode_with_bias(t_items, t_cols, t_bitmap, edge_bias, t_nnz_offset, t_slot_edge,
                                         t_slot_pos)
        assert torch.equal(_sorted(t_ei.flip(0)), _sorted(ei))
        ids = None
        if slot_edge is not None:
            _check_permutation(slot_edge)
            ids = decode(items, cols, bitmap, nnz_offset, slot_edge, slot_pos)[1]
            t_ids = decode(t_items, t_cols, t_bitmap, t_nnz_offset, t_slot_edge, t_slot_pos)[1]
            assert torch.equal(torch.sort(ids).values, torch.arange(slot_edge.numel()))
            by_id = torch.empty_like(ei)
            by_id[:, ids] = ei
            assert torch.equal(by_id[:, t_ids], t_ei.flip(0))
        # the saved forward output and lse come back unchanged
        mask = _dropout_mask(items, cols, bitmap, nnz_offset, slot_edge, dropout_p,
                             _seed(dropout_seed, dropout_seed_t), q.size(1))
        expect = attention_reference(q, k, v, ei, scale, edge_bias=bias, dropout_mask=mask,
                                     out_dtype=torch.float32)
        torch.testing.assert_close(out.float(), expect, atol=1e-2, rtol=0)
        torch.testing.assert_close(lse, _lse(q, k, ei, scale, bias))
        self.calls.append("bwd")
        dp = None
        if dp_bias is not None:
            # delta_extra is sum_j P_ij dp_bias_ij, which the caller computed
            dp = dp_bias[ids]
            p = torch.exp(_scores(q, k, ei, scale, bias) - lse[ei[1]])
            torch.testing.assert_close(delta_extra, torch.zeros_like(lse).index_add(0, ei[1], p * dp))
        *grads, ds = _reference_backward(q, k, v, do, ei, scale, bias, dp, mask)
        grad_bias = torch.empty(0)
        if edge_bias is not None:
            grad_bias = torch.zeros_like(edge_bias)
            grad_bias[ids] = ds
        return (*(g if grad_fp32 else g.to(q.dtype) for g in grads), grad_bias)

    def fwd8(self, q, k, v, rw_offset, cols, bitmap, windows, scale, out_fp32):
        _check_operands(q, k, v)
        assert q.shape == k.shape and q.size(-1) <= 128
        self.calls.append("fwd8")
        ei = decode8(rw_offset, cols, bitmap, windows)
        out = attention_reference(q, k, v, ei, scale, out_dtype=torch.float32)
        return (out if out_fp32 else out.to(q.dtype)), _lse(q, k, ei, scale)

    def bwd8(self, do, q, k, v, out, lse, rw_offset, cols, bitmap, windows, t_rw_offset, t_cols, t_bitmap,
             t_windows, scale, grad_fp32):
        _check_operands(q, k, v, do)
        ei = decode8(rw_offset, cols, bitmap, windows)
        # the transposed format holds exactly the reversed edges
        assert torch.equal(_sorted(decode8(t_rw_offset, t_cols, t_bitmap, t_windows).flip(0)), _sorted(ei))
        torch.testing.assert_close(out.float(), attention_reference(q, k, v, ei, scale, out_dtype=torch.float32),
                                   atol=1e-2, rtol=0)
        torch.testing.assert_close(lse, _lse(q, k, ei, scale))
        self.calls.append("bwd8")
        grads = _reference_backward(q, k, v, do, ei, scale)[:3]
        return tuple(g if grad_fp32 else g.to(q.dtype) for g in grads)

    # The edge-feature products (csrc/kernels/edge_terms.h): fp32 operands,
    # the sum over a node's edges read through rowptr / order as the kernel
    # reads it (a wrong grouping gives a wrong sum).
    def edge_dot(self, x, a, idx):
        _check_f32(x, a)
        self.calls.append("edge_dot")
        return (x[idx] * a.unsqueeze(1)).sum(-1)

    def edge_rows(self, w, x, idx, w2=None, x2=None):
        _check_f32(w, x, *([w2, x2] if w2 is not None else []))
        self.calls.append("edge_rows")
        out = (w.unsqueeze(-1) * x[idx]).sum(1)
        return out if w2 is None else out + (w2.unsqueeze(-1) * x2[idx]).sum(1)

    def edge_scatter(self, w, a, rowptr, order):
        _check_f32(w, a)
        assert rowptr.dtype == order.dtype == torch.int64
        assert rowptr[0] == 0 and rowptr[-1] == order.numel() and bool((rowptr.diff() >= 0).all())
        self.calls.append("edge_scatter")
        N = rowptr.numel() - 1
        node = torch.repeat_interleave(torch.arange(N), rowptr.diff())
        return torch.zeros(N, w.size(1), a.size(1)).index_add_(
            0, node, w[order].unsqueeze(-1) * a[order].unsqueeze(1))

    def edge_probs(self, scores, bias, lse, idx, scale):
        _check_f32(scores, lse, *([bias] if bias is not None else []))
        assert idx.dtype == torch.int64 and idx.shape == scores.shape[:1] and lse.size(1) == scores.size(1)
        self.calls.append("edge_probs")
        x = scores * scale - lse[idx]
        return torch.exp(x if bias is None else x + bias)

    def gather_rows(self, x, index):
        assert index.dtype == torch.int64 and index.dim() == 1
        self.calls.append("gather_rows")
        return x.index_select(0, index)

    def edge_slots(self, edge_index, rw_offset, cols, bitmap, num_nodes):
        """graph.edge_slots_from_keys on the edges' keys sorted (stable),
        checking what the CUDA op relies on: each edge's column found in
        ``cols`` (the window's sources ascending, a pair's copies side by
        side, -1 past them) where a binary search for its source plus its
        copy number lands."""
        from gt_fused3s.graph import _edge_keys, edge_slots_from_keys
        self.calls.append("edge_slots")
        assert edge_index.dtype in (torch.int32, torch.int64) and edge_index.dim() == 2
        assert bool(((edge_index >= 0) & (edge_index < num_nodes)).all())
        key, order = torch.sort(_edge_keys(edge_index[0].long(), edge_index[1].long(), num_nodes), stable=True)
        nnz_offset, slot_edge, slot_pos, column = edge_slots_from_keys(key, order, rw_offset, bitmap, num_nodes)
        pair = key >> 4
        win = pair // num_nodes if num_nodes else pair
        src = pair - win * num_nodes
        assert torch.equal(cols.long()[column], src)
        for w in torch.unique(win).tolist():       # the op's binary search: first column of the pair
            lo, hi = 8 * int(rw_offset[w]), 8 * int(rw_offset[w + 1])
            window = cols[lo:hi].long()
            valid = window[window >= 0]
            assert torch.equal(valid, torch.sort(valid).values) and bool((window[len(valid):] < 0).all())
        return nnz_offset, slot_edge, slot_pos

    def work_schedule(self, rw_offset, window_order, chunk, threshold, num_items, num_slots):
        """schedule.work_schedule_from_counts, checking what the CUDA op
        relies on: the windows listed heaviest first, an even chunk bound
        at most the threshold, the capacities enough, and no item longer
        than the threshold (its sort key's bits)."""
        from gt_fused3s.schedule import work_schedule_from_counts
        self.calls.append("work_schedule")
        assert rw_offset.dtype == window_order.dtype == torch.int32
        cnt = rw_offset.diff()[window_order.long()]
        assert torch.equal(torch.sort(window_order).values, torch.arange(window_order.numel(), dtype=torch.int32))
        assert bool((cnt[:-1] >= cnt[1:]).all()) and chunk % 2 == 0 and chunk <= threshold
        items, slots, counts = work_schedule_from_counts(rw_offset, window_order, chunk, threshold,
                                                         num_items, num_slots)
        assert counts[0] <= num_items and counts[1] <= num_slots
        assert int((items[:, 2] - items[:, 1]).max()) <= threshold
        return items, slots, counts

    def bsb_build(self, edge_index, num_nodes):
        self.calls.append("bsb_build")
        E = edge_index.size(1)
        ok = bool(((edge_index >= 0) & (edge_index < num_nodes)).all()) if E else True
        valid = edge_index if ok else edge_index.clamp(0, max(num_nodes - 1, 0))
        g = BSBGraph._build(valid[0].long(), valid[1].long(), num_nodes)
        cap = tcb_capacity(E, num_nodes)
        pad = cap - g.num_tcbs
        cols = torch.cat([g.cols, torch.full((pad * 8,), -1, dtype=torch.int32)])
        bitmap = torch.cat([g.bitmap, torch.zeros(pad, 2, dtype=torch.long)])
        counters = g.counters.clone()
        if E:
            lo, hi = torch.aminmax(edge_index.long())
            counters[2], counters[3] = lo, hi
        return g.rw_offset, cols, bitmap, g.window_order, g.edge_index, counters

    # The sequence kernels (csrc/kernels/seq_*): dense per document over the
    # mask decoded from the int list the kernel reads, with the row-block
    # contract checked (block rows and cu_windows as the op computes them).
    def seq_fwd(self, q, k, v, cu_seqlens, cu_windows, mask, scale, num_windows, block_rows):
        _check_seq(q, k, v, cu_seqlens, cu_windows, mask, scale, num_windows, block_rows, backward=False)
        self.calls.append("seq_fwd")
        out, lse = torch.zeros(q.shape), torch.full(q.shape[:2], float("-inf"))
        for s, e, p in _seq_docs(q, k, cu_seqlens, mask, scale):
            lse[s:e] = torch.logsumexp(p, -1).T
            out[s:e] = torch.einsum("hij,jhd->ihd", _probs(p, lse[s:e]), v[s:e].float())
        return out.to(q.dtype), lse

    def seq_bwd(self, do, q, k, v, out, lse, cu_seqlens, cu_windows, bwd_windows, mask, scale, num_windows):
        from gt_fused3s.ops import seq_block_rows, seq_windows
        # the forward's row blocks, and the backward's by query blocks where given
        _check_seq(q, k, v, cu_seqlens, cu_windows, mask, scale, num_windows, seq_block_rows(q.size(-1)),
                   backward=False)
        if bwd_windows is not None:
            assert torch.equal(bwd_windows, seq_windows(cu_seqlens, mask[0], seq_block_rows(q.size(-1), True)))
        assert do.dtype == out.dtype == q.dtype and do.shape == out.shape == q.shape
        delta = (do.float() * out.float()).sum(-1)
        self.calls.append("seq_bwd")
        dq, dk, dv = (torch.zeros(q.shape) for _ in range(3))
        for s, e, p in _seq_docs(q, k, cu_seqlens, mask, scale):
            torch.testing.assert_close(lse[s:e], torch.logsumexp(p, -1).T)   # the forward's
            pr = _probs(p, lse[s:e])
            g = do[s:e].float()
            out = torch.einsum("hij,jhd->ihd", pr, v[s:e].float())
            torch.testing.assert_close(delta[s:e], (g * out).sum(-1), atol=2e-2, rtol=2e-2)
            dp = torch.einsum("ihd,jhd->hij", g, v[s:e].float())
            ds = pr * (dp - delta[s:e].T.unsqueeze(-1))
            dq[s:e] = torch.einsum("hij,jhd->ihd", ds, k[s:e].float()) * scale
            dk[s:e] = torch.einsum("hij,ihd->jhd", ds, q[s:e].float()) * scale
            dv[s:e] = torch.einsum("hij,ihd->jhd", pr, g)
        return dq.to(q.dtype), dk.to(q.dtype), dv.to(q.dtype)


    # Dense rows (csrc/kernels/dense_rows.h): a few queries against every key, fp32.
    def dense_rows_fwd(self, qg, k, v, scale):
        assert qg.dtype in (torch.float16, torch.bfloat16) and k.dtype == v.dtype == qg.dtype
        assert 1 <= qg.size(1) <= 32 and qg.size(-1) in (32, 64, 128) and k.shape == v.shape
        self.calls.append("dense_rows_fwd")
        s = torch.einsum("bghd,blhd->bhgl", qg.float(), k.float()) * scale
        lse = torch.logsumexp(s, -1)                                            # [B, H, G]
        og = torch.einsum("bhgl,blhd->bghd", torch.softmax(s, -1), v.float())
        return og.contiguous(), lse.contiguous()

    def dense_rows_bwd(self, dog, qg, k, v, og, lse, scale):
        self.calls.append("dense_rows_bwd")
        assert og.dtype == lse.dtype == torch.float32 and lse.shape == (qg.size(0), qg.size(2), qg.size(1))
        q32, k32, v32, g32 = qg.float(), k.float(), v.float(), dog.float()
        p = torch.exp(torch.einsum("bghd,blhd->bhgl", q32, k32) * scale - lse.unsqueeze(-1))
        dp = torch.einsum("bghd,blhd->bhgl", g32, v32)
        delta = (g32 * og).sum(-1).transpose(1, 2).unsqueeze(-1)                # [B, H, G, 1]
        ds = p * (dp - delta)
        dq = torch.einsum("bhgl,blhd->bghd", ds, k32) * scale
        dk = torch.einsum("bhgl,bghd->blhd", ds, q32) * scale
        dv = torch.einsum("bhgl,bghd->blhd", p, g32)
        return dq.to(qg.dtype).contiguous(), dk.to(qg.dtype).contiguous(), dv.to(qg.dtype).contiguous()


def seq_mask_of(code: list[int]):
    """The mask a sequence kernel's int list describes (masks.kernel_code)."""
    from gt_fused3s.sequence.masks import BlockDilated, Dilated, Global, Local, RandomBlocks, Union
    n = code[1]
    tokens = tuple(code[3 + 5 * n:3 + 5 * n + code[2 + 5 * n]])
    parts = []
    for kind, a, b, c, _ in (code[2 + 5 * i:7 + 5 * i] for i in range(n)):
        parts.append({1: lambda: Local(a, right=b), 2: lambda: Dilated(a, c, right=b),
                      3: lambda: BlockDilated(a, b, offset=c), 4: lambda: Global(tokens),
                      5: lambda: RandomBlocks(a, b, seed=c % 2 ** 32)}[kind]())
    return Union(*parts)


def _check_seq(q, k, v, cu, cu_windows, code, scale, num_windows, block_rows, backward):
    from gt_fused3s.ops import SEQ_HEAD_DIMS, seq_block_rows, seq_windows
    assert q.dtype in (torch.float16, torch.bfloat16) and q.size(-1) in SEQ_HEAD_DIMS
    assert k.dtype == v.dtype == q.dtype and k.shape == v.shape == q.shape
    assert scale >= 0, "the kernels take the row max of raw scores: scale >= 0"
    assert cu.dtype == cu_windows.dtype == torch.int32 and int(cu[0]) == 0 and int(cu[-1]) == q.size(0)
    assert block_rows == seq_block_rows(q.size(-1), backward)
    assert torch.equal(cu_windows, seq_windows(cu, code[0], block_rows))
    assert num_windows >= int(cu_windows[-1])


def _seq_docs(q, k, cu, code, scale):
    """(start, end, masked scores [H, L, L] fp32) per document."""
    mask = seq_mask_of(code)
    cu = cu.tolist()
    for s, e in zip(cu, cu[1:]):
        i = torch.arange(e - s)
        on = mask.allowed(i[:, None], i[None, :], e - s)
        sc = torch.einsum("ihd,jhd->hij", q[s:e].float(), k[s:e].float()) * scale
        yield s, e, sc.masked_fill(~on, float("-inf"))


def _probs(scores, lse):
    """exp(scores - lse), 0 where a query has no key."""
    return torch.exp(scores - lse.T.unsqueeze(-1)).nan_to_num(0.0)


def _check_f32(*ts) -> None:
    for t in ts:
        assert t.dtype == torch.float32 and t.is_contiguous(), "the edge-term kernels take fp32 contiguous"


def install(monkeypatch) -> StandIns:
    """Register the stand-ins as the ops' CPU kernels (removed when the test
    ends) and route CPU tensors through the kernel path."""
    import gt_fused3s._build as build_mod
    import gt_fused3s.graph as graph_mod
    import gt_fused3s.ops as ops_mod
    import gt_fused3s.schedule as schedule_mod

    stand_ins = StandIns()
    lib = torch.library.Library("gt_fused3s", "IMPL")
    for name in ("fwd", "fwd_scores", "bwd", "fwd8", "bwd8", "bsb_build", "edge_slots", "work_schedule",
                 "edge_dot", "edge_rows", "edge_scatter", "edge_probs", "gather_rows", "seq_fwd", "seq_bwd",
                 "dense_rows_fwd", "dense_rows_bwd"):
        lib.impl(name, getattr(stand_ins, name), "CPU")
    monkeypatch.setattr(ops_mod, "kernel_available", lambda device: True)
    monkeypatch.setattr(ops_mod, "_use_kernel", lambda q: True)
    monkeypatch.setattr(graph_mod, "_op_build_available", lambda device: True)
    monkeypatch.setattr(build_mod, "load_extension", lambda: torch.ops.gt_fused3s)
    monkeypatch.setattr(schedule_mod, "_num_sms", lambda device: 132)
    stand_ins.lib = lib
    return stand_ins
