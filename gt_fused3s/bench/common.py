"""Helpers shared by the benchmark harnesses (kernel and end-to-end)."""
from __future__ import annotations

import math
import os
import subprocess
from pathlib import Path

import torch

REPO_ROOT = Path(__file__).resolve().parents[2]


def git_sha() -> str:
    """Short sha of the checkout (``-dirty`` if modified); ``$GT_FUSED3S_GIT_SHA``
    wins (a copy of the tree without ``.git``, as on the GPU machine)."""
    if os.environ.get("GT_FUSED3S_GIT_SHA"):
        return os.environ["GT_FUSED3S_GIT_SHA"]
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO_ROOT,
                             capture_output=True, text=True, timeout=10)
        sha = out.stdout.strip()
        if sha:
            dirty = subprocess.run(["git", "status", "--porcelain"], cwd=REPO_ROOT,
                                   capture_output=True, text=True, timeout=10).stdout.strip()
            return sha + ("-dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        pass
    return "unknown"


def short_error(err: BaseException, limit: int = 160) -> str:
    """One line naming the error, for a table cell or a note."""
    msg = str(err).strip().splitlines()[0] if str(err).strip() else ""
    msg = f"{type(err).__name__}: {msg}" if msg else type(err).__name__
    return msg if len(msg) <= limit else msg[:limit - 3] + "..."


def free_cuda_memory(device: torch.device | str = "cuda") -> None:
    """Return cached blocks after a backend ran out of memory or finished."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()


def geomean(values) -> float:
    """Geometric mean of positive numbers."""
    values = list(values)
    return math.exp(sum(map(math.log, values)) / len(values))
