"""``sequence_attention``: sparse attention over sequences with a structured
mask computed inside the kernel (masks.py), batched [B, L, H, D] or packed
documents [T, H, D] with ``cu_seqlens``.

The forward runs the fused kernel on CUDA (fp16 / bf16; fp32 is computed in
fp16 and returned in fp32). Global rows (queries that attend to every key)
are a dense product of a few queries with all keys: they are computed apart
(on a GPU by the dense-rows kernels, keys split over thread blocks; else
fp32 matmuls by chunks of keys) and written over the kernel's rows; an
eager batched call on a GPU does all of it, and the backward, in one C++
autograd node (the op ``seq_attention_eager``). The backward is fused too (the
gradients from the forward's log-sum-exp over the same key tiles); the
global rows' share goes through the dense rows' backward (their rows of the
kernel's output were overwritten: no gradient reaches the kernel there). On
the CPU everything runs the reference.
"""
from __future__ import annotations

import functools
import math
import os
import warnings

import torch
from torch import Tensor

from .. import ops
from ..graph import _in_capture_or_compile
from ..reference import sequence_reference
from .masks import Mask, as_mask, kernel_code

_KERNEL_DIMS = ops.SEQ_HEAD_DIMS


def _check(q: Tensor, k: Tensor, v: Tensor, cu_seqlens: Tensor | None) -> None:
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, Tensor) or not t.is_floating_point():
            raise ValueError(f"{name} must be a floating-point tensor")
    want = 3 if cu_seqlens is not None else 4
    form = "[T, H, D] with cu_seqlens" if cu_seqlens is not None else "[B, L, H, D]"
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dim() != want:
            raise ValueError(f"{name} must have shape {form} (got {tuple(t.shape)})")
    if k.shape != q.shape or v.shape[:-1] != q.shape[:-1]:
        raise ValueError(f"q, k, v must share their shape (got q {tuple(q.shape)}, k {tuple(k.shape)}, "
                         f"v {tuple(v.shape)})")
    if v.size(-1) != q.size(-1):
        raise ValueError(f"v must have q's head dim {q.size(-1)} (got {v.size(-1)})")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k, v must be on one device (got {q.device}, {k.device}, {v.device})")
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"q, k, v must share one dtype (got {q.dtype}, {k.dtype}, {v.dtype})")
    if q.size(-2) < 1 or q.size(-1) < 1:
        raise ValueError(f"q needs at least one head and a head dim >= 1 (got {tuple(q.shape)})")
    if cu_seqlens is not None:
        if not isinstance(cu_seqlens, Tensor) or cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2 \
                or cu_seqlens.is_floating_point():
            raise ValueError("cu_seqlens must be an integer tensor [num_docs + 1] of document offsets")


def _host_offsets(cu_seqlens: Tensor, T: int) -> list[int]:
    cu = [int(x) for x in cu_seqlens.tolist()]   # a host sync (the reference and varlen global rows only)
    if cu[0] != 0 or cu[-1] != T or any(b < a for a, b in zip(cu, cu[1:])):
        raise ValueError(f"cu_seqlens must rise from 0 to the {T} tokens (got {cu[:4]}...{cu[-2:]})")
    return cu


@functools.lru_cache(maxsize=64)
def _code_of(mask: Mask) -> list[int]:
    return kernel_code(mask)


@functools.lru_cache(maxsize=64)
def _mask_of(mask: Mask) -> Mask:
    """as_mask(mask), made once per mask (a Union of one part per call was
    5 us of a 44 us call's host time, CPU, stub kernels)."""
    return as_mask(mask)


def _cached_mask(mask: Mask) -> Mask:
    try:
        return _mask_of(mask)
    except TypeError:   # a mask class of the caller's that is not hashable
        return as_mask(mask)


def _cached(cache: dict, key: tuple, make):
    """``cache[key]``, made by ``make()`` on a miss and kept (the oldest of
    more than 256 entries dropped), except while torch.compile traces or a
    CUDA graph is captured: a tensor the graph makes and a global keeps
    would be the graph's output, which CUDA graphs (``mode="reduce-overhead"``)
    overwrite at the next replay (and a captured one is not even computed
    until a replay), so such a miss is made for the call only (a few small
    kernels, replayed with the graph); an entry an eager call made is read.
    Made outside inference mode: an inference tensor made by a first call
    under ``torch.inference_mode`` could not be saved by a later training
    call's autograd node."""
    got = cache.get(key)
    if got is None:
        with torch.inference_mode(False):   # kept for calls that save it for a backward
            got = make()
        if not _in_capture_or_compile():
            cache[key] = got
            if len(cache) > 256:
                cache.pop(next(iter(cache)))
    return got


