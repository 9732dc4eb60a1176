"""Models built on the sparse attention: the Graph Transformer of the
end-to-end study."""
from .graph_transformer import AttentionTimer, GraphTransformer, GraphTransformerBlock

__all__ = ["GraphTransformer", "GraphTransformerBlock", "AttentionTimer"]
