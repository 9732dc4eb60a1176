"""Past one GPU with ``torch.distributed``: a graph's nodes partitioned over
the ranks, and full-graph attention computed per rank with a halo exchange
(:mod:`.partition`, :mod:`.attention`)."""
from .attention import exchange_halo, partitioned_attention
from .partition import LocalGraph, local_graph, partition_nodes, partition_stats

__all__ = ["LocalGraph", "exchange_halo", "local_graph", "partition_nodes", "partition_stats",
           "partitioned_attention"]
