"""What the layers say when a call cannot take the fused kernel (an
:class:`UnfusedPathWarning` naming the reason) or builds again what it could
have kept (a :class:`PlanRebuildWarning`). No torch_geometric or dgl import
here: both layers use it."""
from __future__ import annotations

import warnings

import torch

__all__ = ["PlanRebuildWarning", "UnfusedPathWarning", "warn_unfused"]


class UnfusedPathWarning(UserWarning):
    """A layer call took an unfused path (the reason is in the message):
    exact, but without the fused kernel's speed or memory. Python shows it
    once per call site; silence it with
    ``warnings.simplefilter("ignore", UnfusedPathWarning)``."""


class PlanRebuildWarning(UserWarning):
    """A layer built the plan of a graph it had just built one for (the
    message says how to keep it). Exact, but a plan build costs several
    times a layer's kernels. Python shows it once per call site; silence it
    with ``warnings.simplefilter("ignore", PlanRebuildWarning)``."""


def warn_unfused(layer: str, reason: str, path: str, stacklevel: int = 2) -> None:
    """Warn that ``layer`` runs ``path`` because of ``reason``; nothing
    inside ``torch.compile``, which cannot trace a warning. The warning
    points at the layer's line that calls this (one per reason: Python's
    default filter shows each once)."""
    if not torch.compiler.is_compiling():
        warnings.warn(f"{layer}: {reason}: this call runs {path} (exact, not fast)", UnfusedPathWarning,
                      stacklevel=stacklevel)
