"""One large graph (a node-level task) under ``torchrun``, as ``gt-fused3s
train`` and ``gt-fused3s infer`` run it: the config section that says how
its nodes are partitioned, each rank's share of the loaded graph (its
:class:`~.partition.LocalGraph` and the rows of its per-node and per-edge
tensors), and the gather of the ranks' output rows back into the whole
graph's order.

Every rank loads the whole graph and computes the same partition (no
communication), then keeps only its share.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from .partition import METHODS, LocalGraph, local_graph, partition_nodes

#: the ``distributed`` section of the train and infer configs, with its
#: defaults: the partitioner of a single graph's nodes (``contiguous`` |
#: ``metis``) and the head chunks the K/V halo exchange is pipelined in
SETTINGS: dict[str, Any] = {"partitioner": "contiguous", "head_chunks": 4}


def check_settings(section: dict) -> None:
    """Raise ValueError naming the key where a config's ``distributed``
    section (:data:`SETTINGS` completed) is wrong."""
    if section["partitioner"] not in METHODS:
        raise ValueError(f"distributed.partitioner must be one of {', '.join(METHODS)} "
                         f"(got {section['partitioner']!r})")
    chunks = section["head_chunks"]
    if not isinstance(chunks, int) or isinstance(chunks, bool) or chunks < 1:
        raise ValueError(f"distributed.head_chunks must be an int >= 1 (got {chunks!r})")


@dataclass
class LocalBatch:
    """A rank's rows of a partitioned graph, in place of the whole graph's
    batch (which every rank loaded and no longer needs): what
    ``model(x, None, graph=lg, edge_attr=edge_attr)`` reads."""

    x: Tensor
    y: Tensor | None
    edge_attr: Tensor | None
    edge_index: Tensor      # the local graph's (its shape names the run's one static shape)
    num_nodes: int          # the whole graph's
    graph_edges: int        # the whole graph's edge count


def split_graph(data, world: int, rank: int, settings: dict) -> tuple[LocalGraph, LocalBatch]:
    """Rank ``rank``'s share of ``data`` (one graph: ``x``, ``edge_index``,
    optional ``y`` and ``edge_attr``) with its nodes partitioned over
    ``world`` ranks as ``settings`` (a ``distributed`` config section,
    :data:`SETTINGS`) says: its :class:`LocalGraph` (``head_chunks`` set)
    and its rows of the graph's tensors."""
    part = partition_nodes(data.edge_index, data.num_nodes, world, settings["partitioner"])
    lg = local_graph(data.edge_index, data.num_nodes, part, rank, parts=world)
    lg.head_chunks = settings["head_chunks"]
    y = getattr(data, "y", None)
    edge_attr = getattr(data, "edge_attr", None)
    return lg, LocalBatch(data.x[lg.nodes], y[lg.nodes] if y is not None else None,
                          edge_attr[lg.edge_ids] if edge_attr is not None else None,
                          lg.edge_index, data.num_nodes, data.edge_index.size(1))


def gather_rows(rows: Tensor, lg: LocalGraph, num_nodes: int, group=None) -> Tensor:
    """The whole graph's [num_nodes, ...] from every rank's ``rows``
    [n_local, ...] (its nodes' rows, ``lg.nodes`` order), on every rank (a
    collective: every rank of ``group`` calls it). Outside a process group,
    ``rows`` put in place."""
    if rows.size(0) != lg.num_local:
        raise ValueError(f"rows has {rows.size(0)} rows but rank {lg.rank} owns {lg.num_local} nodes")
    out = rows.new_zeros((num_nodes, *rows.shape[1:]))
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return out.index_copy_(0, lg.nodes.to(rows.device), rows)
    world = dist.get_world_size(group)
    counts = [torch.zeros(1, dtype=torch.long, device=rows.device) for _ in range(world)]
    dist.all_gather(counts, torch.tensor([lg.num_local], device=rows.device), group=group)
    counts = [int(c) for c in counts]
    most = max(counts)
    # all_gather takes equal shapes: every rank's rows and ids padded to the largest part
    pad_rows = rows.new_zeros((most, *rows.shape[1:]))
    pad_rows[:lg.num_local] = rows
    pad_ids = torch.zeros(most, dtype=torch.long, device=rows.device)
    pad_ids[:lg.num_local] = lg.nodes.to(rows.device)
    all_rows = [torch.empty_like(pad_rows) for _ in range(world)]
    all_ids = [torch.empty_like(pad_ids) for _ in range(world)]
    dist.all_gather(all_rows, pad_rows.contiguous(), group=group)
    dist.all_gather(all_ids, pad_ids, group=group)
    for n, r, ids in zip(counts, all_rows, all_ids):
        out.index_copy_(0, ids[:n], r[:n])
    return out
