#!/usr/bin/env python3
"""Kernel-only benchmark: fused3s vs reference vs PyG vs FlexAttention.

    python scripts/bench_kernel.py --out results/kernel.csv
    python scripts/bench_kernel.py --quick --graphs cora github --settings d128h1fp16
    python scripts/bench_kernel.py --reorder cuthill_mckee --out results/reorder_cm.csv
    python scripts/bench_kernel.py --reorder cuthill_mckee --dry-run --graphs cora   # CPU plumbing
    python scripts/bench_kernel.py --window-rows 8 --out results/rows8.csv
    python scripts/bench_kernel.py --fit-cost-model --out results/cost_model.csv

With --reorder METHOD: instead of the backends, each graph's plan in the
caller's order and one built with GraphPlan.from_edge_index(..., reorder=METHOD)
side by side (default settings d128h1fp16 and d64h8bf16): forward and
forward + backward kernel time, the public call with its gathers, the gathers
alone, the order's and the plan's build time on the device, and the BSB
statistics (TCBs, MMA invocations, non-zeros per TCB) of both; see
gt_fused3s.bench.kernel.run_reorder for the columns. --dry-run runs that on
the CPU (reference path, wall-clock times): the plumbing, not a measurement.

With --window-rows 8: instead of the backends, each graph's 16-row plan and
its 8-row plan (GraphPlan.from_edge_index(..., window_rows=8), issue 13)
side by side (default settings d128h1fp16 and d64h8bf16): forward and
backward kernel time, the public call's wall time, blocks and MMA
invocations; see gt_fused3s.bench.rows8 for the columns. With --model-step
too: a 10-block Graph Transformer's captured training step on each plan.

With --fit-cost-model: both formats' kernels on calibration and held-out
graphs, the fit of the plan's cost model (gt_fused3s.cost_model, which
window_rows="auto" uses), its predictions against the measured times, and
the coefficients to paste into gt_fused3s/cost_model.py; --from-csv CSV
refits from an earlier run's CSV without a GPU. See gt_fused3s.bench.cost.

Graphs: cora citeseer pubmed github (whole), molhiv zinc peptides (first 1024
graphs as one batch), powerlaw200k powerlaw1m (generated on the GPU).
Settings: d128h1fp16 (D=128, H=1, fp16), d32h8bf16, d64h8bf16 (H=8, bf16).
See gt_fused3s/bench/kernel.py for the timing method and byte formulas.
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from gt_fused3s.bench import kernel  # noqa: E402


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--graphs", nargs="+", choices=kernel.ALL_GRAPHS, help="default: all (or the quick set)")
    p.add_argument("--settings", nargs="+", choices=list(kernel.SETTINGS), help="default: all")
    p.add_argument("--backends", nargs="+", choices=kernel.BACKENDS, default=list(kernel.BACKENDS))
    p.add_argument("--quick", action="store_true", help="fewer graphs and repetitions")
    p.add_argument("--out", help="CSV path (a second CSV *_bsb_build.csv holds the BSB build times)")
    p.add_argument("--flex-max-nodes", type=int, default=65_536,
                   help="skip FlexAttention above this N (its block mask is built from a dense N x N mask)")
    p.add_argument("--flex-settings", nargs="+", default=["d128h1fp16"], choices=list(kernel.SETTINGS),
                   help="settings in which FlexAttention runs (each graph and setting is a torch.compile)")
    p.add_argument("--no-backward", action="store_true",
                   help="forward only (default: also time the backward and forward + backward)")
    p.add_argument("--no-flush", action="store_true", help="do not flush L2 before each timed call")
    p.add_argument("--reorder", choices=["cuthill_mckee", "label_propagation", "identity"],
                   help="time plans with and without this node reordering side by side (issue 13)")
    p.add_argument("--dry-run", action="store_true",
                   help="with --reorder: run on the CPU (no GPU needed; times are not kernel times)")
    p.add_argument("--window-rows", type=int, choices=[8],
                   help="time 16-row and 8-row plans side by side (issue 13)")
    p.add_argument("--model-step", action="store_true",
                   help="with --window-rows 8: a 10-block Graph Transformer's captured training step on "
                        "each plan instead of the kernels (default graphs: zinc molhiv peptides)")
    p.add_argument("--fit-cost-model", action="store_true",
                   help="time both window formats on calibration and held-out graphs and fit the plan's "
                        "cost model (gt_fused3s.cost_model; issue 13): prints the coefficients")
    p.add_argument("--from-csv", help="with --fit-cost-model: refit from this CSV of an earlier run (CPU)")
    a = p.parse_args(argv)
    import torch
    if a.from_csv and not a.fit_cost_model:
        p.error("--from-csv needs --fit-cost-model")
    if a.fit_cost_model:
        if not a.from_csv and not torch.cuda.is_available():
            print("bench_kernel: --fit-cost-model needs a CUDA GPU (or --from-csv)", file=sys.stderr)
            return 2
        from gt_fused3s.bench.cost import run_fit
        run_fit(out=a.out, from_csv=a.from_csv)
        return 0
    if a.window_rows:
        if not torch.cuda.is_available():
            print("bench_kernel: --window-rows needs a CUDA GPU", file=sys.stderr)
            return 2
        from gt_fused3s.bench.rows8 import run_rows8, run_rows8_model
        if a.model_step:
            run_rows8_model(a.graphs, out=a.out)
        else:
            run_rows8(a.graphs, a.settings, quick=a.quick, out=a.out, flush=not a.no_flush)
        return 0
    if a.dry_run and not a.reorder:
        p.error("--dry-run needs --reorder")
    if a.model_step and not a.window_rows:
        p.error("--model-step needs --window-rows 8")
    if a.reorder:
        if not a.dry_run and not torch.cuda.is_available():
            print("bench_kernel: --reorder needs a CUDA GPU (or --dry-run to check the plumbing on the CPU)",
                  file=sys.stderr)
            return 2
        kernel.run_reorder(a.graphs, a.settings, a.reorder, quick=a.quick, out=a.out, flush=not a.no_flush,
                           backward=not a.no_backward, device="cpu" if a.dry_run else "cuda")
        return 0
    if not torch.cuda.is_available():
        print("bench_kernel: needs a CUDA GPU", file=sys.stderr)
        return 2
    kernel.run(a.graphs, a.settings, a.backends, quick=a.quick, out=a.out,
               flex_max_nodes=a.flex_max_nodes, flex_settings=a.flex_settings, flush=not a.no_flush,
               backward=not a.no_backward)
    return 0


if __name__ == "__main__":
    sys.exit(main())
