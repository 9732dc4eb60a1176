"""Sequence attention benchmark: ``sequence_attention`` with implicit masks
against FlexAttention (a BlockMask built from kv block lists, compiled, so it
never falls back to eager) and dense SDPA (flash, no mask: the cost of
ignoring sparsity), side by side in one process on one GPU; forward, and
with ``backward`` forward + backward against Flex's (for local and dilated
masks at every length, their query block lists made from the transposed
mask; for the others up to a length where Flex's own transposition of the
block lists fits).

Global rows (a few queries that attend to every key) are computed apart in
``sequence_attention`` (chunked fp32 matmuls); the Flex runs get the same
call added, so both sides compute the same thing at the same cost. Each row also reports the max |difference|
between our output and Flex's.

Ours and Flex's calls are timed in alternating rounds
(:func:`~gt_fused3s.bench.timing.time_side_by_side`): an H100 at its power
cap slows its clock within a second of load, so a call timed first would
read faster than the same call timed second.
"""
from __future__ import annotations

import math

import torch

from ..sequence import Dilated, Global, Local, RandomBlocks, sequence_attention
from ..sequence.attention import _dense_rows
from ..sequence.masks import Union, as_mask
from .common import free_cuda_memory, guarded, short_error
from .timing import kernel_time, time_cuda, time_side_by_side

FLEX_BLOCK = 128


def make_mask(kind: str, L: int, keys: int, *, dilation: int = 2, global_tokens: int = 3,
              density: float = 0.001, block: int = 128, seed: int = 0):
    """The benchmark's masks: ``keys`` keys per query in the local / dilated
    window (the paper's Table III counts), Longformer / BigBird as in its
    Fig. 6 (window 50 each side, 3 global tokens, random density 0.001)."""
    w = (keys - 1) // 2
    if kind == "local":
        return Local(w)
    if kind == "dilated":
        return Dilated(w, dilation)
    if kind == "longformer":
        return Local(w) | Global(global_tokens)
    if kind == "dilated_global":
        return Dilated(w, dilation) | Global(global_tokens)
    if kind == "bigbird":
        return Local(w) | Global(global_tokens) | RandomBlocks.from_density(density, L, block, seed)
    raise ValueError(f"unknown mask kind {kind!r}")


