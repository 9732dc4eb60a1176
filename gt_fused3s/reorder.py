"""Locality reordering of a graph's nodes (issue 13, part 3).

A node permutation that puts neighbours at nearby positions raises the
non-zeros per tensor-core block of the BSB format (fewer blocks, fewer MMAs,
fewer K/V rows gathered). It is applied internally and undone on the way
out, so a caller sees its own node order::

    order = reorder(edge_index, num_nodes, "cuthill_mckee")
    ei = order.relabel(edge_index)            # the same graph, new node ids
    q2, k2, v2 = order.rows(q), order.rows(k), order.rows(v)
    out = order.unrows(attention(q2, k2, v2, ei))   # == attention(q, k, v, edge_index)

Conventions: ``perm`` int64 [N] maps a new position to the old node
(``new_x = x[perm]``); ``inv`` int64 [N] is its inverse, old node -> new
position (``new_edge_index = inv[edge_index]``). Edges keep their order and
multiplicity (duplicates and self loops included), so per-edge tensors
(bias, edge features) need no permutation.

Orders (both use the undirected view of the graph, so direction does not
matter, and keep every connected component contiguous, in the order of its
smallest node id: the molecules of a batch stay where they were, each
renumbered inside its own range):

- ``"cuthill_mckee"``: per component, a breadth-first level order from a
  root of smallest degree (optionally moved to a pseudo-peripheral node:
  one George-Liu step), each level sorted by the position of its earliest
  parent, then by degree (Cuthill-McKee). Host synchronisations: a few per
  connected-components round (O(log diameter) rounds) and three per BFS
  level (frontier expansion sizes, the new nodes); all components advance
  together, so the levels are those of the deepest component, not their sum.
- ``"label_propagation"``: ``iterations`` rounds of synchronous label
  propagation (each node takes the most frequent label among its neighbours,
  both edge directions, and itself counted as one neighbour; self loops do not
  vote; ties to the smallest label), then nodes sorted by (component,
  label), stable. Fixed shapes and a fixed number of rounds: after the
  components (above) it makes **no** host synchronisation.
- ``"identity"``: the caller's order (for comparisons).

All work is vectorised torch ops (sort, scan, scatter, gather) on the device
of ``edge_index``, never a Python loop over nodes or edges; the loops are
over BFS levels and rounds.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

METHODS = ("identity", "cuthill_mckee", "label_propagation")


# ---------------------------------------------------------------- helpers
def invert(perm: Tensor) -> Tensor:
    """The inverse permutation: ``inv[perm[i]] = i``. No host synchronisation."""
    inv = torch.empty_like(perm)
    inv[perm] = torch.arange(perm.numel(), device=perm.device, dtype=perm.dtype)
    return inv


def relabel_edge_index(edge_index: Tensor, inv: Tensor) -> Tensor:
    """``edge_index`` [2, E] with every node id ``u`` replaced by its new
    position ``inv[u]``; edge order, duplicates and dtype kept. No host
    synchronisation."""
    return inv[edge_index.long()].to(edge_index.dtype)


def permute_rows(x: Tensor, perm: Tensor) -> Tensor:
    """Rows of ``x`` [N, ...] in the new order: ``out[p] = x[perm[p]]``
    (``ops.gather_rows``: one kernel of ours on a GPU; not differentiable)."""
    from .ops import gather_rows
    return gather_rows(x, perm)


def unpermute_rows(y: Tensor, perm: Tensor, inv: Tensor | None = None) -> Tensor:
    """Rows of ``y`` [N, ...] (new order) back in the caller's order:
    ``out[perm[p]] = y[p]``, exactly (a gather, no arithmetic)."""
    from .ops import gather_rows
    return gather_rows(y, invert(perm) if inv is None else inv)


def _undirected_csr(edge_index: Tensor, num_nodes: int) -> tuple[Tensor, Tensor, Tensor]:
    """CSR (indptr [N+1], indices, degree [N]) of the undirected simple
    graph under ``edge_index``: both directions, self loops and duplicates
    dropped. One sort; two host synchronisations (``torch.unique``'s size and
    the test of its first key)."""
    device = edge_index.device
    src, dst = edge_index[0].long(), edge_index[1].long()
    a, b = torch.cat([src, dst]), torch.cat([dst, src])
    keep = a != b
    key = torch.unique(torch.where(keep, a * num_nodes + b, -1))
    key = key[1:] if key.numel() and int(key[0]) < 0 else key
    rows = torch.div(key, max(num_nodes, 1), rounding_mode="floor")
    indices = key - rows * num_nodes
    degree = torch.bincount(rows, minlength=num_nodes)
    indptr = torch.zeros(num_nodes + 1, dtype=torch.long, device=device)
    torch.cumsum(degree, 0, out=indptr[1:])
    return indptr, indices, degree


def connected_components(edge_index: Tensor, num_nodes: int) -> Tensor:
    """int64 [N]: the smallest node id of each node's (weakly) connected
    component. Min-label hooking with pointer jumping; one host
    synchronisation per round (the convergence test), O(log diameter) rounds
    on the graphs here (worst case O(diameter))."""
    device = edge_index.device
    label = torch.arange(num_nodes, device=device)
    if num_nodes == 0 or edge_index.size(1) == 0:
        return label
    src, dst = edge_index[0].long(), edge_index[1].long()
    while True:
        m = torch.minimum(label[src], label[dst])
        new = label.scatter_reduce(0, src, m, reduce="amin")
        new.scatter_reduce_(0, dst, m, reduce="amin")
        # hook the old representatives too, so whole trees move at once
        new = new.scatter_reduce(0, label, new, reduce="amin")
        for _ in range(4):                      # pointer jumping
            new = new[new]
        if torch.equal(new, label):             # host synchronisation
            return label
        label = new


def _component_rank(comp: Tensor) -> Tensor:
    """Rank of each node's component among the components, in the order of
    their smallest node ids (``comp`` from :func:`connected_components`).
    No host synchronisation."""
    is_root = comp == torch.arange(comp.numel(), device=comp.device)
    return (torch.cumsum(is_root.long(), 0) - 1)[comp]


# ------------------------------------------------------------------ orders
def _bfs_levels(indptr: Tensor, indices: Tensor, degree: Tensor, roots: Tensor,
                num_nodes: int) -> tuple[Tensor, list[Tensor]]:
    """Multi-source Cuthill-McKee BFS from ``roots`` (one per component,
    in component order). Returns each node's level and the levels' nodes in
    order (level 0 = the roots), each level sorted by (rank of the earliest
    parent in the previous level, degree, id). Three host synchronisations
    per level."""
    device = indices.device
    level = torch.full((num_nodes,), -1, dtype=torch.long, device=device)
    rank = torch.zeros(num_nodes, dtype=torch.long, device=device)   # rank within its level
    frontier = roots
    level[frontier] = 0
    rank[frontier] = torch.arange(frontier.numel(), device=device)
    parts = [frontier]
    # earliest parent of each node, written once: in the level that finds it
    best = torch.full((num_nodes,), torch.iinfo(torch.long).max, dtype=torch.long, device=device)
    lvl = 0
    while frontier.numel():
        cnt = degree[frontier]
        total = int(cnt.sum())                                          # sync 1
        if total == 0:
            break
        start = torch.repeat_interleave(indptr[frontier] - torch.cumsum(cnt, 0) + cnt, cnt,
                                        output_size=total)
        nb = indices[start + torch.arange(total, device=device)]
        parent = torch.repeat_interleave(rank[frontier], cnt, output_size=total)
        fresh = level[nb] < 0
        nb, parent = nb[fresh], parent[fresh]                           # sync 2
        best.scatter_reduce_(0, nb, parent, reduce="amin")
        new = torch.unique(nb)                                          # sync 3 (sorted by id)
        if new.numel() == 0:
            break
        new = new[torch.sort(degree[new], stable=True).indices]
        new = new[torch.sort(best[new], stable=True).indices]
        lvl += 1
        level[new] = lvl
        rank[new] = torch.arange(new.numel(), device=device)
        parts.append(new)
        frontier = new
    return level, parts


def cuthill_mckee(edge_index: Tensor, num_nodes: int, *, peripheral: bool = True
                  ) -> tuple[Tensor, Tensor]:
    """Cuthill-McKee order (see the module docstring): ``(perm, inv)``.

    Args:
        edge_index: [2, E] int32/int64, any device; direction ignored.
        num_nodes: N.
        peripheral: start each component's BFS at a node of smallest degree
            in the last level of a first BFS from its smallest-degree node
            (one George-Liu step: a longer, thinner level structure) instead
            of at the smallest-degree node itself. Doubles the BFS cost.
    """
    device = edge_index.device
    if num_nodes == 0:
        empty = torch.zeros(0, dtype=torch.long, device=device)
        return empty, empty.clone()
    indptr, indices, degree = _undirected_csr(edge_index, num_nodes)
    comp = connected_components(edge_index, num_nodes)
    crank = _component_rank(comp)
    ids = torch.arange(num_nodes, device=device)

    def lowest(key: Tensor, among: Tensor) -> Tensor:
        # per component, the node of smallest (key, id) among the mask `among`
        # (every component has one there), in component order
        k = torch.where(among, key * num_nodes + ids, torch.iinfo(torch.long).max)
        pick = torch.full((num_nodes,), torch.iinfo(torch.long).max, dtype=torch.long, device=device)
        pick.scatter_reduce_(0, crank, k, reduce="amin")
        ncomp = int(crank.max()) + 1                                    # host synchronisation
        return pick[:ncomp] % num_nodes

    roots = lowest(degree, torch.ones(num_nodes, dtype=torch.bool, device=device))
    level, parts = _bfs_levels(indptr, indices, degree, roots, num_nodes)
    if peripheral and len(parts) > 1:
        depth = torch.zeros(num_nodes, dtype=torch.long, device=device)
        depth.scatter_reduce_(0, crank, level, reduce="amax")
        roots = lowest(degree, level == depth[crank])
        level, parts = _bfs_levels(indptr, indices, degree, roots, num_nodes)
    order = torch.cat(parts)
    # level-major -> component-major, levels in order within each component
    perm = order[torch.sort(crank[order], stable=True).indices]
    return perm, invert(perm)


def label_propagation(edge_index: Tensor, num_nodes: int, *, iterations: int = 4
                      ) -> tuple[Tensor, Tensor]:
    """Community order by label propagation (see the module docstring):
    ``(perm, inv)``. After the connected components, no host
    synchronisation: every round has static shapes (sorts and scatters over
    the 2E + N votes)."""
    device = edge_index.device
    if num_nodes == 0:
        empty = torch.zeros(0, dtype=torch.long, device=device)
        return empty, empty.clone()
    n = num_nodes
    ids = torch.arange(n, device=device)
    src, dst = edge_index[0].long(), edge_index[1].long()
    # votes: both directions of every edge (a self loop votes for no label:
    # the dummy n) and two for the node itself, as much as one undirected
    # neighbour, so that a pair of leaves agrees instead of swapping labels
    voter = torch.cat([src, dst, ids, ids])
    voted = torch.cat([dst, src, ids, ids])
    loop = src == dst
    loop = torch.cat([loop, loop, torch.zeros(2 * n, dtype=torch.bool, device=device)])
    label = ids.clone()
    V = voter.numel()
    pos = torch.arange(V, device=device)
    for _ in range(iterations):
        cand = torch.where(loop, n, label[voter])
        key = torch.sort(voted * (n + 1) + cand).values        # (node, candidate label)
        node = torch.div(key, n + 1, rounding_mode="floor")
        cand = key - node * (n + 1)
        first = torch.ones(V, dtype=torch.bool, device=device)
        first[1:] = key[1:] != key[:-1]
        last = torch.ones(V, dtype=torch.bool, device=device)
        last[:-1] = first[1:]
        run_start = torch.cummax(torch.where(first, pos, 0), 0).values
        count = pos - run_start + 1                            # votes so far in the run
        # most votes, ties to the smallest label; a run counts at its last entry
        score = torch.where(last & (cand < n), count * n + (n - 1 - cand), -1)
        best = torch.full((n,), -1, dtype=torch.long, device=device)
        best.scatter_reduce_(0, node, score, reduce="amax")
        label = (n - 1) - (best % n)
    crank = _component_rank(connected_components(edge_index, num_nodes))
    # components first (labels never cross them, but ties could interleave)
    perm = torch.sort(label, stable=True).indices
    perm = perm[torch.sort(crank[perm], stable=True).indices]
    return perm, invert(perm)


# --------------------------------------------------------------- the object
@dataclass(eq=False)
class NodeOrder:
    """A node permutation and its inverse, with the helpers that apply it.

    ``perm`` int64 [N]: new position -> old node. ``inv`` int64 [N]: old
    node -> new position. Every helper is a gather (no host synchronisation,
    exact)."""

    perm: Tensor
    inv: Tensor
    method: str = "identity"

    @property
    def num_nodes(self) -> int:
        return self.perm.numel()

    def relabel(self, edge_index: Tensor) -> Tensor:
        """The caller's ``edge_index`` in the new node ids (edge order kept)."""
        return relabel_edge_index(edge_index, self.inv)

    def rows(self, x: Tensor) -> Tensor:
        """Node rows ``x`` [N, ...] in the new order."""
        return permute_rows(x, self.perm)

    def unrows(self, y: Tensor) -> Tensor:
        """Node rows ``y`` [N, ...] in the new order, back in the caller's."""
        return unpermute_rows(y, self.perm, self.inv)


