"""The one timing harness of the benchmarks and the CLI tables: device time
with CUDA events, kernel time from the profiler, and what a user waits for
one call (wall time, host included).

* :func:`time_cuda`: median / p10 / p90 milliseconds of a call with CUDA
  events (L2 flushed before each call unless asked otherwise);
* :func:`time_side_by_side`: the same for calls compared with each other,
  timed in alternating rounds (each at the same GPU clock and heat);
* :func:`kernel_time`: the device time of the CUDA kernels of a call, from
  the profiler (CUPTI): what the GPU works, without launch gaps;
* :func:`time_wall`: what a user waits for one call on an idle GPU
  (synchronised) and the host's share (until the call returns);
* :func:`time_host`: synchronised wall clock of a call that may itself
  synchronise (a format build);
* :class:`Clock` / :func:`time_forwards`: marks on the device timeline
  between consecutive calls (streams of forwards or steps).
"""
from __future__ import annotations

import statistics
import time
import warnings
from collections.abc import Callable
from typing import Any

import torch


_FLUSH = None


def _flush_l2():
    global _FLUSH
    if _FLUSH is None:
        _FLUSH = torch.empty(256 * 1024 * 1024, dtype=torch.int8, device="cuda")
    _FLUSH.zero_()


def _estimate_reps(fn, warmup: int, min_reps: int, max_reps: int, budget_ms: float) -> int:
    """Warm ``fn`` up, time one synchronised call, and return how many calls
    fit ``budget_ms`` (within [min_reps, max_reps])."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    est = max((time.perf_counter() - t0) * 1e3, 1e-3)
    return int(min(max_reps, max(min_reps, budget_ms / est)))


def _timed_call(fn, flush: bool):
    """Record CUDA events around one call of ``fn()`` (the L2 flushed first
    where asked); read them after a synchronisation."""
    if flush:
        _flush_l2()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    fn()
    e.record()
    return s, e


def _stats(events) -> dict:
    ts = sorted(s.elapsed_time(e) for s, e in events)
    q = lambda f: ts[min(len(ts) - 1, int(f * (len(ts) - 1) + 0.5))]   # noqa: E731
    return {"median": statistics.median(ts), "p10": q(0.1), "p90": q(0.9), "reps": len(ts)}


def time_cuda(fn, *, min_reps: int = 10, max_reps: int = 200, budget_ms: float = 400.0,
              warmup: int = 3, flush: bool = True) -> dict:
    """Median / p10 / p90 milliseconds of ``fn()`` with CUDA events (L2 flushed
    before each call unless ``flush`` is False)."""
    reps = _estimate_reps(fn, warmup, min_reps, max_reps, budget_ms)
    events = [_timed_call(fn, flush) for _ in range(reps)]
    torch.cuda.synchronize()
    return _stats(events)


def time_side_by_side(fns: dict[str, Callable[[], Any]], *, rounds: int = 6, min_reps: int = 3,
                      max_reps: int = 50, budget_ms: float = 2000.0, warmup: int = 3,
                      flush: bool = False) -> dict[str, dict]:
    """:func:`time_cuda` of each of ``fns`` (name -> call), in ``rounds``
    alternating rounds (A B, B A, A B, ...): each call's share of the reps in
    each round, so that the calls compared see the same GPU clock and heat.
    Why: under sustained tensor-core load an H100 at its power cap (700 W)
    runs its SM clock at 1.6-1.8 GHz instead of 1.98 within a second (one
    call's time drifting by up to a quarter over 40 calls), so a call timed
    first, on a cool GPU, can read several percent faster than the same call
    timed after another (README, "the benchmark's wall and the clock")."""
    names = list(fns)
    reps = {n: _estimate_reps(fns[n], warmup, min_reps, max_reps, budget_ms) for n in names}
    events: dict[str, list] = {n: [] for n in names}
    for r in range(rounds):
        for n in (names if r % 2 == 0 else names[::-1]):
            share = -(-reps[n] // rounds)
            events[n] += [_timed_call(fns[n], flush) for _ in range(share)]
    torch.cuda.synchronize()
    return {n: _stats(events[n]) for n in names}


def kernel_time(fn, name: str | tuple[str, ...] = "fused3s_fwd_kernel", reps: int = 30,
                flush: bool = True) -> float | None:
    """Device time (ms) of the CUDA kernels whose name contains ``name`` (or
    one of a tuple of names), per
    call of ``fn()`` (their durations summed, over ``reps`` calls), read from
    the profiler (CUPTI): the kernels alone, without launch gaps. ``name=""``
    counts every kernel and memset of the call (pass ``flush=False`` then).
    None if unavailable."""
    try:
        from torch.profiler import ProfilerActivity, profile
        fn()
        torch.cuda.synchronize()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")   # the profiler's notes on event cycles
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(reps):
                    if flush:
                        _flush_l2()
                    fn()
                torch.cuda.synchronize()
            events = list(prof.events())
        names = (name,) if isinstance(name, str) else tuple(name)
        total, found = 0.0, False
        for e in events:
            if e.device_type == torch.autograd.DeviceType.CUDA and any(n in e.name for n in names):
                us = getattr(e, "device_time", None)
                if us is None:
                    us = getattr(e, "cuda_time", 0.0)
                total += us / 1e3
                found = True
        return total / reps if found else None
    except Exception:   # profiler unavailable: the column stays empty
        return None


def time_wall(fn, reps: int = 100) -> dict:
    """What a user waits for one call: ``wall`` = median milliseconds from
    calling ``fn()`` on an idle GPU to the end of its work (synchronised
    before and after), ``host`` = median milliseconds until ``fn()`` returns
    (the host's share: Python, checks, launches)."""
    for _ in range(20):         # caches, allocator, CPU clocks
        fn()
    walls, hosts = [], []
    for _ in range(reps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        t1 = time.perf_counter()
        torch.cuda.synchronize()
        t2 = time.perf_counter()
        hosts.append((t1 - t0) * 1e3)
        walls.append((t2 - t0) * 1e3)
    return {"wall": statistics.median(walls), "host": statistics.median(hosts)}


def time_host(fn, reps: int = 7) -> dict:
    """Wall-clock milliseconds of ``fn()`` (which may synchronise with the host),
    synchronised before and after; median / min / max."""
    fn()
    ts = []
    for _ in range(reps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        ts.append((time.perf_counter() - t0) * 1e3)
    return {"median": statistics.median(ts), "min": min(ts), "max": max(ts)}


class Clock:
    """Marks on the device's timeline: CUDA events on a GPU (read after one
    synchronisation), ``perf_counter`` on a CPU (where every op is synchronous)."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.device = device
        self.marks: list = []

    def mark(self) -> None:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self.marks.append(event)
        else:
            self.marks.append(time.perf_counter())

    def intervals_ms(self) -> list[float]:
        """Milliseconds between consecutive marks."""
        if self.cuda:
            torch.cuda.synchronize(self.device)
            return [a.elapsed_time(b) for a, b in zip(self.marks, self.marks[1:])]
        return [(b - a) * 1e3 for a, b in zip(self.marks, self.marks[1:])]


def time_forwards(forward: Callable[[int], Any], count: int, device: torch.device,
                  on_step: Callable[[], None] | None = None) -> list[float]:
    """Milliseconds of ``forward(r)`` for r = 0 .. count-1: a mark before and
    after each call (:class:`Clock`), no synchronisation in between."""
    clocks = []
    for r in range(count):
        clock = Clock(device)
        clock.mark()
        forward(r)
        clock.mark()
        clocks.append(clock)
        if on_step:
            on_step()
    return [c.intervals_ms()[0] for c in clocks]