_OFFSETS: dict[tuple, tuple[Tensor, Tensor, Tensor]] = {}


def _batch_offsets(B: int, L: int, stride: int, D: int, device: torch.device) -> tuple[Tensor, Tensor, Tensor]:
    """cu_seqlens, and cu_windows of the forward's and of the backward's row
    blocks, of B sequences of L tokens (compiled head dim D), made once per
    shape: a call then launches the kernels only (the backward's windows
    were 15 small ops of each backward)."""
    def make():
        cu = torch.arange(0, B + 1, device=device, dtype=torch.int32) * L
        return (cu, ops.seq_windows(cu, stride, ops.seq_block_rows(D)),
                ops.seq_windows(cu, stride, ops.seq_block_rows(D, backward=True)))
    return _cached(_OFFSETS, (B, L, stride, D, device), make)


def _kernel_fits(q: Tensor) -> bool:
    return (ops.kernel_available(q.device) and q.size(-1) <= _KERNEL_DIMS[-1]
            and q.size(-1) % 8 == 0)


_LOW_BMM: list[bool] = []     # [whether torch.bmm takes out_dtype here], found on first use


def _low_precision_bmm(a: Tensor, b: Tensor) -> Tensor | None:
    """``a @ b`` (fp16 / bf16, batched) accumulated and returned in fp32, as
    the kernel's mma does; None where this torch has no ``bmm(out_dtype=)``."""
    if _LOW_BMM == [False]:
        return None
    try:
        out = torch.bmm(a, b, out_dtype=torch.float32)
    except (TypeError, RuntimeError, NotImplementedError):
        _LOW_BMM[:] = [False]
        return None
    _LOW_BMM[:] = [True]
    return out


def _dense_rows(qg: Tensor, k: Tensor, v: Tensor, scale: float, chunk: int = 1 << 20) -> Tensor:
    """Softmax attention of a few queries qg [B, g, H, D] over all of k, v
    [B, L, H, D]: fp32 scores, by chunks of keys merged as in the online
    softmax (memory O(g x chunk)). Without autograd, fp16 / bf16 operands
    on a GPU stay in their dtype (the kernel's precision: fp32 scores and sums, P rounded to
    the operands' dtype for P V): the fp32 copies of K and V were the rows'
    whole cost (0.86 ms at 1M keys, 3.5 ms at 4M on an H100)."""
    if ops.dense_rows_fit(qg, k, v):   # the keys split over thread blocks (csrc/kernels/dense_rows.cu)
        return ops.dense_rows(qg, k, v, scale)
    B, g, H, D = qg.shape
    # (not under autograd: the packed-document gradient test failed through bmm(out_dtype=); the
    # fp32 path's gradients are the tested ones)
    grad = torch.is_grad_enabled() and (qg.requires_grad or k.requires_grad or v.requires_grad)
    low = (qg.is_cuda and qg.dtype in (torch.float16, torch.bfloat16) and k.dtype == v.dtype == qg.dtype
           and not grad)
    qh = qg.permute(0, 2, 1, 3).reshape(B * H, g, D)                     # [B H, g, D]
    m = l = o = None
    for c0 in range(0, k.size(1), chunk):
        s = pv = None
        if low:
            kc = k[:, c0:c0 + chunk].permute(0, 2, 3, 1)                  # [B, H, D, C] (a view)
            C = kc.size(-1)
            s = _low_precision_bmm(qh, kc.reshape(B * H, D, C))
        if s is not None:
            s = s.view(B, H, g, C) * scale
            vc = v[:, c0:c0 + chunk].permute(0, 2, 1, 3).reshape(B * H, C, D)
            pv = lambda p: _low_precision_bmm(p.to(v.dtype).reshape(B * H, g, C), vc).view(B, H, g, D)  # noqa: E731
        else:
            kc = k[:, c0:c0 + chunk].float().permute(0, 2, 3, 1)         # [B, H, D, C]
            vc = v[:, c0:c0 + chunk].float().permute(0, 2, 1, 3)         # [B, H, C, D]
            s = torch.matmul(qh.float().view(B, H, g, D), kc) * scale    # [B, H, g, C]
            pv = lambda p: torch.matmul(p, vc)  # noqa: E731
        mc = s.amax(-1, keepdim=True)
        if m is None:
            m = mc
            p = torch.exp(s - m)
            l, o = p.sum(-1, keepdim=True), pv(p)
        else:
            m_new = torch.maximum(m, mc)
            a = torch.exp(m - m_new)
            p = torch.exp(s - m_new)
            l = l * a + p.sum(-1, keepdim=True)
            o = o * a + pv(p)
            m = m_new
    return (o / l).permute(0, 2, 1, 3)                                    # [B, g, H, D]


