"""Public functional API ``fused3s_attention``, and every registered op with
its fake kernel and autograd.

Ops of the ``gt_fused3s`` namespace (schemas and fake kernels registered at
import; the CUDA implementations come with the extension, compiled on first
use, see ``_build``):

* ``fwd``        the fused forward kernel: (out, lse) from q, k, v and a plan's arrays
* ``bwd``        the fused backward kernels: (dq, dk, dv)
* ``bsb_build``  the CUDA builder of the BSB format, at capacity, no host sync
* ``attention``  fwd with autograd (bwd), the one op ``torch.compile`` sees

CUDA tensors take the fused kernel; CPU tensors, and CUDA tensors when the
extension cannot be built or ``GT_FUSED3S_DISABLE_KERNEL=1`` is set, take
the reference path of ``reference.py``, which computes the same function.
"""
from __future__ import annotations

import math
import os
import warnings

import torch
from torch import Tensor

from . import _build
from .graph import tcb_capacity
from .plan import GraphPlan, as_plan, padded_head_dim
from .reference import _check_qkv, attention_reference, default_scale

_SUPPORTED_HEAD_DIMS = (16, 32, 64, 128, 256)
_KERNEL_DIMS = frozenset(_SUPPORTED_HEAD_DIMS)
_KERNEL_DTYPES = (torch.float16, torch.bfloat16)

# ----------------------------------------------------------- op schemas + fakes
_LIB = torch.library.Library("gt_fused3s", "FRAGMENT")
_LIB.define("fwd(Tensor q, Tensor k, Tensor v, Tensor rw_offset, Tensor cols, Tensor bitmap, "
            "Tensor window_order, Tensor items, Tensor slots, float scale, bool out_fp32) "
            "-> (Tensor out, Tensor lse)")
_LIB.define("bwd(Tensor grad_out, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, Tensor cols, "
            "Tensor bitmap, Tensor items, Tensor slots, Tensor t_cols, Tensor t_bitmap, Tensor t_items, "
            "Tensor t_slots, float scale, bool grad_fp32) -> (Tensor grad_q, Tensor grad_k, Tensor grad_v)")
_LIB.define("bsb_build(Tensor edge_index, int num_nodes) -> (Tensor rw_offset, Tensor cols, "
            "Tensor bitmap, Tensor window_order, Tensor edges, Tensor counters)")


@torch.library.register_fake("gt_fused3s::fwd")
def _fwd_fake(q, k, v, rw_offset, cols, bitmap, window_order, items, slots, scale, out_fp32):
    N, H, D = q.shape
    return (q.new_empty((N, H, D), dtype=torch.float32 if out_fp32 else q.dtype),
            q.new_empty((N, H), dtype=torch.float32))


@torch.library.register_fake("gt_fused3s::bwd")
def _bwd_fake(grad_out, q, k, v, out, lse, cols, bitmap, items, slots, t_cols, t_bitmap, t_items,
              t_slots, scale, grad_fp32):
    dtype = torch.float32 if grad_fp32 else q.dtype
    return tuple(q.new_empty(q.shape, dtype=dtype) for _ in range(3))


@torch.library.register_fake("gt_fused3s::bsb_build")
def _bsb_build_fake(edge_index, num_nodes):
    E = edge_index.size(1)
    R = (num_nodes + 15) // 16
    T = tcb_capacity(E, num_nodes)
    i32, i64 = dict(dtype=torch.int32), dict(dtype=torch.int64)
    return (edge_index.new_empty((R + 1,), **i32), edge_index.new_empty((T * 8,), **i32),
            edge_index.new_empty((T, 2), **i64), edge_index.new_empty((R,), **i32),
            edge_index.new_empty((2, E), **i64), edge_index.new_empty((5,), **i64))


