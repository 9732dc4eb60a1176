#!/usr/bin/env python3
"""Partition quality and halo exchange volume of partitioned full-graph
attention (gt_fused3s.distributed), computed on the CPU: no GPU needed.

    python scripts/partition_stats.py                       # 200k and 1M power-law graphs, P = 2, 4, 8
    python scripts/partition_stats.py --graphs products --parts 8 --out results/partition.csv

Per graph, partitioner and P: edge cut (edges between parts and their
share), halo rows (received per layer: total, and the largest rank's),
balance (largest part over the mean, nodes and in-edges) and the bytes one
attention layer exchanges (K and V rows: --row-bytes, default H*D = 64 in
fp16, 2 * 64 * 2 bytes). Graphs: Chung-Lu power law with the parameters of
scripts/bench_kernel.py (powerlaw200k, powerlaw1m) and an ogbn-products-sized
one (2.45M nodes, ~124M directed edges; several GB of memory).
"""
import argparse
import csv
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

GRAPHS = {"powerlaw200k": (200_000, 42.5), "powerlaw1m": (1_000_000, 42.5), "products": (2_449_029, 50.5)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--graphs", nargs="+", choices=list(GRAPHS), default=["powerlaw200k", "powerlaw1m"])
    p.add_argument("--parts", nargs="+", type=int, default=[2, 4, 8])
    p.add_argument("--methods", nargs="+", choices=["contiguous", "metis"], default=["contiguous", "metis"])
    p.add_argument("--row-bytes", type=int, default=256)
    p.add_argument("--out", help="CSV path")
    a = p.parse_args(argv)
    from gt_fused3s.data.synthetic import power_law_graph
    from gt_fused3s.distributed import partition_nodes, partition_stats

    rows = []
    print("| graph | N | E | method | P | edge cut | cut share | halo rows (total) | halo rows (max rank) "
          "| node balance | edge balance | MB exchanged / layer | partition s |")
    print("|" + "---|" * 13)
    for name in a.graphs:
        n, deg = GRAPHS[name]
        ei = power_law_graph(n, alpha=2.1, max_degree=5000, avg_degree=deg, seed=0)
        for method in a.methods:
            for parts in a.parts:
                t0 = time.perf_counter()
                try:
                    part = partition_nodes(ei, n, parts, method)
                except ImportError as e:
                    print(f"| {name} | {n} | {ei.size(1)} | {method} | {parts} | {e} |" + " |" * 8)
                    break
                secs = time.perf_counter() - t0
                st = partition_stats(ei, n, part, parts, row_bytes=a.row_bytes)
                row = {"graph": name, "method": method, **st, "partition_s": secs}
                rows.append(row)
                print(f"| {name} | {n} | {st['num_edges']} | {method} | {parts} | {st['edge_cut']} | "
                      f"{st['edge_cut_share']:.3f} | {st['halo_rows_total']} | {st['halo_rows_max']} | "
                      f"{st['node_balance']:.3f} | {st['edge_balance']:.3f} | "
                      f"{st['exchange_bytes_per_layer'] / 2**20:.1f} | {secs:.2f} |", flush=True)
    if a.out and rows:
        with open(a.out, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(dict.fromkeys(k for r in rows for k in r)))
            w.writeheader()
            w.writerows(rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
