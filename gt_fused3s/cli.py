"""The ``gt-fused3s`` command line. Subcommands live in their own modules
(``gt_fused3s.drivers.infer``, ``.drivers.train``, ``.bench.plot``); this
file only wires them up.

    gt-fused3s infer --config configs/default.yaml [--backends fused3s pyg]
                     [--device cuda] [--csv out.csv] [--plot out.png] [--quick]
    gt-fused3s train --config configs/train.yaml [--backends fused3s pyg]
                     [--steps 60] [--csv losses.csv] [--plot losses.png] [--quick]
    gt-fused3s plot out.csv out.png
"""
from __future__ import annotations

import argparse
import sys


def build_parser() -> argparse.ArgumentParser:
    from .bench import plot
    from .drivers import infer, train

    parser = argparse.ArgumentParser(prog="gt-fused3s", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("infer", help="Graph Transformer inference: time and compare backends",
                       description=infer.__doc__.split("\n\n")[0])
    infer.add_arguments(p)
    p.set_defaults(run=infer.main)
    p = sub.add_parser("train", help="Graph Transformer training: loss, time and memory "
                                     "per step of each backend",
                       description=train.__doc__.split("\n\n")[0])
    train.add_arguments(p)
    p.set_defaults(run=train.main)
    p = sub.add_parser("plot", help="bar chart of speedups from the CSV of infer --csv",
                       description=plot.__doc__.split("\n\n")[0])
    plot.add_arguments(p)
    p.set_defaults(run=plot.main)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    try:
        return args.run(args)
    except (ValueError, FileNotFoundError) as err:   # bad config or arguments: one line
        parser.exit(2, f"gt-fused3s {args.command}: error: {err}\n")
    except RuntimeError as err:
        if "CUDA is not available" not in str(err):      # --device cuda on a machine without one
            raise
        parser.exit(2, f"gt-fused3s {args.command}: error: {err}\n")


if __name__ == "__main__":
    sys.exit(main())
