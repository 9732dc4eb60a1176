"""Drop-in layers. ``gt_fused3s.nn.Fused3SConv`` is the PyTorch Geometric
layer (a :class:`torch_geometric.nn.TransformerConv` drop-in); the DGL layer
is ``gt_fused3s.nn.dgl.Fused3SConv`` and is imported only on request, so this
package never needs DGL."""
from .fallback import PlanRebuildWarning, UnfusedPathWarning
from .pyg import Fused3SConv

__all__ = ["Fused3SConv", "PlanRebuildWarning", "UnfusedPathWarning"]