def bsb_build(edge_index: Tensor, num_nodes: int) -> tuple[Tensor, ...]:
    """``torch.ops.gt_fused3s.bsb_build`` (compiling the extension on first
    use): the BSB arrays at capacity and the counters, on the device."""
    _build.load_extension()
    return torch.ops.gt_fused3s.bsb_build(edge_index, num_nodes)


# ------------------------------------------------------------------ public API
def fused3s_attention(q: Tensor, k: Tensor, v: Tensor, graph: GraphPlan | Tensor,
                      scale: float | None = None, *, num_nodes: int | None = None,
                      out_dtype: torch.dtype | None = None,
                      compute_dtype: torch.dtype | None = None) -> Tensor:
    r"""Sparse graph attention fused into one kernel (SDDMM, softmax, SpMM).

    .. math::
        \mathbf{o}_{i,h} = \sum_{j \in \mathcal{N}(i)}
        \mathrm{softmax}_j\left(s \langle \mathbf{q}_{i,h}, \mathbf{k}_{j,h} \rangle\right)
        \mathbf{v}_{j,h}

    Every edge is a term: an edge listed ``m`` times counts ``m`` times, as
    in PyG's and DGL's message passing.

    Args:
        q, k, v: [N, H, D] node queries, keys and values (fp16 or bf16 for
            the kernel; fp32 is accepted and computed in ``compute_dtype``;
            float64 on the CPU path stays float64).
        graph: a :class:`~gt_fused3s.plan.GraphPlan` (prepared ahead:
            :meth:`~gt_fused3s.plan.GraphPlan.prepare`, so that the call
            builds nothing and makes no host synchronisation), a
            :class:`~gt_fused3s.graph.BSBGraph`, or an ``edge_index`` [2, E]
            (source, destination) whose plan is built once and cached for as
            long as that tensor lives.
        scale: the score scale :math:`s`, default ``1 / sqrt(D)``.
        num_nodes: with an ``edge_index``, the node count (default ``N``).
        out_dtype: dtype of the output, default ``q.dtype``.
        compute_dtype: operand precision of the kernel for fp32 inputs,
            ``torch.float16`` (default) or ``torch.bfloat16``.

    Returns:
        [N, H, D]; rows without in-neighbours are 0. Differentiable once
        (double backward raises): the kernel path's gradients come from the
        fused backward kernels, which recompute the scores from q, k and the
        forward's per-row log-sum-exp over the graph's BSB and its transpose.
    """
    out = _fast_path(q, k, v, graph, scale, out_dtype, compute_dtype)
    if out is not None:
        return out
    N, H, D = _check_qkv(q, k, v)
    if v.shape != q.shape:
        raise ValueError(f"v must have the shape of q {tuple(q.shape)} (got {tuple(v.shape)})")
    scale = default_scale(D) if scale is None else float(scale)
    if compute_dtype is not None and compute_dtype not in _KERNEL_DTYPES:
        raise ValueError(f"compute_dtype must be torch.float16 or torch.bfloat16 (got {compute_dtype})")
    if not _use_kernel(q):
        # The reference reads the edges only: an edge_index needs no format.
        if isinstance(graph, Tensor):
            _check_edges_for(graph, N, num_nodes, q.device)
            edges = graph
        else:
            plan = as_plan(graph)
            _check_plan_for(plan, N, q.device)
            edges = plan.edge_index
        return attention_reference(q, k, v, edges, scale, out_dtype=out_dtype or q.dtype,
                                   compute_dtype=torch.float64 if q.dtype == torch.float64
                                   else torch.float32)
    plan = as_plan(graph, N if num_nodes is None else num_nodes)
    _check_plan_for(plan, N, q.device)
    _check_kernel_inputs(q, k, v)
    Dp = padded_head_dim(D)
    fwd_args = plan.forward_args(H, Dp)
    out_dtype = out_dtype or q.dtype
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
        args = (q, k, v, fwd_args, plan.backward_args(H, Dp), scale, out_dtype, compute_dtype)
        if torch.compiler.is_compiling():
            return _attention_op(q, k, v, list(fwd_args), list(args[4]), scale, out_dtype, compute_dtype)[0]
        return _FusedAttention.apply(*args)
    if torch.compiler.is_compiling():
        return _attention_op(q, k, v, list(fwd_args), [], scale, out_dtype, compute_dtype)[0]
    return _kernel_forward(q, k, v, fwd_args, scale, out_dtype, compute_dtype)[0]