def _flex_pieces(mask, L: int, device, square: bool = False, rows_are_keys: bool = False):
    """mask_mod and kv block lists (partial and full) of the mask over
    query/key blocks of FLEX_BLOCK (global rows excluded: computed apart).
    square: lists as wide as the number of key blocks, which Flex's
    transposition for the backward (compute_q_blocks) assumes (narrower lists
    index out of bounds there: a device-side assert, measured on an H100).
    rows_are_keys: the mask is a transposed one (its row blocks are key
    blocks, its column blocks query blocks): a short key block is never full,
    a short query block may be."""
    parts = as_mask(mask).parts()
    BS = FLEX_BLOCK
    nb = -(-L // BS)
    qb = torch.arange(nb, device=device)
    lo_row, hi_row = qb * BS, torch.clamp(qb * BS + BS - 1, max=L - 1)
    left = right = 0
    dil = 1
    mods = []
    gl = None
    rand = None
    for p in parts:
        if isinstance(p, Local):
            left, right = max(left, p.left), max(right, p.right)
            mods.append(lambda b, h, q, kv, p=p: ((kv - q) >= -p.left) & ((kv - q) <= p.right))
        elif isinstance(p, Dilated):
            left, right, dil = max(left, p.left * p.dilation), max(right, p.right * p.dilation), p.dilation
            mods.append(lambda b, h, q, kv, p=p: ((kv - q) % p.dilation == 0) & ((kv - q) >= -p.left * p.dilation)
                        & ((kv - q) <= p.right * p.dilation))
        elif isinstance(p, Global):
            if p.tokens != tuple(range(len(p.tokens))):
                raise ValueError("the Flex baseline takes the first n tokens as global tokens")
            gl = torch.tensor(p.tokens, device=device)
            mods.append(lambda b, h, q, kv, g=len(p.tokens): kv < g)
        elif isinstance(p, RandomBlocks):
            if p.block != BS:
                raise ValueError(f"the Flex baseline takes random blocks of {BS}")
            rand_lists = [p.key_blocks(b, nb) for b in range(nb)]
            table = torch.zeros(nb, nb, dtype=torch.bool)   # for mask_mod (BigBird runs at <= 1M tokens)
            for b, kbs in enumerate(rand_lists):
                table[b, kbs] = True
            rand = table.to(device)
            mods.append(lambda b, h, q, kv, t=rand: t[q // BS, kv // BS])

    def mask_mod(b, h, q, kv):
        out = mods[0](b, h, q, kv)
        for m in mods[1:]:
            out = out | m(b, h, q, kv)
        return out

    # band blocks of each query block; full where every (q, kv) is inside a
    # plain (dilation 1) band
    first = torch.clamp((lo_row - left) // BS, min=0)
    last = torch.clamp((hi_row + right) // BS, max=nb - 1)
    width = int((last - first).max()) + 1
    cand = first[:, None] + torch.arange(width, device=device)[None, :]
    in_band = cand <= last[:, None]
    full = in_band & (dil == 1) & (cand * BS - hi_row[:, None] >= -left) & \
        (torch.clamp(cand * BS + BS - 1, max=L - 1) - lo_row[:, None] <= right) & \
        ((qb * BS + BS <= L)[:, None] if rows_are_keys else (cand * BS + BS <= L))   # (the key block not short)
    # Candidate kv blocks per query block, O(nb x width) (never [nb, nb]):
    # the band's, the global columns' and the random blocks', with a
    # duplicate kept once (full wins).
    cols, fulls = [torch.where(in_band, cand, nb)], [full]
    if gl is not None:
        g = (gl // BS).unique()
        cols.append(g[None, :].expand(nb, -1))
        fulls.append(torch.zeros(nb, g.numel(), dtype=torch.bool, device=device))
    if rand is not None:
        r = torch.stack([torch.tensor(rb_list, device=device) for rb_list in rand_lists])
        cols.append(r)
        fulls.append(r * BS + BS <= L)   # a random block is wholly allowed (but a last, short one)
    col, isfull = torch.cat(cols, 1), torch.cat(fulls, 1)
    key = col * 2 + (~isfull).long()              # a full entry sorts before its partial twin
    key, order = key.sort(1)
    col, isfull = col.gather(1, order), isfull.gather(1, order)
    dup = torch.zeros_like(isfull)
    dup[:, 1:] = col[:, 1:] == col[:, :-1]
    keep = (col < nb) & ~dup
    part_sel, full_sel = keep & ~isfull, keep & isfull
    # Both lists with one width: Flex's kernel reads the full list with the
    # partial list's row stride (lists of different widths gave wrong rows).
    width = max(1, int(part_sel.sum(1).max()), int(full_sel.sum(1).max()))

    def lists(sel):
        num = sel.sum(1).to(torch.int32)
        first = torch.argsort((~sel).to(torch.int8), dim=1, stable=True)[:, :width]
        idx = torch.where(torch.arange(width, device=device)[None, :] < num[:, None], col.gather(1, first), 0)
        if square and width < nb:
            idx = torch.nn.functional.pad(idx, (0, nb - width))
        return num[None, None], idx.to(torch.int32)[None, None].contiguous()
    return mask_mod, lists(part_sel), lists(full_sel)


def transposed(mask):
    """The mask of the transposed pattern (rows: keys) where its parts are
    local or dilated windows (their sides swapped), else None: the query
    block lists of Flex's backward are the key block lists of this mask."""
    parts = as_mask(mask).parts()
    if not all(isinstance(p, (Local, Dilated)) for p in parts):
        return None
    out = [Local(p.right, right=p.left) if isinstance(p, Local) else Dilated(p.right, p.dilation, right=p.left)
           for p in parts]
    return out[0] if len(out) == 1 else Union(*out)


def flex_runner(mask, L: int, H: int, device, backward: bool = False):
    from torch.nn.attention.flex_attention import BlockMask, flex_attention
    import torch._dynamo
    torch._dynamo.config.recompile_limit = 1000
    torch._dynamo.config.cache_size_limit = 1000
    tmask = transposed(mask) if backward else None
    if tmask is not None:
        # the backward's query block lists from the transposed mask: O(nb x
        # width), where Flex's own transposition (compute_q_blocks) goes
        # through [nb, nb] lists (out of memory past about 4M tokens)
        mask_mod, (kn, ki), (fn, fi) = _flex_pieces(mask, L, device)
        _, (qn, qi), (fqn, fqi) = _flex_pieces(tmask, L, device, rows_are_keys=True)
        bm = BlockMask(seq_lengths=(L, L), kv_num_blocks=kn, kv_indices=ki, full_kv_num_blocks=fn,
                       full_kv_indices=fi, q_num_blocks=qn, q_indices=qi, full_q_num_blocks=fqn,
                       full_q_indices=fqi, BLOCK_SIZE=(FLEX_BLOCK, FLEX_BLOCK), mask_mod=mask_mod)
    else:
        mask_mod, (kn, ki), (fn, fi) = _flex_pieces(mask, L, device, square=backward)
        # compute_q_blocks: the transposed lists, which only the backward
        # reads, need [nb, nb] lists: only where a backward is timed
        bm = BlockMask.from_kv_blocks(kn, ki, fn, fi, BLOCK_SIZE=FLEX_BLOCK, mask_mod=mask_mod, seq_lengths=(L, L),
                                      compute_q_blocks=backward)
    compiled = torch.compile(flex_attention, dynamic=False)
    return lambda q, k, v: compiled(q, k, v, block_mask=bm)   # q, k, v: [B, H, L, D]


def global_rows(out, q, k, v, rows):
    """The global rows of a Flex output [B, H, L, D], computed as
    sequence_attention computes them (the same code and cost)."""
    if not rows:
        return out
    idx = torch.tensor(rows, device=q.device)
    qg, kt, vt = (x.transpose(1, 2) for x in (q.index_select(2, idx), k, v))   # [B, L, H, D]
    og = _dense_rows(qg, kt, vt, 1.0 / math.sqrt(q.size(-1)))
    return out.index_copy(2, idx, og.transpose(1, 2).to(out.dtype))


def _time_with_flex(row: dict, ours, make_flex, diff_key: str, note_key: str, device, max_reps: int) -> dict:
    """Ours and Flex's call timed side by side (:func:`time_side_by_side`).
    ``make_flex()`` (None: ours alone) builds Flex's call (its own copies of
    the inputs, which only that call holds) and returns it with its largest
    difference from ours; Flex's own failure (compile, memory) is a result
    in ``note_key``.
    Where both do not fit in memory at once, one after the other, Flex's
    call rebuilt after ours was timed alone (noted)."""
    calls = {"ours": ours}
    if make_flex is not None:
        try:
            calls["flex"], row[diff_key] = make_flex()
        except Exception as e:   # Flex's own failure (memory, compile) is a result
            row[note_key] = short_error(e)
    try:
        return time_side_by_side(calls, max_reps=max_reps)
    except torch.OutOfMemoryError:
        if "flex" not in calls:
            raise
    del calls["flex"]
    free_cuda_memory(device)
    t = time_side_by_side(calls, max_reps=max_reps)
    try:
        t.update(time_side_by_side({"flex": make_flex()[0]}, max_reps=max_reps))
        row[note_key] = "timed one after the other (not both in memory at once)"
    except Exception as e:
        row[note_key] = short_error(e)
    free_cuda_memory(device)
    return t


def _forward_backward(row: dict, q, k, v, mask, L: int, H: int, flex: bool, flex_max: int) -> None:
    """Forward + backward (input gradients of one random output gradient):
    ours (the fused backward kernel; its own GPU time too) and Flex's, where
    its transposed block lists fit (L <= flex_max, for masks whose query
    block lists are not made from the transposed mask); the largest
    difference of the gradients (ours - Flex's)."""
    device = q.device
    leaves = [x.detach().requires_grad_() for x in (q, k, v)]
    g = torch.randn_like(q)
    ours = lambda: torch.autograd.grad(sequence_attention(*leaves, mask), leaves, g)   # noqa: E731
    got, err = guarded(ours, device)
    if err:
        row["note"] = "ours forward + backward: " + err
        return

    def make_flex():
        tl = [x.detach().transpose(1, 2).contiguous().requires_grad_() for x in (q, k, v)]
        gt = g.transpose(1, 2).contiguous()
        run = flex_runner(mask, L, H, device, backward=True)
        rows = as_mask(mask).global_rows(L)
        fl = lambda: torch.autograd.grad(global_rows(run(*tl), *tl, rows), tl, gt)   # noqa: E731
        return fl, max(float((a.transpose(1, 2) - b).abs().max()) for a, b in zip(fl(), got))

    with_flex = flex and (L <= flex_max or transposed(mask) is not None)
    t = _time_with_flex(row, ours, make_flex if with_flex else None, "max_grad_diff_vs_flex", "flex_fb_note",
                        device, max_reps=30)
    row["ours_fb_ms"] = t["ours"]["median"]
    if "flex" in t:
        row["flex_fb_ms"] = t["flex"]["median"]
        row["speedup_fb_vs_flex"] = row["flex_fb_ms"] / row["ours_fb_ms"]
    # the backward's kernels (the band backward, by key or by query blocks,
    # and their prep) and every kernel of the call (the forward's and the casts included)
    row["ours_bwd_kernel_ms"] = kernel_time(ours, name=("seq_bwd", "seq_band_bwd"), reps=3, flush=False)
    row["ours_fb_kernel_ms"] = kernel_time(ours, name="", reps=3, flush=False)


def bench_case(kind: str, L: int, keys: int, *, D: int = 64, H: int = 1, dtype=torch.float16,
               flex: bool = True, dense_max: int = 262144, paper_s: float | None = None,
               explicit_max_edges: int = 1 << 26, backward: bool = False,
               flex_backward_max: int = 1 << 20) -> dict:
    device = torch.device("cuda")
    mask = make_mask(kind, L, keys)
    row = {"mask": kind, "L": L, "keys": keys, "D": D, "H": H, "dtype": str(dtype).replace("torch.", ""),
           "paper_A100_s": paper_s}
    kpq = keys if kind in ("local", "dilated") else as_mask(mask).keys_per_query(min(L, 1 << 16))
    row["keys_per_query"] = round(kpq, 1)
    free_cuda_memory(device)
    q, k, v = (torch.randn(1, L, H, D, device=device, dtype=dtype) for _ in range(3))
    ours = lambda: sequence_attention(q, k, v, mask)   # noqa: E731
    out, err = guarded(ours, device)
    if err:
        row["note"] = "ours: " + err
        return row

    def make_flex():
        qt, kt, vt = (x.transpose(1, 2).contiguous() for x in (q, k, v))
        run = flex_runner(mask, L, H, device)
        rows = as_mask(mask).global_rows(L)
        fl = lambda: global_rows(run(qt, kt, vt), qt, kt, vt, rows)   # noqa: E731
        return fl, float((fl().transpose(1, 2) - out).abs().max())

    t = _time_with_flex(row, ours, make_flex if flex else None, "max_diff_vs_flex", "flex_note", device,
                        max_reps=50)
    row["ours_ms"] = t["ours"]["median"]
    if "flex" in t:
        row["flex_ms"] = t["flex"]["median"]
        row["speedup_vs_flex"] = row["flex_ms"] / row["ours_ms"]
    row["ours_kernel_ms"] = kernel_time(ours, name=("seq_fwd_kernel", "seq_band_fwd_kernel"), reps=3, flush=False)
    # every kernel of the call (the global rows' too): against ours_ms, how
    # host-bound the call is (or how the clock moved: time_side_by_side)
    row["ours_all_kernel_ms"] = kernel_time(ours, name="", reps=3, flush=False)
    row["ours_tflops"] = 4 * L * H * kpq * D / (row["ours_ms"] * 1e-3) / 1e12
    if kind == "local" and L * keys <= explicit_max_edges:
        # the same band as an explicit edge_index through the graph kernel:
        # its format build and its forward
        from .. import GraphPlan, fused3s_attention
        i = torch.arange(L, device=device)
        off = torch.arange(-(keys // 2), keys // 2 + 1, device=device)
        j = i[:, None] + off[None, :]
        ok = (j >= 0) & (j < L)
        ei = torch.stack([j[ok], i[:, None].expand_as(j)[ok]])
        build = lambda: GraphPlan.from_edge_index(ei, L).prepare(heads=H, head_dim=D)   # noqa: E731
        row["explicit_build_ms"] = time_cuda(build, min_reps=2, max_reps=5, budget_ms=500, flush=False)["median"]
        plan = build()
        qe, ke, ve = (x[0] for x in (q, k, v))
        ex = lambda: fused3s_attention(qe, ke, ve, plan)   # noqa: E731
        row["explicit_ms"] = time_cuda(ex, min_reps=3, max_reps=50, budget_ms=1000, flush=False)["median"]
        row["explicit_max_diff"] = float((ex() - out[0]).abs().max())
        del ei, plan, j, ok
    if L <= dense_max:
        qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
        dn = lambda: torch.nn.functional.scaled_dot_product_attention(qt, kt, vt)   # noqa: E731
        row["dense_sdpa_ms"] = time_cuda(dn, min_reps=3, max_reps=20, budget_ms=2000, flush=False)["median"]
    if paper_s:
        row["speedup_vs_paper"] = paper_s * 1e3 / row["ours_ms"]
    if backward:
        _forward_backward(row, q, k, v, mask, L, H, flex, flex_backward_max)
    return row


COLUMNS = ["mask", "L", "keys", "keys_per_query", "D", "H", "dtype", "ours_ms", "ours_kernel_ms", "ours_all_kernel_ms",
           "ours_tflops",
           "flex_ms", "speedup_vs_flex", "dense_sdpa_ms", "explicit_ms", "explicit_build_ms", "explicit_max_diff", "paper_A100_s", "speedup_vs_paper", "max_diff_vs_flex",
           "flex_note", "ours_fb_ms", "ours_bwd_kernel_ms", "ours_fb_kernel_ms", "flex_fb_ms", "speedup_fb_vs_flex",
           "max_grad_diff_vs_flex", "flex_fb_note", "note"]


def fmt(row: dict) -> str:
    def f(key, spec):
        x = row.get(key)
        return format(x, spec) if isinstance(x, (int, float)) and not (isinstance(x, float) and math.isnan(x)) \
            else "-"
    return (f"{row['mask']:<15}{row['L']:>11} {f('keys_per_query', '>8.0f')} {f('ours_ms', '>10.3f')} "
            f"{f('ours_kernel_ms', '>9.3f')} {f('ours_all_kernel_ms', '>9.3f')} {f('ours_tflops', '>7.0f')} "
            f"{f('flex_ms', '>10.3f')} "
            f"{f('speedup_vs_flex', '>7.2f')} {f('dense_sdpa_ms', '>10.2f')} {f('speedup_vs_paper', '>9.0f')} "
            f"{f('max_diff_vs_flex', '>9.1e')} {f('explicit_ms', '>9.3f')} {f('explicit_build_ms', '>9.2f')}"
            + (f" | fwd+bwd {f('ours_fb_ms', '>9.3f')} bwd kern {f('ours_bwd_kernel_ms', '>9.3f')} "
               f"all kern {f('ours_fb_kernel_ms', '>9.3f')} "
               f"flex {f('flex_fb_ms', '>9.3f')} vs flex {f('speedup_fb_vs_flex', '>6.2f')} "
               f"|dgrad| {f('max_grad_diff_vs_flex', '>8.1e')}" if "ours_fb_ms" in row else "")
            + f"  {row.get('flex_note') or row.get('flex_fb_note') or row.get('note') or ''}")


HEADER = (f"{'mask':<15}{'L':>11} {'keys/q':>8} {'ours ms':>10} {'kern ms':>9} {'all kern':>9} {'TF/s':>7} "
          f"{'flex ms':>10} "
          f"{'vs flex':>7} {'dense ms':>10} {'vs paper':>9} {'|diff|':>9} {'edges ms':>9} {'build ms':>9}")


def probe_max_length(lengths, keys: int = 1601, D: int = 64, dtype=torch.float16) -> list[dict]:
    """The longest of ``lengths`` (tried longest first) whose forward with a
    local window of ``keys`` keys runs on this GPU (q, k, v and out
    resident), with its time; the longer ones' errors."""
    device = torch.device("cuda")
    rows = []
    for L in sorted(lengths, reverse=True):
        free_cuda_memory(device)
        row = {"mask": "local", "L": L, "keys": keys, "keys_per_query": keys, "D": D, "H": 1,
               "dtype": str(dtype).replace("torch.", "")}
        try:
            q, k, v = (torch.randn(1, L, 1, D, device=device, dtype=dtype) for _ in range(3))
            mask = Local((keys - 1) // 2)
            fn = lambda: sequence_attention(q, k, v, mask)   # noqa: E731
            fn()
            row["ours_ms"] = time_cuda(fn, min_reps=2, max_reps=3, budget_ms=1, flush=False)["median"]
            row["ours_tflops"] = 4 * L * keys * D / (row["ours_ms"] * 1e-3) / 1e12
            rows.append(row)
            break
        except torch.OutOfMemoryError as e:
            row["note"] = short_error(e)
            rows.append(row)
        finally:
            q = k = v = None
    return rows
