#!/usr/bin/env python
"""Graph Transformer training harness: ``gt-fused3s train`` without
installing the package (same arguments; see ``--help``).

    python scripts/train.py --config configs/train.yaml [--csv results/train.csv]
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gt_fused3s.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(["train", *sys.argv[1:]]))
