"""gt-fused3s: fused sparse attention (SDDMM + softmax + SpMM) for graph
transformers, as drop-in layers for PyTorch Geometric and DGL.

Importing the package never compiles anything and never touches the GPU:
the CUDA extension is built on first use by a CUDA tensor.
"""
from .graph import BSBGraph, EdgeIndexError
from .ops import fused3s_attention
from .plan import GraphPlan, cached_plan
from .reference import attention_dense, attention_reference

__version__ = "0.1.0"

__all__ = ["BSBGraph", "EdgeIndexError", "GraphPlan", "cached_plan", "fused3s_attention",
           "attention_reference", "attention_dense", "WITH_CUDA_EXT", "__version__"]


def __getattr__(name):
    # WITH_CUDA_EXT answers "can the fused kernel run here?"; computing it may
    # compile the extension, so it is resolved only when asked for.
    if name == "WITH_CUDA_EXT":
        from ._build import extension_available
        return extension_available()
    raise AttributeError(f"module 'gt_fused3s' has no attribute {name!r}")
