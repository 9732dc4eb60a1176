"""The kernels' work schedule (its PyTorch specification, which the CUDA op
must equal bit for bit: tests/test_graph_cuda.py), checked on the CPU:
every TCB is covered by exactly one item, split windows have consistent
slots, and the schedule at capacity (static shapes, no host sync) holds the
exact one followed by unused items."""
import dataclasses

import pytest
import torch

import gt_fused3s.schedule as schedule
from gt_fused3s.graph import BSBGraph, tcb_capacity


@pytest.fixture(autouse=True)
def h100_sms(monkeypatch):
    monkeypatch.setattr(schedule, "_num_sms", lambda device: 132)


def _graph(n, e, heavy, seed):
    g = torch.Generator().manual_seed(seed)
    ei = torch.randint(0, n, (2, e), generator=g)
    ei[1, :heavy] = 5                                  # one heavy destination row
    return BSBGraph.from_edge_index(ei, n)


def _at_capacity(bsb):
    """``bsb`` as the static builder makes it: cols / bitmap padded to capacity."""
    cap = tcb_capacity(bsb.num_edges, bsb.num_nodes)
    pad = cap - bsb.num_tcbs
    return dataclasses.replace(
        bsb, cols=torch.cat([bsb.cols, torch.full((pad * 8,), -1, dtype=torch.int32)]),
        bitmap=torch.cat([bsb.bitmap, torch.zeros(pad, 2, dtype=torch.long)]), static=True)


def _check_cover(bsb, items, slots):
    items = items.long()
    cnt = (bsb.rw_offset[1:] - bsb.rw_offset[:-1]).long()
    covered = torch.zeros(bsb.num_tcbs, dtype=torch.long)
    for w, b, e, s in items.tolist():
        assert bsb.rw_offset[w] <= b <= e <= bsb.rw_offset[w + 1]
        covered[b:e] += 1
    assert torch.all(covered == 1)
    # one item per unsplit window (empty ones included), heaviest items first
    per_window = torch.bincount(items[:, 0], minlength=bsb.num_windows)
    assert torch.all(per_window >= 1)
    work = items[:, 2] - items[:, 1]
    assert torch.all(work[:-1] >= work[1:])
    split = items[items[:, 3] >= 0]
    assert torch.equal(torch.sort(split[:, 3]).values, torch.arange(split.size(0)))
    for w, b, e, s in split.tolist():
        sw, first, end, _ = slots[s].tolist()
        assert sw == w and first <= s < end and end - first == per_window[w] > 1
    assert torch.all(per_window[cnt <= 32] == 1)      # light windows are never split


@pytest.mark.parametrize("n,e,heavy,H,D", [(1003, 4000, 0, 1, 64), (5000, 60000, 3000, 1, 128),
                                           (5000, 60000, 3000, 8, 32), (17, 0, 0, 2, 16),
                                           (3000, 90000, 2900, 4, 256)])
def test_schedule_covers_every_tcb_once(n, e, heavy, H, D):
    bsb = _graph(n, e, heavy, n)
    items, slots = schedule.work_schedule(bsb, H, D)
    assert items.dtype == slots.dtype == torch.int32 and slots.shape[1] == 4
    _check_cover(bsb, items, slots)
    assert slots.size(0) == (items[:, 3] >= 0).sum()             # exact: no unused slot
    if heavy:
        assert slots.size(0) > 0                                  # the heavy window is split


@pytest.mark.parametrize("n,e,heavy,H,D", [(1003, 4000, 0, 1, 64), (5000, 60000, 3000, 1, 128),
                                           (5000, 60000, 3000, 8, 32), (17, 0, 0, 2, 16)])
