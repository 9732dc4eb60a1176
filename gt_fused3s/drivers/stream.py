"""Streaming batched inference: batches of graphs go from (pinned) host memory
to the device, each with its graph format built ahead of its forward.

With ``prefetch`` on a GPU, batch ``i + 1`` is copied and its format (the
BSB and the kernel's schedule, through ``GraphTransformer.prepare_graph``)
built on a side CUDA stream while batch ``i`` computes on the current stream:

- the side stream first waits for the current one (it starts after what is
  already queued there, e.g. a timing event);
- a batch's copy and build end with an event on the side stream, and the
  current stream waits on that event before the batch is handed out;
- every tensor of a handed-out batch (its data and its formats) is
  ``record_stream``-ed on the current stream, so the caching allocator gives
  its memory back to the side stream only once the current stream is done
  with it;
- the builder's host synchronisations wait for the side stream only, so the
  current stream keeps computing meanwhile (without prefetch, they wait for
  the previous forward to finish, and the GPU idles while the host builds).

Batch ``i + 1`` is staged after batch ``i`` is handed out, i.e. once the
caller has queued batch ``i``'s forward. Without prefetch, or on a CPU, a
batch is staged inline on the current stream just before it is handed out.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass
from types import FunctionType, ModuleType
from typing import Iterable, Iterator, Sequence

import torch
from torch import Tensor
from torch_geometric.data import Data

from ..backends import AttentionGraph


@dataclass
class Staged:
    """A batch ready for a forward: ``model(data.x, data.edge_index, data.batch,
    graph=graph, num_graphs=num_graphs(data))`` makes no host synchronisation."""

    data: Data              # on the device
    graph: AttentionGraph   # prepared for the model's backend


def pin(data: Data) -> Data:
    """``data`` in pinned host memory (for asynchronous copies), where CUDA is
    available; as is elsewhere."""
    return data.pin_memory() if torch.cuda.is_available() else data


def num_graphs(data: Data) -> int:
    """Graphs in a batch (1 for a single graph), read from shapes: no sync."""
    return data.ptr.numel() - 1 if "ptr" in data else 1


def to_device(data: Data, device: torch.device) -> Data:
    """A copy of ``data`` on ``device`` (asynchronous from pinned memory).
    ``data`` itself stays where it is: PyG's ``Data.to`` moves a batch in
    place, which would leave a streamed host batch on the device after its
    first forward (and every later forward with no copy to time)."""
    return copy.copy(data).to(device, non_blocking=True)


def stage(data: Data, model, device: torch.device) -> Staged:
    """Copy ``data`` to ``device`` (asynchronously from pinned memory) and
    build the graph format that ``model``'s backend reads, on the current stream."""
    with torch.inference_mode():
        d = to_device(data, device)
        graph = model.prepare_graph(model.make_graph(d.edge_index, d.num_nodes))
    return Staged(d, graph)


def stream_batches(batches: Sequence[Data], model, device: torch.device,
                   indices: Iterable[int] | None = None, *,
                   prefetch: bool = True) -> Iterator[Staged]:
    """Yield ``batches[i]`` for ``i`` in ``indices`` (default: all, in order),
    staged for ``model`` on ``device``; with ``prefetch`` on a GPU, the next
    batch is staged on a side stream while the caller computes (see the
    module docstring)."""
    indices = list(range(len(batches)) if indices is None else indices)
    if not (prefetch and device.type == "cuda"):
        for i in indices:
            yield stage(batches[i], model, device)
        return
    main = torch.cuda.current_stream(device)
    side = torch.cuda.Stream(device)
    side.wait_stream(main)

    def stage_on_side(i: int) -> tuple[Staged, torch.cuda.Event]:
        with torch.cuda.stream(side):
            staged = stage(batches[i], model, device)
            ready = torch.cuda.Event()
            ready.record(side)
        return staged, ready

    pending = stage_on_side(indices[0]) if indices else None
    for k in range(len(indices)):
        staged, ready = pending
        main.wait_event(ready)
        for t in _tensors(staged):
            if t.is_cuda:
                t.record_stream(main)
        yield staged
        pending = stage_on_side(indices[k + 1]) if k + 1 < len(indices) else None


def _tensors(obj, seen: set | None = None) -> Iterator[Tensor]:
    """Every tensor reachable from ``obj`` through containers and object
    attributes (a batch's data, its AttentionGraph's formats and their
    cached schedules)."""
    seen = set() if seen is None else seen
    if id(obj) in seen:
        return
    seen.add(id(obj))
    if isinstance(obj, Tensor):
        yield obj
    elif isinstance(obj, Data):
        for value in obj.to_dict().values():
            yield from _tensors(value, seen)
    elif isinstance(obj, dict):
        for value in obj.values():
            yield from _tensors(value, seen)
    elif isinstance(obj, (list, tuple)):
        for value in obj:
            yield from _tensors(value, seen)
    elif hasattr(obj, "__dict__") and not isinstance(obj, (type, ModuleType, FunctionType,
                                                          torch.nn.Module)):
        for value in vars(obj).values():
            yield from _tensors(value, seen)