_ROW_INDEX: dict[tuple, Tensor] = {}


def _row_index(rows: list[int], device: torch.device) -> Tensor:
    """The global rows as an index tensor on the device, made once per list:
    ``torch.tensor(rows, device=...)`` per call is a copy from pageable host
    memory, which waits for the kernels queued before it (the host then
    launched the dense rows' ops one by one behind an idle GPU)."""
    return _cached(_ROW_INDEX, (tuple(rows), device), lambda: torch.tensor(rows, device=device))


def _put_rows(out: Tensor, dim: int, idx: Tensor, rows: Tensor) -> Tensor:
    """out with rows idx (along dim) replaced: in place without autograd (a
    copy of the whole output was a third of the global rows' cost at 4M
    tokens), else out of place (the kernel's autograd saved out)."""
    if torch.is_grad_enabled() and out.requires_grad:
        return out.index_copy(dim, idx, rows)
    return out.index_copy_(dim, idx, rows)


def _global_rows_dense(q, k, v, out, rows: list[int], scale: float, cu: list[int] | None) -> Tensor:
    """Overwrite the global rows of out with dense attention over their document."""
    if cu is None:   # [B, L, H, D]: the batch at once
        idx = _row_index(rows, q.device)
        og = _dense_rows(q.index_select(1, idx), k, v, scale)
        return _put_rows(out, 1, idx, og.to(out.dtype))
    for d in range(len(cu) - 1):   # packed documents: one document at a time
        s0, L = cu[d], cu[d + 1] - cu[d]
        local = [r for r in rows if r < L]
        if not local:
            continue
        idx = _row_index(local, q.device) + s0
        og = _dense_rows(q.index_select(0, idx)[None], k[None, s0:s0 + L], v[None, s0:s0 + L], scale)[0]
        out = _put_rows(out, 0, idx, og.to(out.dtype))
    return out


# Repeated eager calls: (id(mask), q's shape, dtype, device, scale) -> (mask,
# the C++ op, its arguments after q, k, v, whether q is negated). A call of
# [B, L, H, D] operands that took the eager C++ op once takes it again with
# the arguments made then, after checks of k and v against q: on an H100
# machine the checks, caches and lookups of a first-time call were ~17-21 us
# of a 65k-token Longformer call's ~62 us of host time, above its kernels'
# ~49 us. The mask is held and compared by identity (equal masks made anew
# each call take the full path; hashing a Union per call was itself ~1 us).
# What the path decides from module constants (ops.DENSE_ROWS_MAX) is
# remembered too: a test that changes one empties this.
_REPEAT: dict[tuple, tuple] = {}


def _repeat_call(q: Tensor, k: Tensor, v: Tensor, mask, scale) -> Tensor | None:
    """The eager C++ op on the arguments a previous call made, or None where
    there is none for this call (or k, v do not match q, or the kernel was
    switched off since)."""
    shape, dtype, device = q.shape, q.dtype, q.device   # (each read makes an object: once)
    hit = _REPEAT.get((id(mask), shape, dtype, device, scale))
    if (hit is None or hit[0] is not mask or k.shape != shape or v.shape != shape or k.dtype != dtype
            or v.dtype != dtype or k.device != device or v.device != device
            or os.environ.get("GT_FUSED3S_DISABLE_KERNEL") == "1"):
        return None
    _, op, args, negate = hit
    return op(-q if negate else q, k, v, *args)


def _remember_call(q: Tensor, mask, scale, op, args: tuple, negate: bool) -> None:
    if _in_capture_or_compile():
        return
    _REPEAT[(id(mask), q.shape, q.dtype, q.device, scale)] = (mask, op, args, negate)
    if len(_REPEAT) > 256:
        _REPEAT.pop(next(iter(_REPEAT)))


