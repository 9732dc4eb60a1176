"""The layers' input projections of one tensor as one GEMM.

A layer step projects the same node features three or four times (query,
key, value, skip): as separate ``Linear`` calls that is a GEMM, a bias add
and, in the backward, two GEMMs, a sum and an accumulation of the input's
gradient for each, every one a kernel launch and a host dispatch. Stacked
weights make it one GEMM forward and two backward (plus the stack and the
split's backward, a copy of the outputs' gradients into one buffer). The
results are column slices of one output (views, no copy).

Only plain ``torch.nn.Linear`` / PyG ``Linear`` modules with their weights
initialised and no forward hooks are stacked: a wrapped or hooked
projection (an adapter, a quantised module, a profiler hook) keeps its own
call, so the stacking never changes what a module computes.
"""
from __future__ import annotations

from typing import Sequence

import torch
from torch import Tensor, nn
from torch.nn.parameter import UninitializedParameter
from torch_geometric.nn.dense.linear import Linear as PygLinear

_PLAIN = (nn.Linear, PygLinear)


def _plain(lin: nn.Module) -> bool:
    return (type(lin) in _PLAIN and not isinstance(lin.weight, UninitializedParameter)
            and not lin._forward_hooks and not lin._forward_pre_hooks)


def _stackable(lins: Sequence[nn.Module]) -> bool:
    from torch.nn.modules import module as _module
    if _module._global_forward_hooks or _module._global_forward_pre_hooks:
        return False        # a global hook expects every module's call
    with_bias = {lin.bias is not None for lin in lins if isinstance(lin, _PLAIN)}
    return len(with_bias) == 1 and all(_plain(lin) for lin in lins)


def project(x: Tensor, lins: Sequence[nn.Module]) -> list[Tensor]:
    """``[lin(x) for lin in lins]``, by one GEMM where the modules allow it."""
    if len(lins) < 2 or not _stackable(lins):
        return [lin(x) for lin in lins]
    weight = torch.cat([lin.weight for lin in lins])
    bias = torch.cat([lin.bias for lin in lins]) if lins[0].bias is not None else None
    out = torch.nn.functional.linear(x, weight, bias)
    return list(out.split([lin.weight.size(0) for lin in lins], dim=-1))
