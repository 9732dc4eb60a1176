"""Whole-step CUDA-graph capture: a function of tensors (a Graph Transformer
forward, or a whole training step: forward, loss, backward, optimizer step)
recorded once per input signature and replayed for every later call with
inputs of that signature.

With batches padded to a few buckets (:mod:`gt_fused3s.data.bucket`), an
epoch runs on a handful of CUDA graphs: the host issues one replay per step
instead of hundreds of kernel launches and Python calls, so the GPU sets the
pace. Everything inside must be capturable: no host synchronisation, no
CPU tensors, no data-dependent shapes. The fused backend is (its graph
format is built in static mode inside the graph, see
:class:`~gt_fused3s.plan.GraphPlan`); so are PyTorch's own layers and
``torch.optim`` optimizers created with ``capturable=True``.

The first call with a new signature runs the function eagerly (on a side
stream, as capture requires: it warms up lazy initialisation and is that
call's real result, a real training step included), then captures it
(recording only, nothing runs). Later calls copy their inputs into the
static input buffers of their signature and replay. Outputs are the static
output buffers of the graph: read or copy them before the next call of the
same signature.
"""
from __future__ import annotations

from typing import Any, Callable, Sequence

import torch
from torch import Tensor


def _tensors_in(obj: Any):
    if isinstance(obj, Tensor):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for x in obj:
            yield from _tensors_in(x)
    elif isinstance(obj, dict):
        for x in obj.values():
            yield from _tensors_in(x)


def _signature(tensors: Sequence[Tensor]) -> tuple:
    return tuple((tuple(t.shape), t.dtype, t.device) for t in tensors)


class _Captured:
    """One signature's graph, static inputs and outputs."""

    def __init__(self, graph: torch.cuda.CUDAGraph, inputs: list[Tensor], outputs: Any):
        self.graph, self.inputs, self.outputs = graph, inputs, outputs


class CudaGraphRunner:
    """``fn(*tensors)`` as CUDA-graph replays, one graph per input signature
    (shapes, dtypes, devices of the tensors).

    Args:
        fn: a function of CUDA tensors, capturable (see the module
            docstring); its result (tensors, or containers of them) is
            returned from the graph's static outputs. A training step sets
            the gradients to None first (``zero_grad(set_to_none=True)``),
            so that the captured backward allocates them inside the graph.

    Attributes:
        captures: how many graphs were captured (one per signature seen).
        replays: how many calls were replays.
    """

    def __init__(self, fn: Callable[..., Any]):
        self.fn = fn
        self._graphs: dict[tuple, _Captured] = {}
        self.captures = 0
        self.replays = 0

    def __call__(self, *tensors: Tensor) -> Any:
        key = _signature(tensors)
        hit = self._graphs.get(key)
        if hit is not None:
            for static, t in zip(hit.inputs, tensors):
                static.copy_(t, non_blocking=True)
            hit.graph.replay()
            self.replays += 1
            return hit.outputs
        return self._first_call(key, tensors)

    def _first_call(self, key: tuple, tensors: Sequence[Tensor]) -> Any:
        for t in tensors:
            if not t.is_cuda:
                raise ValueError(f"CudaGraphRunner takes CUDA tensors (got one on {t.device})")
        static = [t.clone() for t in tensors]
        main = torch.cuda.current_stream()
        side = torch.cuda.Stream()
        side.wait_stream(main)
        with torch.cuda.stream(side):          # eager warm-up, the call's own result
            result = self.fn(*static)
        main.wait_stream(side)
        for t in _tensors_in(result):          # freed later on the main stream: tell the allocator
            t.record_stream(main)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            outputs = self.fn(*static)
        self._graphs[key] = _Captured(graph, static, outputs)
        self.captures += 1
        return result
