"""The Graph Transformer's inference and training drivers behind
``gt-fused3s infer`` and ``gt-fused3s train`` (:mod:`gt_fused3s.cli`):
``infer`` (batched and single-graph inference, every backend side by side),
``train`` (training steps and losses against the pyg backend) and ``stream``
(the batch stream both share). They use the benchmarks' timing harness and
run helpers (:mod:`gt_fused3s.bench.timing`, :mod:`gt_fused3s.bench.common`)."""
