"""Data-parallel training of batched datasets with ``torch.distributed``:
``gt-fused3s train`` under ``torchrun --nproc_per_node=P`` (the process group
from torchrun's environment: NCCL on GPUs, Gloo on CPUs). Each rank takes
every P-th batch of the global step order, the model is wrapped in
``DistributedDataParallel`` (gradients averaged over the ranks) when it runs
eagerly; a compiled or captured step runs the bare model and averages the
gradients itself after the backward (:func:`sum_gradients`, after
:func:`broadcast_parameters`). Losses are reported as the mean over the
ranks, and only rank 0 logs and writes files.
"""
from __future__ import annotations

import os
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn


def world_from_env() -> tuple[int, int]:
    """(world size, rank) from torchrun's environment; (1, 0) outside it."""
    return int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("RANK", "0"))


def init(device: torch.device) -> tuple[int, int, torch.device]:
    """Join the process group torchrun describes (once per process) and pick
    this rank's device (``cuda:LOCAL_RANK`` on GPUs). Returns (world size,
    rank, device); (1, 0, device) when not launched distributed."""
    world, rank = world_from_env()
    if world == 1:
        return 1, 0, device
    if device.type == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    return dist.get_world_size(), dist.get_rank(), device


def leave() -> None:
    """Leave the process group, where one was joined: a barrier (no rank
    tears its connections down while another still uses them), then the
    group destroyed. Every rank calls it, after its last collective."""
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def shard(order: list[int], rank: int, world: int) -> list[int]:
    """This rank's batches of a global step order: step s of rank r trains on
    ``order[s * world + r]`` (a global step is ``world`` batches)."""
    return order[rank::world]


def wrap(model: nn.Module, device: torch.device) -> nn.Module:
    """``model`` in ``DistributedDataParallel`` (every parameter is used in a
    forward, so no unused-parameter search)."""
    from torch.nn.parallel import DistributedDataParallel
    return DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)


def mean_over_ranks(value: float, device: torch.device) -> float:
    """The mean of a per-rank number over the ranks (a collective)."""
    t = torch.tensor([float(value)], dtype=torch.float64, device=device)
    dist.all_reduce(t)
    return float(t) / dist.get_world_size()


def max_over_ranks(value: float, device: torch.device) -> float:
    """The largest of a per-rank number over the ranks (a collective)."""
    t = torch.tensor([float(value)], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def sum_gradients(model: nn.Module, *, average: bool = False) -> None:
    """Sum (``average``: average) every parameter's gradient over the ranks
    (in place, one all-reduce of the flattened gradients). No host
    synchronisation: a captured training step may contain it (NCCL
    collectives are recorded into a CUDA graph like kernels), which is how
    a data-parallel step runs as one replay, without DDP's hooks."""
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    if not grads:
        return
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat)
    if average:
        flat /= dist.get_world_size()
    offset = 0
    for g in grads:
        g.copy_(flat[offset:offset + g.numel()].view_as(g))
        offset += g.numel()


def broadcast_parameters(model: nn.Module, src: int = 0) -> None:
    """Every rank's parameters and buffers set to rank ``src``'s, in place
    (what DDP does at construction), for the steps that average gradients
    without DDP (:func:`sum_gradients`): equal replicas need equal
    starting weights. Call it before a step is captured."""
    with torch.no_grad():
        for t in [*model.parameters(), *model.buffers()]:
            dist.broadcast(t, src)


def save_checkpoint(path: str | Path, model: nn.Module, optimizer=None, **extra) -> None:
    """The model's weights (unwrapped from DDP), the optimizer's state and
    ``extra`` to ``path`` (call it on rank 0 only)."""
    model = getattr(model, "module", model)
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    torch.save({"model": model.state_dict(),
                "optimizer": optimizer.state_dict() if optimizer is not None else None, **extra}, path)


def load_checkpoint(path: str | Path, model: nn.Module, optimizer=None,
                    map_location: str | torch.device = "cpu") -> dict:
    """Load a :func:`save_checkpoint` file into ``model`` (and ``optimizer``);
    returns the whole checkpoint (its extra keys too)."""
    ck = torch.load(path, map_location=map_location, weights_only=False)
    getattr(model, "module", model).load_state_dict(ck["model"])
    if optimizer is not None and ck.get("optimizer") is not None:
        optimizer.load_state_dict(ck["optimizer"])
    return ck
