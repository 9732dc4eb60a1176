"""The kernel's work schedule (built with torch ops, so checked on the CPU):
every TCB is covered by exactly one item, split windows have consistent
slots, and the sync-free path for graphs without heavy windows equals the
general one."""
import dataclasses

import pytest
import torch

import gt_fused3s.schedule as schedule
from gt_fused3s.graph import BSBGraph


@pytest.fixture(autouse=True)
def h100_sms(monkeypatch):
    monkeypatch.setattr(schedule, "_num_sms", lambda device: 132)


def _graph(n, e, heavy, seed):
    g = torch.Generator().manual_seed(seed)
    ei = torch.randint(0, n, (2, e), generator=g)
    ei[1, :heavy] = 5                                  # one heavy destination row
    return BSBGraph.from_edge_index(ei, n)


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
    assert torch.equal(torch.sort(split[:, 3]).values, torch.arange(slots.size(0)))
    for w, b, e, s in split.tolist():
        sw, first, end, _ = slots[s].tolist()
        assert sw == w and first <= s < end and end - first == per_window[w] > 1
    assert torch.all(per_window[cnt <= 32] == 1)      # light windows are never split


@pytest.mark.parametrize("n,e,heavy,H,D", [(1003, 4000, 0, 1, 64), (5000, 60000, 3000, 1, 128),
                                           (5000, 60000, 3000, 8, 32), (17, 0, 0, 2, 16)])
def test_schedule_covers_every_tcb_once(n, e, heavy, H, D):
    bsb = _graph(n, e, heavy, n)
    items, slots = schedule.work_schedule(bsb, H, D)
    assert items.dtype == slots.dtype == torch.int32 and slots.shape[1] == 4
    _check_cover(bsb, items, slots)
    assert schedule.work_schedule(bsb, H, D)[0] is items          # cached per (H, D)
    if heavy:
        assert slots.size(0) > 0                                  # the heavy window is split


def test_sync_free_path_equals_general_path():
    bsb = _graph(3000, 20000, 0, 1)
    fast = schedule.work_schedule(bsb, 1, 64)
    general_bsb = dataclasses.replace(bsb, max_window_tcbs=10**9, extras={})
    general = schedule.work_schedule(general_bsb, 1, 64)
    assert torch.equal(fast[0], general[0]) and torch.equal(fast[1], general[1])
