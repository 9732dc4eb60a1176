#!/usr/bin/env python
"""Multi-GPU checks and scaling runs (run under torchrun; see
gt_fused3s/bench/distributed.py):

    torchrun --nproc_per_node=2 scripts/bench_distributed.py check
    torchrun --nproc_per_node=2 scripts/bench_distributed.py scaling --config configs/train-scale-powerlaw.yaml \
        --nodes 1e6 2e6 4e6 --csv results/scale_2.csv
    torchrun --nproc_per_node=2 scripts/bench_distributed.py ddp-losses --config configs/train-ddp-zinc1024.yaml
    python scripts/bench_distributed.py report results/scale_1.csv results/scale_2.csv
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gt_fused3s.bench.distributed import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
