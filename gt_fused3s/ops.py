"""Public functional API: ``fused3s_attention``.

CUDA tensors take the fused kernel (compiled on first use, see ``_build``);
CPU tensors, and CUDA tensors when the extension cannot be built or
``GT_FUSED3S_DISABLE_KERNEL=1`` is set, take the reference path of
``reference.py``, which computes the same function.
"""
from __future__ import annotations

import os
import warnings

import torch
from torch import Tensor

from .graph import BSBGraph, cached_bsb
from .reference import _check_qkv, attention_reference, default_scale
from .schedule import work_schedule

_SUPPORTED_HEAD_DIMS = (16, 32, 64, 128, 256)
_KERNEL_DTYPES = (torch.float16, torch.bfloat16)


def fused3s_attention(q: Tensor, k: Tensor, v: Tensor, graph: BSBGraph | Tensor,
                      scale: float | None = None, *, num_nodes: int | None = None,
                      out_dtype: torch.dtype | None = None,
                      compute_dtype: torch.dtype | None = None) -> Tensor:
    r"""Sparse graph attention fused into one kernel (SDDMM, softmax, SpMM).

    .. math::
        \mathbf{o}_{i,h} = \sum_{j \in \mathcal{N}(i)}
        \mathrm{softmax}_j\left(s \langle \mathbf{q}_{i,h}, \mathbf{k}_{j,h} \rangle\right)
        \mathbf{v}_{j,h}

    Args:
        q, k, v: [N, H, D] node queries, keys and values (fp16 or bf16 for
            the kernel; fp32 is accepted and computed in ``compute_dtype``).
        graph: a :class:`~gt_fused3s.graph.BSBGraph`, or an ``edge_index``
            [2, E] (source, destination) whose BSB is built once and cached
            for as long as that tensor lives.
        scale: the score scale :math:`s`, default ``1 / sqrt(D)``.
        num_nodes: with an ``edge_index``, the node count (default ``N``).
        out_dtype: dtype of the output, default ``q.dtype``.
        compute_dtype: operand precision of the kernel for fp32 inputs,
            ``torch.float16`` (default) or ``torch.bfloat16``.

    Returns:
        [N, H, D]; rows without in-neighbours are 0. Differentiable once
        (double backward raises): the kernel path's gradients come from the
        fused backward kernels, which recompute the scores from q, k and the
        forward's per-row log-sum-exp over the graph's BSB and its transpose
        (:meth:`BSBGraph.transposed`, built once per graph).
    """
    N, H, D = _check_qkv(q, k, v)
    if v.shape != q.shape:
        raise ValueError(f"v must have the shape of q {tuple(q.shape)} (got {tuple(v.shape)})")
    if isinstance(graph, Tensor):
        graph = cached_bsb(graph, N if num_nodes is None else num_nodes)
    elif not isinstance(graph, BSBGraph):
        raise ValueError(f"graph must be a BSBGraph or an edge_index tensor (got {type(graph).__name__})")
    graph.check_nodes(N)
    if graph.device != q.device:
        raise ValueError(f"graph is on {graph.device} but q, k, v are on {q.device}; "
                         f"move it once with graph.to(q.device)")
    scale = default_scale(D) if scale is None else float(scale)
    out_dtype = out_dtype or q.dtype
    if compute_dtype is not None and compute_dtype not in _KERNEL_DTYPES:
        raise ValueError(f"compute_dtype must be torch.float16 or torch.bfloat16 (got {compute_dtype})")

    if not _use_kernel(q):
        return attention_reference(q, k, v, graph.edge_index, scale, out_dtype=out_dtype)
    _check_kernel_inputs(q, k, v)
    if torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)):
        return _differentiable_kernel(q, k, v, graph, scale, out_dtype, compute_dtype)
    return _kernel_forward(q, k, v, _forward_arrays(graph, q), scale, out_dtype, compute_dtype)[0]


def _use_kernel(q: Tensor) -> bool:
    if not q.is_cuda or os.environ.get("GT_FUSED3S_DISABLE_KERNEL") == "1":
        return False
    from ._build import extension_available
    if extension_available():
        return True
    warnings.warn("gt_fused3s: the CUDA extension is unavailable, CUDA tensors take the "
                  "reference path (see gt_fused3s._build.load_extension() for the reason)",
                  RuntimeWarning, stacklevel=3)
    return False


def padded_head_dim(head_dim: int) -> int:
    """The head dim the kernel runs for ``head_dim`` (zero-padded up to it)."""
    return next(d for d in _SUPPORTED_HEAD_DIMS if d >= head_dim)


