#!/usr/bin/env python3
"""Per-edge terms: the cost of an edge bias and of returned attention weights
in the fused attention, and Fused3SConv vs TransformerConv with edge
features (see gt_fused3s/bench/edge.py for what is timed).

    python scripts/bench_edge.py --out results/edge
    python scripts/bench_edge.py --tables layer --graphs zinc github powerlaw200k
    python scripts/bench_edge.py --tables attention --edge-order source

Graphs: zinc molhiv peptides (first 1024 graphs as one batch), cora pubmed
github (whole), powerlaw200k (generated on the GPU).
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from gt_fused3s.bench import edge  # noqa: E402


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--graphs", nargs="+", default=list(edge.GRAPHS))
    p.add_argument("--tables", nargs="+", choices=("attention", "layer"), default=["attention", "layer"])
    p.add_argument("--edge-dim", type=int, default=16, help="edge feature size of the layer table (0: none)")
    p.add_argument("--no-compiled", action="store_true",
                   help="layer table: leave out both layers under torch.compile, default and "
                        "reduce-overhead modes (four compiles per graph)")
    p.add_argument("--edge-order", choices=edge.EDGE_ORDERS, default="as-loaded",
                   help="the edges' order: as the files list them (grouped by destination), sorted by "
                        "source (PyG's coalesced order), or a random permutation")
    p.add_argument("--out", help="CSV path prefix: <out>_attention.csv, <out>_layer.csv")
    a = p.parse_args(argv)
    import torch
    if not torch.cuda.is_available():
        print("bench_edge: needs a CUDA GPU", file=sys.stderr)
        return 2
    if "attention" in a.tables:
        rows = edge.attention_rows(a.graphs, edge_order=a.edge_order)
        if a.out:
            edge.write_csv(rows, f"{a.out}_attention.csv")
    if "layer" in a.tables:
        rows = edge.layer_rows(a.graphs, edge_dim=a.edge_dim or None, compiled=not a.no_compiled,
                               edge_order=a.edge_order)
        for suffix, ours, peer in edge.RATIOS:
            if any(f"gpu_x{suffix}" in r for r in rows):
                print("geometric mean over the graphs, %s vs %s: GPU time %.2fx, wall %.2fx" % (
                    ours, peer, edge.geometric_mean(r.get(f"gpu_x{suffix}") for r in rows),
                    edge.geometric_mean(r.get(f"wall_x{suffix}") for r in rows)))
        if a.out:
            edge.write_csv(rows, f"{a.out}_layer.csv")
    return 0


if __name__ == "__main__":
    sys.exit(main())
