"""The GPU builders of a plan's arrays must give exactly those of their
PyTorch versions: the BSB format (csrc/kernels/bsb_build.cu against
BSBGraph._build, which test_graph.py checks against hand-made graphs), the
edge slots (edge_slots.cu) and the work schedule (work_schedule.cu against
schedule.work_schedule_from_counts, which test_schedule.py checks)."""
import os
import sys

import pytest
import torch

from gt_fused3s.graph import BSBGraph

from cuda_marks import GPU_TESTS
from graph_cases import GRAPH_CASES

pytestmark = GPU_TESTS

FIELDS = ("rw_offset", "cols", "bitmap", "window_order", "edge_index", "counters")


def _assert_same(gpu: BSBGraph, cpu: BSBGraph):
    assert gpu.device.type == "cuda"
    assert gpu.num_nodes == cpu.num_nodes and gpu.num_duplicates == cpu.num_duplicates
    for name in FIELDS:
        a, b = getattr(gpu, name), getattr(cpu, name)
        assert a.dtype == b.dtype, name
        assert torch.equal(a.cpu(), b), name


@pytest.mark.parametrize("case", sorted(GRAPH_CASES))
@pytest.mark.parametrize("index_dtype", [torch.int64, torch.int32])
def test_gpu_builder_equals_cpu_builder(case, index_dtype):
    ei, n = GRAPH_CASES[case]()
    ei = ei.to(index_dtype)
    _assert_same(BSBGraph.from_edge_index(ei.cuda(), n), BSBGraph.from_edge_index(ei, n))


def test_gpu_builder_on_shared_data_and_unsorted_strided_input():
    sys.path.insert(0, _data_dir())
    import load
    for name in ("cora", "github"):
        n, indptr, indices = load.csr(name)
        indptr, indices = torch.from_numpy(indptr), torch.from_numpy(indices)
        _assert_same(BSBGraph.from_csr(indptr.cuda(), indices.cuda()), BSBGraph.from_csr(indptr, indices))
    n, src, dst = load.batch("peptides", 0, 1024)
    ei = torch.stack([torch.from_numpy(src), torch.from_numpy(dst)]).long()
    perm = torch.randperm(ei.size(1), generator=torch.Generator().manual_seed(0))
    ei = torch.cat([ei[:, perm], ei[:, :50]], 1)                     # shuffled + duplicates
    strided = ei.t().contiguous().cuda().t()                        # [2, E] with strides (1, 2)
    _assert_same(BSBGraph.from_edge_index(strided, n), BSBGraph.from_edge_index(ei, n))


def test_gpu_builder_random_large_and_empty():
    g = torch.Generator().manual_seed(3)
    n = 50_001
    ei = torch.randint(0, n, (2, 400_000), generator=g)
    ei[1, :20_000] = 7                                              # one heavy row
    _assert_same(BSBGraph.from_edge_index(ei.cuda(), n), BSBGraph.from_edge_index(ei, n))
    empty = torch.zeros(2, 0, dtype=torch.long)
    for nodes in (0, 1, 33):
        _assert_same(BSBGraph.from_edge_index(empty.cuda(), nodes), BSBGraph.from_edge_index(empty, nodes))


@pytest.mark.parametrize("edge_index,num_nodes,match", [
    ([[0, 5], [1, 2]], 5, "index 5 out of range for num_nodes=5"),
    ([[0, 1], [1, -2]], 5, "negative index -2"),
    ([[0, 1], [1, 2]], 2, "index 2 out of range for num_nodes=2"),
])
def test_gpu_builder_rejects_bad_indices(edge_index, num_nodes, match):
    with pytest.raises(ValueError, match=match):
        BSBGraph.from_edge_index(torch.tensor(edge_index, device="cuda"), num_nodes)


def _data_dir():
    here = os.path.dirname(os.path.abspath(__file__))
    for d in (os.environ.get("GT_FUSED3S_DATA"), os.path.join(here, "..", "..", "shared", "data"),
              os.path.join(here, "..", ".data")):
        if d and os.path.exists(os.path.join(d, "load.py")):
            return d
    pytest.skip("shared data folder not found")


def _slots_both_ways(bsb: BSBGraph, ei: torch.Tensor, monkeypatch) -> tuple:
    """(the CUDA op's edge_slots, the PyTorch version's) of one format."""
    import gt_fused3s.graph as graph_mod
    got = graph_mod.edge_slots(bsb, ei)
    with monkeypatch.context() as m:
        m.setattr(graph_mod, "_op_build_available", lambda device: False)
        want = graph_mod.edge_slots(bsb, ei)
    return got, want