def _fast_path(q, k, v, graph, scale, out_dtype, compute_dtype) -> Tensor | None:
    """The call on a plan prepared for q's heads and head dim, in eager mode,
    with fp16 / bf16 operands of a compiled head dim: straight to the kernel
    (the binding checks q, k, v and the graph arrays itself). None: take the
    general path, which checks and converts everything."""
    if (type(graph) is not GraphPlan or out_dtype is not None or compute_dtype is not None
            or not isinstance(q, Tensor) or q.dim() != 3 or q.dtype not in _KERNEL_DTYPES
            or torch.compiler.is_compiling()):
        return None
    N, H, D = q.shape
    fwd_args = graph._fwd_args.get((H, D))      # a compiled D is its own padded head dim
    if fwd_args is None or N != graph.num_nodes or not kernel_available(q.device):
        return None
    scale = 1.0 / math.sqrt(D) if scale is None else float(scale)
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
        bwd_args = graph._bwd_args.get((H, D))
        if bwd_args is None:
            return None
        return _FusedAttention.apply(q, k, v, fwd_args, bwd_args, scale, q.dtype, None)
    return _op("fwd")(q, k, v, *fwd_args, scale, False)[0]


_OPS: dict[str, object] = {}


def _op(name: str):
    """``torch.ops.gt_fused3s.<name>.default``, looked up once (the overload
    itself: calling it skips the packet's overload resolution)."""
    op = _OPS.get(name)
    if op is None:
        op = _OPS[name] = getattr(torch.ops.gt_fused3s, name).default
    return op


def kernel_available(device: torch.device) -> bool:
    """Whether tensors on ``device`` take the fused kernel: a CUDA device
    where the extension builds and loads, unless ``GT_FUSED3S_DISABLE_KERNEL=1``
    (else they take the reference path, with a warning if the build failed)."""
    if device.type != "cuda" or os.environ.get("GT_FUSED3S_DISABLE_KERNEL") == "1":
        return False
    if _build.extension_available():
        return True
    warnings.warn("gt_fused3s: the CUDA extension is unavailable, CUDA tensors take the "
                  "reference path (see gt_fused3s._build.load_extension() for the reason)",
                  RuntimeWarning, stacklevel=3)
    return False


def _use_kernel(q: Tensor) -> bool:
    return q.is_cuda and kernel_available(q.device)


def kernel_accepts(head_dim: int, dtype: torch.dtype) -> bool:
    """Whether the fused CUDA kernel takes features of this head dim and dtype
    (the layers send what it does not take to their unfused path)."""
    return (head_dim % 8 == 0 and 0 < head_dim <= _SUPPORTED_HEAD_DIMS[-1]
            and dtype in _KERNEL_DTYPES + (torch.float32,))


def _check_plan_for(plan: GraphPlan, N: int, device: torch.device) -> None:
    plan.bsb.check_nodes(N)
    if plan.device != device:
        raise ValueError(f"graph is on {plan.device} but q, k, v are on {device}; "
                         f"move it once with graph.to(q.device)")


def _check_edges_for(edge_index: Tensor, N: int, num_nodes: int | None, device: torch.device) -> None:
    from .graph import _check_edge_index, _check_range
    _check_edge_index(edge_index)
    if num_nodes is not None and num_nodes != N:
        raise ValueError(f"q has {N} nodes but num_nodes={num_nodes}")
    if edge_index.device != device:
        raise ValueError(f"edge_index is on {edge_index.device} but q, k, v are on {device}")
    if not torch.compiler.is_compiling():   # a host sync; traced code relies on the index ops
        _check_range("edge_index", edge_index, 0, N)


