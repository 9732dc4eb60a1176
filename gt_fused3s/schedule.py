"""The work schedule of the fused kernels, built once per (graph, heads,
head dim) by :class:`~gt_fused3s.plan.GraphPlan`: on a GPU by one op
(``gt_fused3s::work_schedule``, csrc/kernels/work_schedule.cu), elsewhere by
:func:`work_schedule_from_counts`, its specification in PyTorch.

A work item is a chunk of consecutive TCBs of one row window: a window with
more TCBs than the chunk bound is split into chunks that run in parallel and
write fp32 partials (O, m, l) to slots; the block that finishes a window's
last chunk merges them. Items are listed heaviest first (longest processing
time first), so the hardware block scheduler balances the load.

    items  int32 [I, 4]  (window, tcb_begin, tcb_end, slot or -1 if unsplit);
                         window -1: an unused item of the capacity (the kernel skips it)
    slots  int32 [S, 4]  per slot of a split window: (window, first slot, end slot, 0)

Every array has a shape fixed by the window count ``R``, the TCB capacity
``T_cap`` and the chunk bound, never by the graph's contents, so a schedule
is built without a host synchronisation (in a captured CUDA graph, under
torch.compile): ``I = R + T_cap // C`` items and ``S = T_cap // C +
T_cap // (threshold + 1)`` slots bound what any graph of that capacity needs.
``exact=True`` (a prepared graph of known T) cuts both to what is used, with
one host synchronisation.
"""
from __future__ import annotations

import os

import torch
from torch import Tensor

from . import graph as _graph
from .graph import BSBGraph

# Resident warp-teams per SM for each head dim (register-limited).
_TEAMS_PER_SM = {16: 24, 32: 16, 64: 12, 128: 8, 256: 4}
_NUM_SMS: dict[torch.device, int] = {}     # a plain dict: torch.compile traces through it


def _num_sms(device: torch.device) -> int:
    n = _NUM_SMS.get(device)
    if n is None:
        n = _NUM_SMS[device] = torch.cuda.get_device_properties(device).multi_processor_count
    return n


def chunk_bounds(tcb_capacity: int, heads: int, head_dim: int, num_sms: int) -> tuple[int, int]:
    """(C, threshold): chunks of at most C TCBs, windows of more than
    ``threshold`` TCBs split. C is about the work of one resident warp-team
    if the whole graph were spread evenly over the GPU (at least 16 TCBs,
    even), so the heaviest chunk ends near the average finish time (LPT
    order). Splitting costs a counter memset and a merge (a few us): windows
    of at most 32 TCBs stay whole (measured on an H100: cheaper unsplit).
    ``GT_FUSED3S_CHUNK=C`` fixes C and the threshold, for tuning."""
    chunk_env = os.environ.get("GT_FUSED3S_CHUNK")
    if chunk_env:
        C = int(chunk_env)
        return C + C % 2, C + C % 2
    workers = num_sms * _TEAMS_PER_SM[head_dim]
    C = max(16, -(-tcb_capacity * heads // workers))
    C += C % 2
    return C, max(32, C)


def work_schedule(bsb: BSBGraph, heads: int, head_dim: int, *, exact: bool | None = None
                  ) -> tuple[Tensor, Tensor]:
    """(items, slots) of ``bsb`` for ``heads`` heads of (padded) head dim
    ``head_dim``; ``exact`` (default: unless ``bsb`` is static) cuts the
    arrays to their used rows (one host synchronisation)."""
    exact = not bsb.static if exact is None else exact
    dev = bsb.device
    R, T_cap = bsb.num_windows, bsb.tcb_capacity
    # a schedule built for a CPU format (tests, the CPU stand-ins) assumes an H100's 132 SMs
    C, threshold = chunk_bounds(T_cap, heads, head_dim, _num_sms(dev) if dev.type == "cuda" else 132)
    I_cap, S_cap = R + T_cap // C, T_cap // C + T_cap // (threshold + 1)
    if R == 0:
        empty = torch.empty((0, 4), dtype=torch.int32, device=dev)
        return empty, empty.clone()
    if _graph._op_build_available(dev):
        # one op (csrc/kernels/work_schedule.cu): the ~80 aten ops of the
        # PyTorch version are most of them a launch (an eager schedule took
        # 1.3-2.8 ms of the H100 machine's host time)
        from .ops import work_schedule_op
        items, slots, counts = work_schedule_op(bsb.rw_offset, bsb.window_order, C, threshold, I_cap, S_cap)
    else:
        items, slots, counts = work_schedule_from_counts(bsb.rw_offset, bsb.window_order, C, threshold,
                                                         I_cap, S_cap)
    if exact:
        num_items, num_slots = counts.tolist()
        items, slots = items[:num_items], slots[:num_slots]
    return items.contiguous(), slots.contiguous()


def work_schedule_from_counts(rw_offset: Tensor, window_order: Tensor, C: int, threshold: int,
                              I_cap: int, S_cap: int) -> tuple[Tensor, Tensor, Tensor]:
    """The schedule in PyTorch (the specification of the CUDA op and the CPU
    path): ``items`` int32 [I_cap, 4] and ``slots`` int32 [S_cap, 4] of the
    windows of ``rw_offset`` (R + 1 entries, R >= 1) listed heaviest first
    by ``window_order``, chunks of at most ``C`` TCBs for windows of more
    than ``threshold``; and ``counts`` int64 [2], the items and slots used."""
    dev = rw_offset.device
    R = window_order.numel()
    rw = rw_offset.long()
    order = window_order.long()                             # windows, heaviest first
    cnt = (rw[1:] - rw[:-1])[order]
    nch = torch.where(cnt > threshold, (cnt + C - 1) // C, torch.ones_like(cnt))
    length = ((cnt + nch - 1) // nch + 1) // 2 * 2           # even chunk length
    nch = torch.where(cnt > 0, (cnt + length - 1) // length.clamp(min=1), torch.ones_like(nch))
    ends = torch.cumsum(nch, 0)                             # one past each window's last item
    # Item i belongs to the window at position p = #(ends <= i); p == R: unused.
    i = torch.arange(I_cap, device=dev)
    p = torch.searchsorted(ends, i, right=True)
    used = p < R
    p = p.clamp(max=R - 1)
    chunk = i - (ends[p] - nch[p])                          # chunk number within its window
    win = order[p]
    begin = rw[win] + chunk * length[p]
    end = torch.minimum(begin + length[p], rw[win + 1])
    split = used & (nch[p] > 1)
    slot = torch.where(split, torch.cumsum(split, 0) - 1, -1)
    work = torch.where(used, end - begin, -1)               # unused items sort last
    items = torch.stack([torch.where(used, win, -1), torch.where(used, begin, 0),
                         torch.where(used, end, 0), slot], 1)
    # int32 keys (a chunk's TCB count): half the radix passes of int64 ones
    items = items[torch.sort(work.int(), descending=True, stable=True).indices].to(torch.int32)
    # Slot of chunk c of a split window: its window and the window's slot range.
    first = slot - chunk
    rows = torch.stack([win, first, first + nch[p], torch.zeros_like(win)], 1)
    # row S_cap collects the rest; a scatter, not an index assignment (which
    # sorts its indices on CUDA: 65 us per schedule for ZINC batches)
    slots = torch.zeros((S_cap + 1, 4), dtype=torch.long, device=dev)
    slots.scatter_(0, torch.where(split, slot, S_cap).unsqueeze(1).expand(-1, 4), rows)
    counts = torch.stack([ends[-1], (nch * (nch > 1)).sum()])
    return items, slots[:S_cap].to(torch.int32), counts
