#!/usr/bin/env python3
"""Block statistics with and without a locality reordering (issue 13), on
the CPU: counts, not timings (no kernel runs; only the reordering is timed).

    python scripts/reorder_stats.py                         # shared graphs, molecules x1024, powerlaw200k
    python scripts/reorder_stats.py --graphs cora zinc --out docs/reorder_stats_cpu_<sha>.csv

Per graph and node order (the caller's = identity, Cuthill-McKee, label
propagation): TCBs of the 16 x 8 BSB and blocks of 8-row windows of 8 x 16
(FlashSparse's swap-and-transpose), non-zeros per block, m16n8k16
invocations of one forward per head of dimension --head-dim (see
gt_fused3s.graph.format_stats for how they are counted), K/V MB gathered
(in the CSV), and the reordering's median time over --reps calls.
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))


def main(argv=None) -> int:
    from gt_fused3s.bench import block_stats as bs
    from gt_fused3s.bench.common import write_csv
    from gt_fused3s.bench.kernel import ALL_GRAPHS
    from gt_fused3s.reorder import METHODS

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--graphs", nargs="+", choices=list(ALL_GRAPHS), default=list(bs.DEFAULT_GRAPHS))
    p.add_argument("--methods", nargs="+", choices=list(METHODS), default=list(bs.DEFAULT_METHODS))
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--batch", type=int, default=1024, help="graphs per molecule batch")
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, default=1, help="CPU threads (torch.set_num_threads)")
    p.add_argument("--reps", type=int, default=3, help="timed calls of each reordering (median)")
    p.add_argument("--out", help="CSV path")
    a = p.parse_args(argv)
    import torch
    torch.set_num_threads(a.threads)
    print(bs.HEADER, flush=True)
    rows = bs.run(a.graphs, a.methods, head_dim=a.head_dim, batch=a.batch, device=a.device,
                  reps=a.reps, log=lambda s: print(s, flush=True))
    print(f"MMA: m16n8k16 per head of one forward, D = {a.head_dim}; last column: this order's "
          f"16x8 / 8x16 count over the 16x8 count in the caller's order. Counts, not timings.")
    if a.out:
        write_csv(rows, bs.COLUMNS, a.out)
        print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