def sequence_attention(q: Tensor, k: Tensor, v: Tensor, mask: Mask, scale: float | None = None, *,
                       cu_seqlens: Tensor | None = None) -> Tensor:
    """Softmax attention where query i of a document attends to the keys j
    that ``mask`` allows (positions within the document).

    Args:
        q, k, v: [B, L, H, D] (B sequences of L tokens), or [T, H, D] packed
            documents with ``cu_seqlens``.
        mask: a mask of ``gt_fused3s.sequence`` (Local, Dilated, BlockDilated,
            Global, RandomBlocks, or a union with ``|``).
        scale: score scale, default 1 / sqrt(D).
        cu_seqlens: int [num_docs + 1] token offsets of the documents
            (FlashAttention's varlen convention); documents never attend
            across each other.

    Returns:
        q's shape and dtype. Queries without keys give 0.

    Differentiable in q, k and v. On CUDA the backward is one fused kernel
    (memory O(L H D)); it adds gradients with fp32 atomics (the key and
    value gradients, or on Hopper at D = 64 for masks without global or
    random parts the query gradients), so they are not bitwise reproducible
    from run to run.
    """
    if cu_seqlens is None and not torch.compiler.is_compiling() and isinstance(q, Tensor):
        out = _repeat_call(q, k, v, mask, scale)
        if out is not None:
            return out
    _check(q, k, v, cu_seqlens)
    # (dynamo ignores an lru_cache and warns: traced code takes the function itself)
    umask = as_mask(mask) if torch.compiler.is_compiling() or not isinstance(mask, Mask) else _cached_mask(mask)
    D = q.size(-1)
    user_scale = scale   # (the repeat cache's key: as the caller gave it)
    scale = 1.0 / math.sqrt(D) if scale is None else float(scale)
    if not math.isfinite(scale):
        raise ValueError(f"scale must be finite (got {scale})")
    batched = cu_seqlens is None
    if batched:
        B, L, H, _ = q.shape
        T = B * L
    else:
        T = q.size(0)

    if not _kernel_fits(q):
        if q.is_cuda and q.size(-1) > _KERNEL_DIMS[-1]:
            warnings.warn(f"sequence_attention: head dim {D} > 128 runs the reference", RuntimeWarning)
        cu = list(range(0, B * L + 1, L)) if batched and L > 0 else \
            ([0, 0] if batched else _host_offsets(cu_seqlens, T))
        cdt = torch.float64 if q.dtype == torch.float64 else torch.float32
        qf, kf, vf = (t.reshape(T, t.size(-2), t.size(-1)) for t in (q, k, v))
        out = sequence_reference(qf, kf, vf, umask, cu, scale, compute_dtype=cdt)
        return out.reshape(q.shape)

    code = kernel_code(umask) if torch.compiler.is_compiling() else _code_of(umask)
    Dp = ops.seq_head_dim(D)
    stride, rows = code[0], ops.seq_block_rows(Dp)
    if batched:
        cu, cu_windows, bwd_windows = _batch_offsets(B, L, stride, Dp, q.device)
        num_windows = B * stride * (((L + stride - 1) // stride + rows - 1) // rows)
    else:
        cu = cu_seqlens.to(device=q.device, dtype=torch.int32)
        cu_windows = ops.seq_windows(cu, stride, rows)
        num_windows = (T + rows - 1) // rows + (cu.numel() - 1) * (2 * stride + 1)
        bwd_windows = None   # the backward makes its own (not every call has one)
    # The kernel takes the row max on raw scores (the scale folded into the
    # exponent), so it needs scale >= 0: q . k * s == (-q) . k * (-s).
    # (q, k, v go as they are: ops.seq_attention reads [B, L, H, D] as [B L, H, D])
    qs, ss = (q, scale) if scale >= 0 else (-q, -scale)
    global_rows = umask.global_rows(L if batched else 1 << 62)
    args = (cu, cu_windows, bwd_windows, code, ss, num_windows)   # (after q, k, v: the eager op's order)
    # one C++ op and autograd node (the kernel, the global rows where there
    # are some, both backwards), asked once
    eager = (batched and (not global_rows or len(global_rows) <= ops.DENSE_ROWS_MAX)
             and ops.seq_eager_fits(qs, k, v))
    if eager:
        if global_rows:   # their positions last (the dense-rows kernels write them over the kernel's)
            args += (_row_index(global_rows, q.device),)
        op = ops._op("seq_attention_eager")
        _remember_call(q, mask, user_scale, op, args, scale < 0)
        return op(qs, k, v, *args)
    out = ops.seq_attention(qs, k, v, cu, cu_windows, code, ss, num_windows, bwd_windows)
    if global_rows:
        return _global_rows_dense(q, k, v, out, global_rows, scale,
                                  None if batched else _host_offsets(cu_seqlens, T))
    return out