def kernel_accepts(head_dim: int, dtype: torch.dtype) -> bool:
    """Whether the fused CUDA kernel takes features of this head dim and dtype
    (the layers send what it does not take to their unfused path)."""
    return (head_dim % 8 == 0 and head_dim <= _SUPPORTED_HEAD_DIMS[-1]
            and dtype in _KERNEL_DTYPES + (torch.float32,))


def _check_kernel_inputs(q: Tensor, k: Tensor, v: Tensor) -> None:
    D = q.size(-1)
    if D % 8 != 0 or D > _SUPPORTED_HEAD_DIMS[-1]:
        raise ValueError(f"the fused kernel needs a head dim that is a multiple of 8 and at most "
                         f"{_SUPPORTED_HEAD_DIMS[-1]} (got D={D})")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dtype not in _KERNEL_DTYPES + (torch.float32,):
            raise ValueError(f"{name} must be fp16, bf16 or fp32 for the fused kernel (got {t.dtype})")
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"q, k, v must share one dtype (got {q.dtype}, {k.dtype}, {v.dtype})")


def _compute_dtype(q: Tensor, compute_dtype: torch.dtype | None) -> torch.dtype:
    return q.dtype if q.dtype in _KERNEL_DTYPES else (compute_dtype or torch.float16)


def _kernel_operand(t: Tensor, cdt: torch.dtype, Dp: int) -> Tensor:
    """``t`` as the kernels take it: dtype ``cdt``, head dim zero-padded to
    ``Dp``, 16-byte aligned rows and heads (copied only if needed)."""
    t = t.to(cdt)
    D = t.size(-1)
    if Dp != D:
        return torch.nn.functional.pad(t, (0, Dp - D))
    if t.stride(-1) != 1 or t.stride(0) % 8 or t.stride(1) % 8 or t.data_ptr() % 16:
        return t.contiguous()
    return t


def _forward_arrays(bsb: BSBGraph, q: Tensor) -> list[Tensor]:
    """The forward kernel's graph arguments: BSB and work schedule."""
    items, slots = work_schedule(bsb, q.size(1), padded_head_dim(q.size(-1)))
    return [bsb.rw_offset, bsb.cols, bsb.bitmap, bsb.window_order, items, slots]


def _backward_arrays(bsb: BSBGraph, q: Tensor) -> list[Tensor]:
    """The backward kernels' extra graph arguments: the transposed BSB and
    its schedule (the dK / dV pass sums over each source's out-edges)."""
    t = bsb.transposed()
    items, slots = work_schedule(t, q.size(1), padded_head_dim(q.size(-1)))
    return [t.cols, t.bitmap, items, slots]


def _kernel_forward(q: Tensor, k: Tensor, v: Tensor, fwd_graph: list[Tensor], scale: float,
                    out_dtype: torch.dtype, compute_dtype: torch.dtype | None) -> tuple[Tensor, Tensor]:
    """Run the forward kernel on validated inputs: (out [N, H, D] in
    ``out_dtype``, lse [N, H] fp32).

    fp32 inputs are cast to ``compute_dtype`` (default fp16); head dims other
    than 16/32/64/128/256 are zero-padded up to the next one (the scale is the
    caller's, so padding changes nothing) and sliced back.
    """
    from ._build import load_extension
    ops = load_extension()
    cdt = _compute_dtype(q, compute_dtype)
    D = q.size(-1)
    Dp = padded_head_dim(D)
    q, k, v = (_kernel_operand(t, cdt, Dp) for t in (q, k, v))
    out_fp32 = out_dtype != cdt
    out, lse = ops.fwd(q, k, v, *fwd_graph, float(scale), out_fp32)
    if Dp != D:
        out = out[..., :D].contiguous()
    return out.to(out_dtype), lse


def _kernel_backward(grad_out: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                     fwd_graph: list[Tensor], bwd_graph: list[Tensor], scale: float,
                     compute_dtype: torch.dtype | None) -> tuple[Tensor, Tensor, Tensor]:
    """Gradients of :func:`_kernel_forward` with respect to q, k, v, in their
    dtype (fp32 inputs get fp32 gradients straight from the fp32 accumulators)."""
    from ._build import load_extension
    ops = load_extension()
    cdt = _compute_dtype(q, compute_dtype)
    D = q.size(-1)
    Dp = padded_head_dim(D)
    grad_out, q_, k_, v_ = (_kernel_operand(t, cdt, Dp) for t in (grad_out, q, k, v))
    # O enters only delta = rowsum(dO * O): in the compute dtype or fp32
    out = _kernel_operand(out, out.dtype if out.dtype in (cdt, torch.float32) else torch.float32, Dp)
    _, cols, bitmap, _, items, slots = fwd_graph
    grads = ops.bwd(grad_out, q_, k_, v_, out, lse, cols, bitmap, items, slots, *bwd_graph,
                    float(scale), q.dtype not in _KERNEL_DTYPES)
    return tuple((g[..., :D] if Dp != D else g).to(q.dtype) for g in grads)


