"""Partitioned attention on the GPU (run on the GPU machine): NCCL with
world size 1 runs the distributed code path (a local graph, the halo
exchange of nothing, the fused kernel on the padded local graph) and equals
the fused attention on the whole graph, forward and backward."""
import os
import tempfile

import pytest
import torch
import torch.distributed as dist

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available() or not dist.is_nccl_available(),
                       reason="needs a CUDA GPU and NCCL"),
]


def test_nccl_world_size_one_equals_fused_attention():
    from gt_fused3s import GraphPlan, fused3s_attention
    from gt_fused3s.distributed import local_graph, partition_nodes, partitioned_attention
    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group("nccl", init_method="file://" + os.path.join(tmp, "r"), rank=0, world_size=1)
        try:
            g = torch.Generator().manual_seed(0)
            n = 2000
            ei = torch.randint(0, n, (2, 12000), generator=g).cuda()
            lg = local_graph(ei, n, partition_nodes(ei, n, 1), 0)
            q, k, v, do = (torch.randn(n, 4, 32, device="cuda", dtype=torch.float16) for _ in range(4))
            bias = torch.randn(ei.size(1), 4, device="cuda")
            a = [t.clone().requires_grad_() for t in (q, k, v, bias)]
            b = [t.clone().requires_grad_() for t in (q, k, v, bias)]
            out = partitioned_attention(*a[:3], lg, 0.2, edge_bias=a[3][lg.edge_ids])
            ref = fused3s_attention(*b[:3], GraphPlan.from_edge_index(ei, n), 0.2, edge_bias=b[3])
            out.backward(do)
            ref.backward(do)
            torch.testing.assert_close(out, ref[lg.nodes])
            for x, y in zip(a, b):
                torch.testing.assert_close(x.grad, y.grad, atol=2e-3, rtol=2e-3)
        finally:
            dist.destroy_process_group()