@pytest.mark.parametrize("case", sorted(GRAPH_CASES))
@pytest.mark.parametrize("static", [False, True])
def test_edge_slots_op_equals_the_torch_version(case, static, monkeypatch):
    """ops.edge_slots_op (csrc/kernels/edge_slots.cu) gives exactly the
    PyTorch edge_slots' arrays, for the format and its transpose, edges in
    a shuffled order (duplicates take their columns in the order listed),
    exact and static (capacity) builds."""
    ei, n = GRAPH_CASES[case]()
    perm = torch.randperm(ei.size(1), generator=torch.Generator().manual_seed(3))
    ei = ei[:, perm].cuda()
    for e in (ei, ei.flip(0)):
        bsb = BSBGraph.from_edge_index(e, n, static=static)
        got, want = _slots_both_ways(bsb, e, monkeypatch)
        for name, a, b in zip(("nnz_offset", "slot_edge", "slot_pos"), got, want):
            assert a.dtype == b.dtype and torch.equal(a, b), f"{case} static={static}: {name}"


def test_edge_slots_op_on_shared_data(monkeypatch):
    """The same on github (a hub of 9,458 in-edges: long windows) and a
    shuffled peptides batch with duplicates."""
    sys.path.insert(0, _data_dir())
    import load
    n, indptr, indices = load.csr("github")
    dst = torch.repeat_interleave(torch.arange(n), torch.from_numpy(indptr).diff())
    graphs = {"github": (torch.stack([torch.from_numpy(indices).long(), dst]), n)}
    n, src, dst = load.batch("peptides", 0, 1024)
    ei = torch.stack([torch.from_numpy(src), torch.from_numpy(dst)]).long()
    perm = torch.randperm(ei.size(1), generator=torch.Generator().manual_seed(0))
    graphs["peptides"] = (torch.cat([ei[:, perm], ei[:, :50]], 1), n)
    for name, (ei, n) in graphs.items():
        for e in (ei.cuda(), ei.flip(0).cuda()):
            got, want = _slots_both_ways(BSBGraph.from_edge_index(e, n), e, monkeypatch)
            for a, b in zip(got, want):
                assert torch.equal(a, b), name


def _schedules_both_ways(bsb: BSBGraph, heads: int, head_dim: int, monkeypatch) -> tuple:
    """(the CUDA op's work schedule, the PyTorch version's) of one format."""
    import gt_fused3s.graph as graph_mod
    import gt_fused3s.schedule as schedule_mod
    got = schedule_mod.work_schedule(bsb, heads, head_dim)
    with monkeypatch.context() as m:
        m.setattr(graph_mod, "_op_build_available", lambda device: False)
        want = schedule_mod.work_schedule(bsb, heads, head_dim)
    return got, want


def _assert_same_schedule(got, want, what):
    for name, a, b in zip(("items", "slots"), got, want):
        assert a.dtype == b.dtype == torch.int32 and a.is_cuda, f"{what}: {name}"
        assert torch.equal(a, b), f"{what}: {name}"


@pytest.mark.parametrize("case", sorted(GRAPH_CASES))
@pytest.mark.parametrize("static", [False, True])
def test_work_schedule_op_equals_the_torch_version(case, static, monkeypatch):
    """ops.work_schedule_op (csrc/kernels/work_schedule.cu) gives exactly the
    PyTorch schedule (items in the same heaviest-first order, ties in the
    windows' order; the same slots), for the format and its transpose, exact
    (cut to the used rows by the op's counts) and static (capacity) builds,
    at head settings of different chunk bounds."""
    ei, n = GRAPH_CASES[case]()
    for e in (ei.cuda(), ei.flip(0).cuda()):
        bsb = BSBGraph.from_edge_index(e, n, static=static)
        if bsb.num_windows == 0:
            continue
        for heads, head_dim in ((1, 64), (8, 16), (4, 256)):
            got, want = _schedules_both_ways(bsb, heads, head_dim, monkeypatch)
            _assert_same_schedule(got, want, f"{case} static={static} H={heads} D={head_dim}")


def test_work_schedule_op_on_shared_data_and_small_chunks(monkeypatch):
    """The same on github (hub windows of hundreds of TCBs, split into many
    chunks), a peptides batch, and with GT_FUSED3S_CHUNK=2 (every window of
    more than 2 TCBs split: most items and slots)."""
    sys.path.insert(0, _data_dir())
    import load
    n, indptr, indices = load.csr("github")
    dst = torch.repeat_interleave(torch.arange(n), torch.from_numpy(indptr).diff())
    graphs = {"github": (torch.stack([torch.from_numpy(indices).long(), dst]), n)}
    n, src, dst = load.batch("peptides", 0, 1024)
    graphs["peptides"] = (torch.stack([torch.from_numpy(src), torch.from_numpy(dst)]).long(), n)
    for chunk in (None, "2"):
        if chunk:
            monkeypatch.setenv("GT_FUSED3S_CHUNK", chunk)
        for name, (ei, n) in graphs.items():
            for static in (False, True):
                bsb = BSBGraph.from_edge_index(ei.cuda(), n, static=static)
                got, want = _schedules_both_ways(bsb, 4, 32, monkeypatch)
                _assert_same_schedule(got, want, f"{name} static={static} chunk={chunk}")
                if name == "github" or chunk:
                    assert (got[0][:, 3] >= 0).any(), f"{name}: no split window"
