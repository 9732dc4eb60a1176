"""Past one GPU with ``torch.distributed``: a graph's nodes partitioned over
the ranks, and full-graph attention computed per rank with a halo exchange
(:mod:`.partition`, :mod:`.attention`); a single graph's share per rank
and the gather of its rows, as ``gt-fused3s train`` and ``infer`` run it
under torchrun (:mod:`.single_graph`); data-parallel helpers
(:mod:`.data_parallel`)."""
from .attention import ExchangeTimer, exchange_halo, exchange_timer, partitioned_attention
from .partition import LocalGraph, local_graph, partition_nodes, partition_stats

__all__ = ["ExchangeTimer", "LocalGraph", "exchange_halo", "exchange_timer", "local_graph",
           "partition_nodes", "partition_stats", "partitioned_attention"]