# The differentiable kernel path is registered twice over the same forward,
# saved state and backward: as a torch.library custom op with autograd (one
# opaque op for torch.compile, through the fake below) and as a plain
# autograd.Function, which eager mode takes because its host time is much
# lower (fused3s_attention forward + backward with stand-in kernels on a
# 2-core CPU: 115 us through the Function, 275 us through the custom op,
# which flattens its list inputs through pytrees on every call).
def _save_for_backward(ctx, q, k, v, fwd_graph, bwd_graph, scale, compute_dtype, out, lse) -> None:
    ctx.save_for_backward(q, k, v, out, lse, *fwd_graph, *bwd_graph)
    ctx.num_fwd_graph, ctx.num_bwd_graph = len(fwd_graph), len(bwd_graph)
    ctx.scale, ctx.compute_dtype = scale, compute_dtype


def _grads_from_saved(ctx, grad_out) -> tuple:
    """(dq, dk, dv), None where not needed, from what the forward saved."""
    if torch.is_grad_enabled():
        raise RuntimeError("gt_fused3s: double backward through fused3s_attention is not supported "
                           "(the fused backward kernels are not differentiable)")
    q, k, v, out, lse, *graph = ctx.saved_tensors
    fwd_graph, bwd_graph = graph[:ctx.num_fwd_graph], graph[ctx.num_fwd_graph:]
    grads = _kernel_backward(grad_out, q, k, v, out, lse, fwd_graph, bwd_graph, ctx.scale, ctx.compute_dtype)
    return tuple(g if need else None for g, need in zip(grads, ctx.needs_input_grad[:3]))


@torch.library.custom_op("gt_fused3s::attention", mutates_args=())
def _attention_op(q: Tensor, k: Tensor, v: Tensor, fwd_graph: list[Tensor], bwd_graph: list[Tensor],
                  scale: float, out_dtype: torch.dtype,
                  compute_dtype: torch.dtype | None) -> tuple[Tensor, Tensor]:
    return _kernel_forward(q, k, v, fwd_graph, scale, out_dtype, compute_dtype)


@_attention_op.register_fake
def _(q, k, v, fwd_graph, bwd_graph, scale, out_dtype, compute_dtype):
    return q.new_empty(q.shape, dtype=out_dtype), q.new_empty(q.shape[:2], dtype=torch.float32)


def _attention_setup_context(ctx, inputs, output):
    q, k, v, fwd_graph, bwd_graph, scale, _out_dtype, compute_dtype = inputs
    ctx.mark_non_differentiable(output[1])
    _save_for_backward(ctx, q, k, v, fwd_graph, bwd_graph, scale, compute_dtype, *output)


def _attention_backward(ctx, grad_out, _grad_lse):
    # one entry per input, a list of them for each list input (the graph arrays)
    return (*_grads_from_saved(ctx, grad_out), [None] * ctx.num_fwd_graph, [None] * ctx.num_bwd_graph,
            None, None, None)


_attention_op.register_autograd(_attention_backward, setup_context=_attention_setup_context)


class _FusedAttention(torch.autograd.Function):
    """Eager-mode twin of the ``gt_fused3s::attention`` custom op."""

    @staticmethod
    def forward(ctx, q, k, v, fwd_graph, bwd_graph, scale, out_dtype, compute_dtype):
        out, lse = _kernel_forward(q, k, v, fwd_graph, scale, out_dtype, compute_dtype)
        _save_for_backward(ctx, q, k, v, fwd_graph, bwd_graph, scale, compute_dtype, out, lse)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        return (*_grads_from_saved(ctx, grad_out), None, None, None, None, None)


def _differentiable_kernel(q: Tensor, k: Tensor, v: Tensor, bsb: BSBGraph, scale: float,
                           out_dtype: torch.dtype, compute_dtype: torch.dtype | None) -> Tensor:
    args = (q, k, v, _forward_arrays(bsb, q), _backward_arrays(bsb, q), scale, out_dtype, compute_dtype)
    if torch.compiler.is_compiling():
        return _attention_op(*args)[0]
    return _FusedAttention.apply(*args)
