"""The work schedule of the fused forward kernel, built once per (graph,
heads, head dim) with vectorised ops and cached in ``BSBGraph.extras``.

A work item is a chunk of consecutive TCBs of one row window: a window with
more TCBs than the chunk bound is split into chunks that run in parallel and
write fp32 partials (O, m, l) to slots; the block that finishes a window's
last chunk merges them. Items are listed heaviest first (longest processing
time first), so the hardware block scheduler balances the load.

    items  int32 [I, 4]  (window, tcb_begin, tcb_end, slot or -1 if unsplit)
    slots  int32 [S, 4]  per slot of a split window: (window, first slot, end slot, 0)
"""
from __future__ import annotations

import functools
import os

import torch
from torch import Tensor

from .graph import BSBGraph

# Resident warp-teams per SM for each head dim (register-limited).
_TEAMS_PER_SM = {16: 24, 32: 16, 64: 12, 128: 8, 256: 4}


@functools.lru_cache(maxsize=None)
def _num_sms(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def work_schedule(bsb: BSBGraph, H: int, Dp: int) -> tuple[Tensor, Tensor]:
    """(items, slots) for ``H`` heads of (padded) head dim ``Dp``."""
    chunk_env = os.environ.get("GT_FUSED3S_CHUNK")      # tuning knob: fixed chunk bound
    key = f"fused3s_fwd_schedule:H={H}:D={Dp}" + (f":C={chunk_env}" if chunk_env else "")
    sched = bsb.extras.get(key)
    if sched is not None:
        return sched
    # Chunk bound C: about the work of one resident warp-team if the whole
    # graph were spread evenly over the GPU (at least 16 TCBs, even), so the
    # heaviest chunk ends near the average finish time (LPT order).
    # GT_FUSED3S_CHUNK=C fixes C (and the split threshold) for tuning.
    dev = bsb.device
    workers = _num_sms(dev) * _TEAMS_PER_SM[Dp]
    C = int(chunk_env) if chunk_env else max(16, -(-bsb.num_tcbs * H // workers))
    C += C % 2
    # Splitting costs a counter memset and a merge (a few us): windows of at
    # most 32 TCBs stay whole (measured on an H100: cheaper unsplit).
    threshold = C if chunk_env else max(32, C)
    if bsb.max_window_tcbs <= threshold:
        # Nothing to split (all molecule batches): one item per window, in
        # window_order, built without a host synchronisation.
        order = bsb.window_order
        begin = bsb.rw_offset[order.long()]
        end = bsb.rw_offset[order.long() + 1]
        items = torch.stack([order, begin, end, torch.full_like(order, -1)], 1).contiguous()
        slots = torch.empty((0, 4), dtype=torch.int32, device=dev)
        bsb.extras[key] = (items, slots)
        return items, slots
    cnt = (bsb.rw_offset[1:] - bsb.rw_offset[:-1]).long()
    order = bsb.window_order.long()
    cnt_o = cnt[order]
    nch = torch.where(cnt_o > threshold, (cnt_o + C - 1) // C, torch.ones_like(cnt_o))
    length = ((cnt_o + nch - 1) // nch + 1) // 2 * 2          # even chunk length
    nch = torch.where(cnt_o > 0, (cnt_o + length - 1) // length.clamp(min=1), torch.ones_like(nch))
    num_items = int(nch.sum())
    item_w = torch.repeat_interleave(order, nch, output_size=num_items)
    first = torch.cumsum(nch, 0) - nch
    ci = torch.arange(num_items, device=dev) - torch.repeat_interleave(first, nch, output_size=num_items)
    len_i = torch.repeat_interleave(length, nch, output_size=num_items)
    w_begin = bsb.rw_offset.long()[item_w]
    w_end = bsb.rw_offset.long()[item_w + 1]
    begin = w_begin + ci * len_i
    end = torch.minimum(begin + len_i, w_end)
    split = torch.repeat_interleave(nch > 1, nch, output_size=num_items)
    slot = torch.where(split, torch.cumsum(split.long(), 0) - 1, torch.full_like(begin, -1))
    by_work = torch.sort(end - begin, descending=True, stable=True).indices
    items = torch.stack([item_w, begin, end, slot], 1)[by_work].to(torch.int32).contiguous()
    heavy = nch > 1
    m_cnt = nch[heavy]
    m_end = torch.cumsum(m_cnt, 0)
    num_slots = int(m_end[-1]) if m_end.numel() else 0
    per_window = torch.stack([order[heavy], m_end - m_cnt, m_end, torch.zeros_like(m_cnt)], 1)
    slots = torch.repeat_interleave(per_window, m_cnt, dim=0, output_size=num_slots)
    slots = slots.to(torch.int32).contiguous()        # per slot: (window, first slot, end slot, 0)
    bsb.extras[key] = (items, slots)
    return items, slots