def _check_kernel_inputs(q: Tensor, k: Tensor, v: Tensor) -> None:
    D = q.size(-1)
    if D % 8 != 0 or D > _SUPPORTED_HEAD_DIMS[-1]:
        raise ValueError(f"the fused kernel needs a head dim that is a multiple of 8 and at most "
                         f"{_SUPPORTED_HEAD_DIMS[-1]} (got D={D})")
    dt = q.dtype
    if dt not in _KERNEL_DTYPES and dt != torch.float32:
        raise ValueError(f"q must be fp16, bf16 or fp32 for the fused kernel (got {dt})")
    if k.dtype != dt or v.dtype != dt:
        raise ValueError(f"q, k, v must share one dtype (got {q.dtype}, {k.dtype}, {v.dtype})")


def _compute_dtype(q: Tensor, compute_dtype: torch.dtype | None) -> torch.dtype:
    return q.dtype if q.dtype in _KERNEL_DTYPES else (compute_dtype or torch.float16)


def _kernel_operand(t: Tensor, cdt: torch.dtype, Dp: int) -> Tensor:
    """``t`` in dtype ``cdt`` with its head dim zero-padded to ``Dp``. Strides
    are the binding's business: it copies a tensor whose rows or heads are
    not 16-byte aligned, in C++, where that check is cheap."""
    if t.dtype != cdt:
        t = t.to(cdt)
    if t.size(-1) != Dp:
        t = torch.nn.functional.pad(t, (0, Dp - t.size(-1)))
    return t


def _kernel_forward(q: Tensor, k: Tensor, v: Tensor, fwd_args: tuple, scale: float,
                    out_dtype: torch.dtype, compute_dtype: torch.dtype | None) -> tuple[Tensor, Tensor]:
    """Run the forward kernel on validated inputs: (out [N, H, D] in
    ``out_dtype``, lse [N, H] fp32).

    fp32 inputs are cast to ``compute_dtype`` (default fp16); head dims other
    than 16/32/64/128/256 are zero-padded up to the next one (the scale is the
    caller's, so padding changes nothing) and sliced back.
    """
    cdt = _compute_dtype(q, compute_dtype)
    D = q.size(-1)
    Dp = padded_head_dim(D)
    if q.dtype != cdt or D != Dp:
        q, k, v = (_kernel_operand(t, cdt, Dp) for t in (q, k, v))
    out, lse = _op("fwd")(q, k, v, *fwd_args, scale, out_dtype != cdt)
    if Dp != D:
        out = out[..., :D].contiguous()
    return (out if out.dtype == out_dtype else out.to(out_dtype)), lse


def _kernel_backward(grad_out: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                     fwd_args: tuple, bwd_args: tuple, scale: float,
                     compute_dtype: torch.dtype | None) -> tuple[Tensor, Tensor, Tensor]:
    """Gradients of :func:`_kernel_forward` with respect to q, k, v, in their
    dtype (fp32 inputs get fp32 gradients straight from the fp32 accumulators)."""
    _, cols, bitmap, _, items, slots = fwd_args
    dtype = q.dtype
    if dtype in _KERNEL_DTYPES and grad_out.dtype == dtype and out.dtype == dtype and q.size(-1) in _KERNEL_DIMS:
        # the kernel's own operands: nothing to convert (the common case)
        return _op("bwd")(grad_out, q, k, v, out, lse, cols, bitmap, items, slots, *bwd_args, scale, False)
    cdt = _compute_dtype(q, compute_dtype)
    D = q.size(-1)
    Dp = padded_head_dim(D)
    grad_out, q, k, v = (_kernel_operand(t, cdt, Dp) for t in (grad_out, q, k, v))
    # O enters only delta = rowsum(dO * O): in the compute dtype or fp32
    out = _kernel_operand(out, out.dtype if out.dtype in (cdt, torch.float32) else torch.float32, Dp)
    grads = _op("bwd")(grad_out, q, k, v, out, lse, cols, bitmap, items, slots,
                       *bwd_args, scale, dtype not in _KERNEL_DTYPES)
    if Dp == D and grads[0].dtype == dtype:
        return grads
    return tuple((g[..., :D] if Dp != D else g).to(dtype) for g in grads)