def reorder(edge_index: Tensor, num_nodes: int, method: str = "cuthill_mckee",
            **kwargs) -> NodeOrder:
    """A :class:`NodeOrder` of ``method`` (one of :data:`METHODS`) for the
    graph ``edge_index`` [2, E] of ``num_nodes`` nodes, on its device.
    ``kwargs`` go to the method (``peripheral``, ``iterations``)."""
    if not isinstance(edge_index, Tensor) or edge_index.dim() != 2 or edge_index.size(0) != 2:
        raise ValueError(f"edge_index must be a [2, E] tensor (got "
                         f"{tuple(edge_index.shape) if isinstance(edge_index, Tensor) else type(edge_index).__name__})")
    if edge_index.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"edge_index must be int32 or int64 (got {edge_index.dtype})")
    num_nodes = int(num_nodes)
    if num_nodes < 0:
        raise ValueError(f"num_nodes must be >= 0 (got {num_nodes})")
    if method == "identity":
        perm = torch.arange(num_nodes, device=edge_index.device)
        return NodeOrder(perm, perm.clone(), method)
    if method == "cuthill_mckee":
        perm, inv = cuthill_mckee(edge_index, num_nodes, **kwargs)
    elif method == "label_propagation":
        perm, inv = label_propagation(edge_index, num_nodes, **kwargs)
    else:
        raise ValueError(f"method must be one of {METHODS} (got {method!r})")
    return NodeOrder(perm, inv, method)
