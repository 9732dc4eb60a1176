#!/usr/bin/env python3
"""Sparse attention over sequences vs FlexAttention and dense SDPA, forward
(with --backward also forward + backward; see gt_fused3s/bench/sequence.py
for what is timed).

    python scripts/bench_sequence.py --out docs/sequence_h100.csv
    python scripts/bench_sequence.py --only local --max-length 2000000
    python scripts/bench_sequence.py --only longformer dilated_global bigbird --plot fig6.png
    python scripts/bench_sequence.py --backward --max-length 1048576
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "configs",
                                                     "bench-sequence.yaml"))
    p.add_argument("--only", nargs="+", help="mask kinds to run")
    p.add_argument("--max-length", type=int, help="skip cases longer than this")
    p.add_argument("--min-length", type=int, help="skip cases shorter than this")
    p.add_argument("--no-flex", action="store_true", help="skip FlexAttention")
    p.add_argument("--backward", action="store_true",
                   help="also time forward + backward (ours and Flex's; Flex's for masks with global or "
                        "random parts up to the config's flex_backward_max tokens)")
    p.add_argument("--probe-max-length", type=int, nargs="+", metavar="L",
                   help="instead of the cases: the longest of these lengths whose local 1601-key forward fits")
    p.add_argument("--out", help="CSV path")
    p.add_argument("--plot", help="PNG path: time against length per mask (needs matplotlib)")
    a = p.parse_args(argv)
    import torch
    import yaml
    from gt_fused3s.bench import sequence as bench
    from gt_fused3s.bench.common import device_name, git_sha, write_csv
    if not torch.cuda.is_available():
        print("bench_sequence: needs a CUDA GPU", file=sys.stderr)
        return 2
    with open(a.config) as f:
        cfg = yaml.safe_load(f)
    dtype = getattr(torch, cfg.get("dtype", "float16"))
    print(f"bench_sequence: {device_name(torch.device('cuda'))}, torch {torch.__version__}, git {git_sha()}, "
          f"D={cfg['head_dim']} H={cfg['heads']} {cfg.get('dtype', 'float16')}, "
          f"{'forward and forward + backward' if a.backward else 'forward'}", flush=True)
    print(bench.HEADER, flush=True)
    rows = []
    if a.probe_max_length:
        for row in bench.probe_max_length(a.probe_max_length, D=cfg["head_dim"], dtype=dtype):
            rows.append(row)
            print(bench.fmt(row), flush=True)
        if a.out:
            write_csv(rows, bench.COLUMNS, a.out)
        return 0
    for case in cfg["cases"]:
        if ((a.only and case["mask"] not in a.only) or (a.max_length and case["L"] > a.max_length)
                or (a.min_length and case["L"] < a.min_length)):
            continue
        row = bench.bench_case(case["mask"], case["L"], case["keys"], D=cfg["head_dim"], H=cfg["heads"],
                               dtype=dtype, flex=not a.no_flex, dense_max=cfg.get("dense_max", 262144),
                               paper_s=case.get("paper_s"), backward=a.backward,
                               flex_backward_max=cfg.get("flex_backward_max", 1 << 20))
        rows.append(row)
        print(bench.fmt(row), flush=True)
        if a.out:   # after every case: a long run that fails later keeps its rows
            write_csv(rows, bench.COLUMNS, a.out)
    if a.plot:
        from gt_fused3s.bench.plot import plot_sequence_times
        print(f"plot: {plot_sequence_times(rows, a.plot)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
