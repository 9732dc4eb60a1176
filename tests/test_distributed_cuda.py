"""Partitioned attention on the GPU (run on the GPU machine): NCCL with
world size 1 runs the distributed code path (a local graph, the halo
exchange of nothing, the fused kernel on the padded local graph) and equals
the fused attention on the whole graph, forward and backward."""
import os
import tempfile

import pytest
import torch
import torch.distributed as dist
from test_distributed import _rank, _run_ranks

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


# ------------------------------------------------------------ two GPUs (NCCL)
two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")


@_rank
def _nccl_rank(rank, world, init, full_send=0.8):
    """Rank ``rank`` of a group of GPUs: its share of the partitioned
    attention equals the fused attention on the whole graph (forward,
    gradients)."""
    from gt_fused3s import GraphPlan, fused3s_attention
    from gt_fused3s.distributed import exchange_timer, local_graph, partition_nodes, partitioned_attention
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=init, rank=rank, world_size=world)
    g = torch.Generator().manual_seed(0)
    n = 3000
    ei = torch.randint(0, n, (2, 20000), generator=g).cuda()
    lg = local_graph(ei, n, partition_nodes(ei, n, world), rank, parts=world, full_send=full_send)
    assert any(lg.send_full) == (full_send < 1.0)      # all rows sent as one tensor, or gathers
    q, k, v, do = (torch.randn(n, 4, 32, generator=g).to("cuda", torch.bfloat16) for _ in range(4))
    bias = torch.randn(ei.size(1), 4, generator=g).cuda()
    a = [t[lg.nodes].clone().requires_grad_() for t in (q, k, v)] + [bias[lg.edge_ids].clone().requires_grad_()]
    b = [t.clone().requires_grad_() for t in (q, k, v, bias)]
    with exchange_timer() as timer:
        out = partitioned_attention(*a[:3], lg, 0.2, edge_bias=a[3])
        out.backward(do[lg.nodes])
    # 4 head chunks: K|V out, dK|dV back per chunk
    assert timer.count == 2 * lg.head_chunks and timer.ms() > 0
    ref = fused3s_attention(*b[:3], GraphPlan.from_edge_index(ei, n), 0.2, edge_bias=b[3])
    ref.backward(do)
    torch.testing.assert_close(out, ref[lg.nodes], atol=2e-2, rtol=2e-2)
    for x, y, rows in zip(a, b, [lg.nodes] * 3 + [lg.edge_ids]):   # dK, dV: halo gradients added
        torch.testing.assert_close(x.grad.float(), y.grad[rows].float(), atol=3e-2, rtol=3e-2)


@two_gpus
def test_two_gpus_partitioned_attention_equals_one_gpu():
    _run_ranks(_nccl_rank, 2)


@pytest.mark.skipif(torch.cuda.device_count() < 4, reason="needs 4 GPUs")
@pytest.mark.parametrize("full_send", [0.5, 1.0])
def test_four_gpus_partitioned_attention_equals_one_gpu(full_send):
    """Each rank reads about 80% of every other's rows: with full blocks
    (the local rows sent to three ranks as one tensor, three gradient
    blocks summed per row) and with gathered blocks (full_send 1.0)."""
    _run_ranks(_nccl_rank, 4, full_send)


@two_gpus
def test_two_gpus_data_parallel_eager_and_captured_equal_one_process():
    """`gt-fused3s train` data parallel on 2 GPUs: DDP (eager) and the
    captured step (fused3s@graph: the gradient all-reduce replayed inside the
    CUDA graph) give the losses of one process on the same global batches."""
    from test_distributed import _train_cfg, _train_under_torchrun
    from gt_fused3s.bench.distributed import global_batch_losses
    with tempfile.TemporaryDirectory() as tmp:
        cfg = _train_cfg(tmp, device="cuda", dtype="fp32", backends=["fused3s"], compiled_runs=False)
        got = _train_under_torchrun(cfg, 2)
    expect = global_batch_losses(cfg, 2, torch.device("cuda"))
    for backend in ("fused3s@graph", "fused3s"):
        losses = [loss for b, loss in got[0][1] if b == backend]
        assert losses == pytest.approx(expect, rel=2e-3), (backend, losses, expect)


@two_gpus
def test_two_gpus_compiled_data_parallel_equals_one_process():
    """`gt-fused3s train` data parallel on 2 GPUs, the compiled modes: the
    bare model compiled (torch.compile, its gradients averaged by one
    all-reduce after the compiled backward; reduce-overhead: its CUDA-graph
    trees too) and the compiled model inside the captured step (the
    all-reduce replayed inside the CUDA graph) give the losses of one
    process on the same global batches."""
    from test_distributed import _train_cfg, _train_under_torchrun
    from gt_fused3s.bench.distributed import global_batch_losses
    runs = ["fused3s@compile", "fused3s@compile-graph", "fused3s@reduce-overhead", "pyg@compile"]
    with tempfile.TemporaryDirectory() as tmp:
        cfg = _train_cfg(tmp, device="cuda", dtype="fp32", backends=runs, compiled_runs=False,
                         max_buckets=1)
        got = _train_under_torchrun(cfg, 2, statuses=["ok"] * len(runs), timeout=600)   # 4 compiles
    expect = global_batch_losses(cfg, 2, torch.device("cuda"))
    for backend in runs:
        losses = [loss for b, loss in got[0][1] if b == backend]
        assert losses == pytest.approx(expect, rel=2e-3), (backend, losses, expect)
