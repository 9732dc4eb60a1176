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


def test_flex_timed_after_ours_where_both_do_not_fit(monkeypatch):
    """bench.sequence: where ours and Flex's call do not fit in memory at once,
    each is timed alone (Flex's rebuilt after ours), and the row says so."""
    from gt_fused3s.bench import sequence

    def side_by_side(calls, max_reps):
        if len(calls) > 1:
            raise torch.OutOfMemoryError("CUDA out of memory (fake)")
        return {n: {"median": 2.0 if n == "flex" else 1.0} for n in calls}

    built = []

    def make_flex():
        built.append(1)
        return (lambda: None), 0.5

    monkeypatch.setattr(sequence, "time_side_by_side", side_by_side)
    monkeypatch.setattr(sequence, "free_cuda_memory", lambda device: None)
    row = {}
    t = sequence._time_with_flex(row, lambda: None, make_flex, "diff", "note", "cpu", max_reps=3)
    assert {n: x["median"] for n, x in t.items()} == {"ours": 1.0, "flex": 2.0}
    assert len(built) == 2 and row["diff"] == 0.5 and "one after the other" in row["note"]
    # Flex's own failure is the row's note; ours is timed alone
    row = {}
    t = sequence._time_with_flex(row, lambda: None, lambda: 1 / 0, "diff", "note", "cpu", max_reps=3)
    assert list(t) == ["ours"] and "division by zero" in row["note"]
