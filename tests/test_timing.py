"""The timing harness's bookkeeping on a CPU (the CUDA events faked): calls
compared side by side are timed in alternating rounds, each its own share."""
import torch

from gt_fused3s.bench import timing


class _FakeEvent:
    clock = [0.0]

    def __init__(self, enable_timing=True):
        self.t = None

    def record(self):
        self.t = _FakeEvent.clock[0]

    def elapsed_time(self, end):
        return end.t - self.t


def test_side_by_side_alternates_rounds_and_times_each_call_apart(monkeypatch):
    order = []

    def call(name, ms):
        def fn():
            order.append(name)
            _FakeEvent.clock[0] += ms
        return fn

    monkeypatch.setattr(torch.cuda, "Event", _FakeEvent)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    monkeypatch.setattr(timing, "_estimate_reps", lambda fn, *a: 4)
    got = timing.time_side_by_side({"a": call("a", 1.0), "b": call("b", 3.0)}, rounds=4, flush=False)
    assert got["a"]["median"] == 1.0 and got["b"]["median"] == 3.0
    assert got["a"]["reps"] == got["b"]["reps"] == 4
    # one call each a round (4 reps over 4 rounds), the order reversed every other round
    assert "".join(order) == "abbaabba"
