#!/usr/bin/env python
"""Graph Transformer inference benchmark: ``gt-fused3s infer`` without
installing the package (same arguments; see ``--help``).

    python scripts/infer.py --config configs/default.yaml [--csv results/infer.csv]
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gt_fused3s.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(["infer", *sys.argv[1:]]))
