#!/usr/bin/env python3
"""Nsight Compute readings of the fused kernels turned into a bound (see
gt_fused3s/bench/ncu_bounds.py): per graph, setting and kernel (forward,
backward dQ pass, backward dK/dV pass), the achieved share of peak of DRAM,
L2, L1, the SMs and the tensor pipe, the dominant unit and the distance
from the time it would need at its peak. Needs ncu and a CUDA GPU.

    python scripts/ncu_bounds.py run --csv docs/ncu_bounds.csv
    python scripts/ncu_bounds.py run --graphs github --settings d128h1fp16

Graphs and settings as in scripts/bench_kernel.py (default: github,
peptides, powerlaw200k; d128h1fp16 and d64h8bf16).
"""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from gt_fused3s.bench import ncu_bounds  # noqa: E402

if __name__ == "__main__":
    sys.exit(ncu_bounds.main())