def test_schedule_at_capacity_is_the_exact_one_plus_unused_items(n, e, heavy, H, D):
    bsb = _at_capacity(_graph(n, e, heavy, n))
    items, slots = schedule.work_schedule(bsb, H, D)            # static: capacity shapes
    C, threshold = schedule.chunk_bounds(bsb.tcb_capacity, H, D, 132)
    R, T_cap = bsb.num_windows, bsb.tcb_capacity
    assert items.shape == (R + T_cap // C, 4) if R else items.shape == (0, 4)
    assert slots.size(0) == (T_cap // C + T_cap // (threshold + 1) if R else 0)
    used = items[:, 0] >= 0
    assert torch.all(used[:-1] >= used[1:])                       # unused items come last
    assert torch.all(items[~used] == torch.tensor([-1, 0, 0, -1], dtype=torch.int32))
    exact = dataclasses.replace(bsb, static=False)
    e_items, e_slots = schedule.work_schedule(exact, H, D)
    assert torch.equal(items[used], e_items)
    assert torch.equal(slots[:e_slots.size(0)], e_slots)
    _check_cover(dataclasses.replace(bsb, cols=bsb.cols[:bsb.num_tcbs * 8],
                                     bitmap=bsb.bitmap[:bsb.num_tcbs], static=False),
                 items[used], slots)


def test_chunk_bound_env_override(monkeypatch):
    monkeypatch.setenv("GT_FUSED3S_CHUNK", "7")
    assert schedule.chunk_bounds(10**6, 8, 64, 132) == (8, 8)


@pytest.mark.parametrize("n,e,heavy,H,D", [(1003, 4000, 0, 1, 64), (5000, 60000, 3000, 1, 128),
                                           (5000, 60000, 3000, 8, 32), (3000, 90000, 2900, 4, 256)])
@pytest.mark.parametrize("chunk_env", [None, "2", "7"])
def test_schedule_counts_and_the_op_s_key_bound(n, e, heavy, H, D, chunk_env, monkeypatch):
    """What the CUDA op (csrc/kernels/work_schedule.cu) relies on, in the
    specification: no item longer than the split threshold (its sort key has
    the threshold's bits), and counts = the items and slots in use, within
    the capacities."""
    if chunk_env:
        monkeypatch.setenv("GT_FUSED3S_CHUNK", chunk_env)
    for bsb in (_graph(n, e, heavy, n), _at_capacity(_graph(n, e, heavy, n))):
        C, threshold = schedule.chunk_bounds(bsb.tcb_capacity, H, D, 132)
        R, T_cap = bsb.num_windows, bsb.tcb_capacity
        I_cap, S_cap = R + T_cap // C, T_cap // C + T_cap // (threshold + 1)
        items, slots, counts = schedule.work_schedule_from_counts(bsb.rw_offset, bsb.window_order, C,
                                                                  threshold, I_cap, S_cap)
        used = items[:, 0] >= 0
        assert counts.tolist() == [int(used.sum()), int((items[:, 3] >= 0).sum())]
        assert counts[0] <= I_cap and counts[1] <= S_cap
        assert int((items[:, 2] - items[:, 1]).max()) <= threshold
        if chunk_env:
            assert counts[1] > 0                                  # windows were split


def test_schedule_through_the_op(stand_in_kernels, monkeypatch):
    """A plan's schedules come from the registered op where the builder ops
    run (stand-ins on the CPU: they check the op's preconditions), exact and
    at capacity, equal to the PyTorch path."""
    import gt_fused3s.graph as graph_mod
    for bsb in (_graph(5000, 60000, 3000, 1), _at_capacity(_graph(5000, 60000, 3000, 1))):
        stand_in_kernels.calls.clear()
        got = schedule.work_schedule(bsb, 4, 32)
        assert stand_in_kernels.calls == ["work_schedule"]
        stand_in_kernels.calls.clear()
        with monkeypatch.context() as m:
            m.setattr(graph_mod, "_op_build_available", lambda device: False)
            want = schedule.work_schedule(bsb, 4, 32)
        assert not stand_in_kernels.calls
        assert all(torch.equal(a, b) for a, b in zip(got, want))
