"""Structured attention masks for sequences, as small parameter objects.

A mask says which keys ``j`` a query ``i`` of one document (positions
``0 .. L-1``) attends to. It is never materialised on the GPU: the kernel
computes each row window's key set from these parameters
(csrc/kernels/seq_mask.cuh holds the same definitions). ``allowed(i, j, L)``
is the dense truth (for the reference and the tests, small L only).

    Local(w)                 |j - i| <= w            (Local(w, causal=True): i - w <= j <= i)
    Dilated(w, r)            j = i + k r, |k| <= w   (Longformer's dilated window)
    BlockDilated(s, r, o)    LongNet: i, j in one segment of s tokens, both at
                             offset o mod r inside it
    Global(n or [idx])       global tokens: they attend to every key and every
                             query attends to them (Longformer, BigBird)
    RandomBlocks(b, n, seed) BigBird: each query block of b tokens attends to n
                             key blocks of b tokens, pseudo-random and seeded

Unions: ``Local(256) | Global(3)`` (Longformer), ``Local(3 * 64) | Global(32)
| RandomBlocks(64, 3)`` (BigBird). A key allowed by several parts counts once.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import torch
from torch import Tensor

# Part kinds, in the order the kernel visits them (seq_mask.cuh: SeqPartKind).
_LOCAL, _DILATED, _BLOCK_DILATED, _GLOBAL, _RANDOM = 1, 2, 3, 4, 5
MAX_GLOBAL_TOKENS = 32   # kSeqMaxGlobal in seq_params.h
_M32 = 0xFFFFFFFF


def _int(name: str, x, lo: int) -> int:
    if isinstance(x, bool) or not hasattr(x, "__index__"):
        raise TypeError(f"{name} must be an integer (got {x!r})")
    x = int(x)
    if x < lo:
        raise ValueError(f"{name} must be >= {lo} (got {x})")
    return x


def _window_sides(mask) -> None:
    """Checks a window's ``left`` and sets its ``right``: ``left`` when
    unset (symmetric), 0 when causal."""
    name = type(mask).__name__
    _int(f"{name} window", mask.left, 0)
    if mask.causal and mask.right not in (None, 0):
        raise ValueError(f"{name}(causal=True) looks back only: leave right unset")
    right = 0 if mask.causal else (mask.left if mask.right is None else _int("right", mask.right, 0))
    object.__setattr__(mask, "right", right)


class Mask:
    """Base of the mask parts and their unions."""

    def parts(self) -> tuple["Mask", ...]:
        return (self,)

    def __or__(self, other: "Mask") -> "Union":
        if not isinstance(other, Mask):
            return NotImplemented
        return Union(*self.parts(), *other.parts())

    def allowed(self, i: Tensor, j: Tensor, L: int) -> Tensor:
        """Dense truth: bool tensor of broadcast(i, j) shape, positions of a
        document of length ``L``."""
        raise NotImplementedError

    def global_rows(self, L: int) -> list[int]:
        """Queries that attend to every key (computed apart from the kernel)."""
        return []

    def keys_per_query(self, L: int) -> float:
        """Mean number of keys per query (for FLOP counts), from the dense truth
        on a sample of rows."""
        rows = torch.linspace(0, L - 1, steps=min(L, 257)).round().long()
        j = torch.arange(L)
        return float(self.allowed(rows[:, None], j[None, :], L).sum(1).double().mean())


@dataclass(frozen=True)
class Local(Mask):
    """Sliding window: ``i - left <= j <= i + right``. ``Local(w)`` is
    symmetric (2w + 1 keys), ``Local(w, causal=True)`` looks back only."""
    left: int
    right: int | None = None
    causal: bool = False

    def __post_init__(self):
        _window_sides(self)

    def allowed(self, i, j, L):
        d = j - i
        return (d >= -self.left) & (d <= self.right)

    def _code(self):
        return (_LOCAL, self.left, self.right, 0, 0)


@dataclass(frozen=True)
class Dilated(Mask):
    """Dilated sliding window: ``j = i + k * dilation`` for ``-left <= k <=
    right`` (``Dilated(w, r)``: 2w + 1 keys spread over 2wr + 1 positions)."""
    left: int
    dilation: int
    right: int | None = None
    causal: bool = False

    def __post_init__(self):
        _int("dilation", self.dilation, 1)
        _window_sides(self)

    def allowed(self, i, j, L):
        d = j - i
        r = self.dilation
        return (d % r == 0) & (d >= -self.left * r) & (d <= self.right * r)

    def _code(self):
        return (_DILATED, self.left, self.right, self.dilation, 0)


@dataclass(frozen=True)
class BlockDilated(Mask):
    """LongNet's dilated attention for one (segment, dilation) pair: the
    sequence is cut into segments of ``segment`` tokens; inside each, the
    tokens at ``offset`` mod ``dilation`` attend to each other. Other queries
    get nothing from this part (union several offsets to cover them)."""
    segment: int
    dilation: int
    offset: int = 0

    def __post_init__(self):
        _int("segment", self.segment, 1)
        _int("dilation", self.dilation, 1)
        _int("offset", self.offset, 0)
        if self.segment % self.dilation:
            raise ValueError(f"BlockDilated: segment ({self.segment}) must be a multiple of the "
                             f"dilation ({self.dilation})")
        if self.offset >= self.dilation:
            raise ValueError(f"BlockDilated: offset must be < dilation (got {self.offset}, {self.dilation})")

    def allowed(self, i, j, L):
        s, r, o = self.segment, self.dilation, self.offset
        return (i // s == j // s) & ((i % s) % r == o) & ((j % s) % r == o)

    def _code(self):
        return (_BLOCK_DILATED, self.segment, self.dilation, self.offset, 0)


@dataclass(frozen=True)
class Global(Mask):
    """Global tokens: the first ``tokens`` positions (an int) or the listed
    positions of every document; they attend to all keys and every query
    attends to them. At most 32 (positions past a document's end are ignored)."""
    tokens: int | tuple[int, ...]

    def __post_init__(self):
        t = self.tokens
        if isinstance(t, Sequence) or isinstance(t, Tensor):
            idx = tuple(sorted({_int("global token", x, 0) for x in (t.tolist() if isinstance(t, Tensor) else t)}))
        else:
            idx = tuple(range(_int("Global tokens", t, 0)))
        if len(idx) > MAX_GLOBAL_TOKENS:
            raise ValueError(f"Global: at most {MAX_GLOBAL_TOKENS} global tokens (got {len(idx)})")
        object.__setattr__(self, "tokens", idx)

    def _tensor(self, like: Tensor) -> Tensor:
        return torch.tensor(self.tokens, dtype=torch.long, device=like.device)

    def allowed(self, i, j, L):
        g = self._tensor(i if isinstance(i, Tensor) else j)
        return torch.isin(i, g) | torch.isin(j, g)

    def global_rows(self, L):
        return [x for x in self.tokens if x < L]

    def _code(self):
        return (_GLOBAL, 0, 0, 0, 0)


def _fmix32(x: int) -> int:
    """murmur3's 32-bit finaliser (seq_mask.cuh: seq_mix32)."""
    x &= _M32
    x ^= x >> 16
    x = (x * 0x85EBCA6B) & _M32
    x ^= x >> 13
    x = (x * 0xC2B2AE35) & _M32
    return x ^ (x >> 16)


@dataclass(frozen=True)
class RandomBlocks(Mask):
    """BigBird's random attention: each query block of ``block`` tokens
    attends to ``blocks`` distinct key blocks of the same size. The blocks of
    query block qb of a document with nb blocks are (start + t * step) mod nb,
    t < blocks, with start and step (coprime with nb) hashed from (seed, qb):
    reproducible, nothing stored. ``block`` must be a multiple of 16 (the
    kernel's m-tiles of 16 queries then lie in one query block)."""
    block: int
    blocks: int
    seed: int = 0

    def __post_init__(self):
        _int("block", self.block, 16)
        if self.block % 16:
            raise ValueError(f"RandomBlocks: block must be a multiple of 16 (got {self.block})")
        _int("blocks", self.blocks, 0)
        object.__setattr__(self, "seed", _int("seed", self.seed, 0) & _M32)

    @classmethod
    def from_density(cls, density: float, length: int, block: int = 64, seed: int = 0) -> "RandomBlocks":
        """The number of blocks that gives about ``density * length`` random
        keys per query (at least one block)."""
        return cls(block, max(1, round(density * length / block)), seed)

    def key_blocks(self, qb: int, nb: int) -> list[int]:
        """The key blocks of query block ``qb`` (nb blocks in the document)."""
        n = min(self.blocks, nb)
        start = _fmix32(_fmix32(self.seed ^ 0x2545F491) + qb) % nb
        step = 1
        if nb > 2:
            step = 1 + _fmix32(_fmix32(self.seed ^ 0x9E3779B9) + qb) % (nb - 1)
            while math.gcd(step, nb) != 1:
                step = step % (nb - 1) + 1
        return [(start + t * step) % nb for t in range(n)]

    def allowed(self, i, j, L):
        i, j = torch.broadcast_tensors(torch.as_tensor(i), torch.as_tensor(j))
        nb = -(-L // self.block)
        table = torch.zeros(nb, nb, dtype=torch.bool)
        for qb in range(nb):
            table[qb, self.key_blocks(qb, nb)] = True
        table = table.to(i.device)
        return table[i // self.block, j // self.block]

    def _code(self):
        return (_RANDOM, self.block, self.blocks, self.seed if self.seed < 2**31 else self.seed - 2**32, 0)


class Union(Mask):
    """Keys allowed by any of the parts (each counted once)."""

    def __init__(self, *parts: Mask):
        flat: list[Mask] = []
        for p in parts:
            if not isinstance(p, Mask):
                raise TypeError(f"Union takes masks (got {type(p).__name__})")
            flat.extend(p.parts())
        if not flat:
            raise ValueError("Union of no masks")
        kinds = [p._code()[0] for p in flat]
        for kind, name in ((_GLOBAL, "Global"), (_RANDOM, "RandomBlocks")):
            if kinds.count(kind) > 1:
                raise ValueError(f"a mask holds at most one {name} part (merge them into one)")
        # the kernel's order: local, dilated, block-dilated, global, random
        self._parts = tuple(sorted(flat, key=lambda p: p._code()[0]))
        if len(self._parts) > 5:
            raise ValueError(f"a mask holds at most 5 parts (got {len(self._parts)})")

    def parts(self):
        return self._parts

    def __repr__(self):
        return " | ".join(repr(p) for p in self._parts)

    def __eq__(self, other):
        return isinstance(other, Union) and self._parts == other._parts

    def __hash__(self):
        return hash(self._parts)

    def allowed(self, i, j, L):
        out = None
        for p in self._parts:
            a = p.allowed(i, j, L)
            out = a if out is None else out | a
        return out

    def global_rows(self, L):
        return sorted({x for p in self._parts for x in p.global_rows(L)})


def as_mask(mask: Mask) -> Union:
    if not isinstance(mask, Mask):
        raise TypeError(f"mask must be a gt_fused3s.sequence mask (Local, Dilated, BlockDilated, "
                        f"Global, RandomBlocks or a union of them with |), got {type(mask).__name__}")
    return mask if isinstance(mask, Union) else Union(mask)


def kernel_code(mask: Mask) -> list[int]:
    """The int list the kernel reads (seq_params.h: SeqMask):
    [row_stride, num_parts, (kind, a, b, c, d) per part, num_global, global positions...].

    row_stride s > 1 compacts dilated masks: a row window holds 16 queries of
    one residue mod s, whose keys then fill dense tiles."""
    parts = as_mask(mask).parts()
    dil = {p.dilation for p in parts if isinstance(p, (Dilated, BlockDilated))}
    rest = [p for p in parts if not isinstance(p, (Dilated, BlockDilated, Global))]
    stride = dil.pop() if len(dil) == 1 and not rest else 1
    code = [stride, len(parts)]
    for p in parts:
        code.extend(p._code())
    tokens = next((p.tokens for p in parts if isinstance(p, Global)), ())
    code.append(len(tokens))
    code.extend(tokens)
    return code


def _span(lo: int, hi: int, L: int) -> Tensor:
    return torch.arange(max(0, lo), min(L, hi))


def candidate_keys(mask: Mask, r0: int, r1: int, L: int) -> Tensor:
    """Sorted positions that may be keys of queries r0 .. r1-1 (a superset:
    ``allowed`` decides). What the reference's row chunks score against."""
    parts = as_mask(mask).parts()
    if any(g < r1 and g >= r0 for p in parts for g in p.global_rows(L)):
        return torch.arange(L)
    found = []
    for p in parts:
        if isinstance(p, Local):
            found.append(_span(r0 - p.left, r1 + p.right, L))
        elif isinstance(p, Dilated):
            found.append(_span(r0 - p.left * p.dilation, r1 + p.right * p.dilation, L))
        elif isinstance(p, BlockDilated):
            found.append(_span((r0 // p.segment) * p.segment, ((r1 - 1) // p.segment + 1) * p.segment, L))
        elif isinstance(p, Global):
            found.append(torch.tensor([g for g in p.tokens if g < L], dtype=torch.long))
        elif isinstance(p, RandomBlocks):
            nb = -(-L // p.block)
            blocks = {kb for qb in range(r0 // p.block, (r1 - 1) // p.block + 1) for kb in p.key_blocks(qb, nb)}
            found.extend(_span(kb * p.block, (kb + 1) * p.block, L) for kb in sorted(blocks))
    return torch.unique(torch.cat(found)) if found else torch.zeros(0, dtype=torch.long)
