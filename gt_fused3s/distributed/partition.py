"""Nodes of one graph split into parts, one per rank, and each rank's share:
its rows, their in-edges, and the halo (the remote sources of those edges)
that it receives from the other ranks at every attention layer.

Everything here is computed from the global ``edge_index`` with vectorised
ops, identically on every rank, so no communication is needed to agree on
who sends what: rank ``r``'s halo from rank ``s`` is, in the same order,
rank ``s``'s send list to ``r`` (sources ascending by global id).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from ..graph import _check_edge_index, _check_num_nodes, _check_range

METHODS = ("contiguous", "metis")


def partition_nodes(edge_index: Tensor, num_nodes: int, parts: int, method: str = "contiguous") -> Tensor:
    """int64 [N]: the part (rank) owning each node.

    ``contiguous``: balanced ranges of node ids (a locality order of the
    data, such as the batch order of a collection or an RCM order, makes them
    good parts; free, no dependency). ``metis``: METIS k-way through
    ``pymetis`` (an optional dependency: ``pip install pymetis``), minimising
    the edge cut on the symmetrised graph, with the parts' in-edge counts
    (their attention work) balanced.
    """
    _check_edge_index(edge_index)
    num_nodes = _check_num_nodes(num_nodes)
    if not isinstance(parts, int) or parts < 1:
        raise ValueError(f"parts must be an int >= 1 (got {parts!r})")
    if method == "contiguous":
        return torch.arange(num_nodes, device=edge_index.device) * parts // max(num_nodes, 1)
    if method != "metis":
        raise ValueError(f"method must be one of {', '.join(METHODS)} (got {method!r})")
    try:
        import pymetis
    except ImportError as e:
        raise ImportError("the metis partitioner needs pymetis (pip install pymetis); "
                          "method='contiguous' needs nothing") from e
    if parts == 1:
        return torch.zeros(num_nodes, dtype=torch.long, device=edge_index.device)
    src, dst = edge_index.cpu().long()
    keep = src != dst
    a, b = torch.cat([src[keep], dst[keep]]), torch.cat([dst[keep], src[keep]])
    key = torch.unique(a * num_nodes + b)
    a, b = key // num_nodes, key % num_nodes
    xadj = torch.zeros(num_nodes + 1, dtype=torch.long)
    xadj[1:] = torch.cumsum(torch.bincount(a, minlength=num_nodes), 0)
    # vertices weighted by their in-edges + 1: the attention work of a part
    # is its in-edges, so METIS balances those (unweighted it balances nodes)
    weights = torch.bincount(dst, minlength=num_nodes) + 1
    # pymetis >= 2025.2 takes the CSR arrays as one CSRAdjacency (xadj= and
    # adjncy= warn there, to be removed in 2027); older ones only as those
    graph = (dict(adjacency=pymetis.CSRAdjacency(xadj.numpy(), b.numpy())) if hasattr(pymetis, "CSRAdjacency")
             else dict(xadj=xadj.numpy(), adjncy=b.numpy()))
    _, membership = pymetis.part_graph(parts, **graph, vweights=weights.numpy())
    return torch.as_tensor(membership, dtype=torch.long, device=edge_index.device)


@dataclass(eq=False)
class LocalGraph:
    """One rank's share of a partitioned graph.

    Local index space of the columns: this rank's nodes first (``nodes``, in
    ascending global id), then the halo (``halo``: remote sources, grouped by
    owning rank, ascending global id within a rank). Where a rank reads most
    of another's rows (``full_send`` of :func:`local_graph`), it receives all
    of them (``halo_full``), which spares the sender a gather and the
    backward a scatter: the block is then the sender's rows in order.
    """

    rank: int
    parts: int
    nodes: Tensor           #: int64 [n_local] global ids of the rows this rank owns
    halo: Tensor            #: int64 [n_halo] global ids of the remote sources
    halo_counts: list[int]  #: rows received from each rank (0 from itself)
    send_index: Tensor      #: int64 [n_send] local rows to send, grouped by destination rank
    send_counts: list[int]  #: rows sent to each rank (0 to itself)
    edge_index: Tensor      #: int64 [2, E_local] (local column, local row) of the owned rows' in-edges
    edge_ids: Tensor        #: int64 [E_local] their global edge ids (in global order)
    halo_full: list[bool] = field(default_factory=list)   #: per rank: its block is all its rows
    send_full: list[bool] = field(default_factory=list)   #: per rank: it gets all this rank's rows
    #: the K/V halo exchange is pipelined in this many head chunks (the
    #: attention of a chunk overlaps the next one's exchange); 1: one exchange
    head_chunks: int = 4

    @property
    def num_local(self) -> int:
        return self.nodes.numel()

    @property
    def num_columns(self) -> int:
        """Local rows plus halo rows: the node count of the local attention graph."""
        return self.nodes.numel() + self.halo.numel()


def local_graph(edge_index: Tensor, num_nodes: int, part: Tensor, rank: int,
                parts: int | None = None, *, full_send: float = 0.8) -> LocalGraph:
    """Rank ``rank``'s :class:`LocalGraph` of ``edge_index`` [2, E] (source,
    destination) under the partition ``part`` [N] (int, values in
    [0, parts)). ``parts``: the number of ranks (default ``part.max() + 1``;
    pass the world size when a part may be empty). ``full_send``: a rank
    that needs at least this share of another's rows receives all of them
    (no gather, no scatter; 1.0: only the rows needed). Deterministic:
    every rank may compute every share, and all agree on who sends what."""
    _check_edge_index(edge_index)
    num_nodes = _check_num_nodes(num_nodes)
    if part.dim() != 1 or part.numel() != num_nodes:
        raise ValueError(f"part must be [num_nodes] = [{num_nodes}] (got {tuple(part.shape)})")
    _check_range("edge_index", edge_index, 0, num_nodes)
    part = part.long().to(edge_index.device)
    least = int(part.max()) + 1 if num_nodes else 1
    parts = least if parts is None else parts
    if parts < least or int(part.min() if num_nodes else 0) < 0:
        raise ValueError(f"part must hold ranks in [0, parts={parts}) (got values in "
                         f"[{int(part.min())}, {least - 1}])")
    if not 0 <= rank < parts:
        raise ValueError(f"rank must be in [0, parts={parts}) (got {rank})")
    device = edge_index.device
    src, dst = edge_index[0].long(), edge_index[1].long()
    N = num_nodes

    nodes = (part == rank).nonzero().flatten()
    loc = torch.full((N,), -1, dtype=torch.long, device=device)
    loc[nodes] = torch.arange(nodes.numel(), device=device)

    mine = part[dst] == rank
    edge_ids = mine.nonzero().flatten()
    s, d = src[edge_ids], dst[edge_ids]
    remote = part[s] != rank
    sizes = torch.bincount(part, minlength=parts).tolist() if N else [0] * parts

    def full(needed: int, owner: int) -> bool:     # the owner and the reader decide alike
        return needed > 0 and needed >= full_send * sizes[owner]

    # halo: remote sources grouped by owner, ascending id within an owner (all
    # of the owner's rows where most are needed)
    hkey = torch.unique(part[s[remote]] * N + s[remote])
    needed = torch.bincount(hkey // N, minlength=parts).tolist() if N else [0] * parts
    halo_full = [o != rank and full(needed[o], o) for o in range(parts)]
    blocks = hkey % N if N else hkey
    if any(halo_full):
        per_owner = torch.split(blocks, needed)
        blocks = torch.cat([(part == o).nonzero().flatten() if halo_full[o] else per_owner[o]
                            for o in range(parts)])
    halo = blocks
    halo_counts = [sizes[o] if halo_full[o] else needed[o] for o in range(parts)]
    column = torch.full((N,), -1, dtype=torch.long, device=device)
    column[nodes] = torch.arange(nodes.numel(), device=device)
    column[halo] = nodes.numel() + torch.arange(halo.numel(), device=device)
    col = column[s]

    # send lists: for every other rank r, the nodes of this rank that r's rows
    # read (all of them where r needs most)
    cross = (part[src] == rank) & (part[dst] != rank)
    skey = torch.unique(part[dst[cross]] * N + src[cross])
    wanted = torch.bincount(skey // N, minlength=parts).tolist() if N else [0] * parts
    send_full = [r != rank and full(wanted[r], rank) for r in range(parts)]
    send_index = loc[skey % N] if N else skey
    if any(send_full):
        every = torch.arange(nodes.numel(), device=device)
        per_dest = torch.split(send_index, wanted)
        send_index = torch.cat([every if send_full[r] else per_dest[r] for r in range(parts)])
    send_counts = [nodes.numel() if send_full[r] else wanted[r] for r in range(parts)]

    return LocalGraph(rank, parts, nodes, halo, halo_counts, send_index, send_counts,
                      torch.stack([col, loc[d]]), edge_ids, halo_full, send_full)


def partition_stats(edge_index: Tensor, num_nodes: int, part: Tensor, parts: int, *,
                    row_bytes: int = 0) -> dict:
    """Quality of a partition: edge cut (edges between parts, share of all),
    halo rows per rank (max and total: the rows received per exchange),
    balance (largest part over the mean, nodes and in-edges) and, with
    ``row_bytes`` (bytes of one node's exchanged row, e.g. K and V: 2 H D
    elem), the bytes one attention layer exchanges in total."""
    src, dst = edge_index[0].long(), edge_index[1].long()
    part = part.long().to(src.device)
    N = num_nodes
    cut = part[src] != part[dst]
    key = torch.unique(part[dst[cut]] * N + src[cut])          # (receiving rank, remote source)
    halo = torch.bincount(key // max(N, 1), minlength=parts).double()
    nodes = torch.bincount(part, minlength=parts).double()
    edges = torch.bincount(part[dst], minlength=parts).double()
    E = src.numel()
    out = {"parts": parts, "num_nodes": N, "num_edges": E, "edge_cut": int(cut.sum()),
           "edge_cut_share": float(cut.sum()) / max(E, 1),
           "halo_rows_total": int(halo.sum()), "halo_rows_max": int(halo.max()),
           "node_balance": float(nodes.max() / nodes.mean()) if N else 1.0,
           "edge_balance": float(edges.max() / edges.mean()) if E else 1.0}
    if row_bytes:
        out["exchange_bytes_per_layer"] = int(halo.sum()) * row_bytes
    return out