def _grads_from_saved(ctx, grad_out) -> tuple:
    """(dq, dk, dv), None where not needed, from what the forward saved."""
    if torch.is_grad_enabled():
        raise RuntimeError("gt_fused3s: double backward through fused3s_attention is not supported "
                           "(the fused backward kernels are not differentiable)")
    q, k, v, out, lse = ctx.saved_tensors
    grads = _kernel_backward(grad_out, q, k, v, out, lse, ctx.fwd_args, ctx.bwd_args, ctx.scale,
                             ctx.compute_dtype)
    need = ctx.needs_input_grad
    return (grads[0] if need[0] else None, grads[1] if need[1] else None, grads[2] if need[2] else None)


def _save(ctx, q, k, v, fwd_args, bwd_args, scale, compute_dtype, out, lse) -> None:
    # The graph arrays are constants of the plan (never modified, no
    # gradient): kept as attributes, which is cheaper than saving them.
    ctx.save_for_backward(q, k, v, out, lse)
    ctx.fwd_args, ctx.bwd_args = tuple(fwd_args), tuple(bwd_args)
    ctx.scale, ctx.compute_dtype = scale, compute_dtype


# The differentiable kernel path is registered twice over the same forward,
# saved state and backward: as a torch.library custom op with autograd (one
# opaque op for torch.compile, through the fake below) and as a plain
# autograd.Function, which eager mode takes because its host time is much
# lower (the custom op flattens its list inputs through pytrees on every call).
@torch.library.custom_op("gt_fused3s::attention", mutates_args=())
def _attention_op(q: Tensor, k: Tensor, v: Tensor, fwd_graph: list[Tensor], bwd_graph: list[Tensor],
                  scale: float, out_dtype: torch.dtype,
                  compute_dtype: torch.dtype | None) -> tuple[Tensor, Tensor]:
    _build.load_extension()
    out, lse = _kernel_forward(q, k, v, fwd_graph, scale, out_dtype, compute_dtype)
    return out, lse


@_attention_op.register_fake
def _(q, k, v, fwd_graph, bwd_graph, scale, out_dtype, compute_dtype):
    return q.new_empty(q.shape, dtype=out_dtype), q.new_empty(q.shape[:2], dtype=torch.float32)


def _attention_setup_context(ctx, inputs, output):
    q, k, v, fwd_graph, bwd_graph, scale, _out_dtype, compute_dtype = inputs
    ctx.mark_non_differentiable(output[1])
    _save(ctx, q, k, v, fwd_graph, bwd_graph, scale, compute_dtype, *output)


def _attention_backward(ctx, grad_out, _grad_lse):
    # one entry per input, a list of them for each list input (the graph arrays)
    return (*_grads_from_saved(ctx, grad_out), [None] * len(ctx.fwd_args), [None] * len(ctx.bwd_args),
            None, None, None)


_attention_op.register_autograd(_attention_backward, setup_context=_attention_setup_context)


class _FusedAttention(torch.autograd.Function):
    """Eager-mode twin of the ``gt_fused3s::attention`` custom op."""

    @staticmethod
    def forward(ctx, q, k, v, fwd_args, bwd_args, scale, out_dtype, compute_dtype):
        out, lse = _kernel_forward(q, k, v, fwd_args, scale, out_dtype, compute_dtype)
        _save(ctx, q, k, v, fwd_args, bwd_args, scale, compute_dtype, out, lse)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        return (*_grads_from_saved(ctx, grad_out), None, None, None, None, None)
