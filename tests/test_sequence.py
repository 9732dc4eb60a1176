"""Sequence masks and sequence attention on the CPU.

- The kernel's key-set policy (csrc/kernels/seq_mask.cuh, host + device code)
  is compiled with nvcc into a small host program (tests/seq_mask_host.cu)
  and its (query, key) pairs must equal each mask's dense truth, each pair
  once: odd lengths, lengths not a multiple of 16, windows longer than the
  document, global tokens at both ends, overlapping unions, several documents.
  Skipped where nvcc is missing (CI has it).
- The reference path equals masked dense softmax attention in float64,
  outputs and gradients; packed documents equal one call per document.
"""
from __future__ import annotations

import subprocess

import pytest
import torch

from gt_fused3s.sequence import (BlockDilated, Dilated, Global, Local, RandomBlocks, Union, kernel_code,
                                 sequence_attention)
from gt_fused3s.sequence.masks import as_mask, candidate_keys
from gt_fused3s.reference import sequence_reference

MASKS = {
    "local": Local(5),
    "local-wide": Local(100),
    "causal": Local(7, causal=True),
    "asym": Local(3, right=9),
    "dilated": Dilated(4, 2),
    "dilated-causal": Dilated(3, 3, causal=True),
    "block-dilated": BlockDilated(16, 4, offset=1),
    "block-dilated-small": BlockDilated(6, 2),
    "global": Global(3),
    "global-ends": Global([0, 1, 40, 76, 200]),
    "random": RandomBlocks(64, 2, seed=7),
    "longformer": Local(8) | Global(3),
    "dilated+global": Dilated(4, 2) | Global([0, 76]),
    "bigbird": Local(16) | Global(2) | RandomBlocks(64, 2, seed=3),
    "overlap": Local(3) | Dilated(2, 3) | Global([5, 70]) | RandomBlocks(64, 1, seed=1),
    "random-16": RandomBlocks(16, 3, seed=2),
    # half of a document's blocks per query block: the walk's step wraps past
    # nb within a query block many times (SeqTileCursor's incremental walk)
    "random-many": RandomBlocks(16, 9, seed=5),
    "bigbird-32": Local(5) | Global(1) | RandomBlocks(32, 2, seed=9),
    "two-block-dilated": BlockDilated(32, 2, 0) | BlockDilated(32, 2, 1),
    # windows wide enough for whole tiles inside the band for a block of 64
    # and of 128 queries (the kernels' unmasked tiles: seq_tile_full)
    "local-wider": Local(200),
    "dilated-wide": Dilated(100, 2),
    "global-then-wide": Global(3) | Local(200),
}
LENGTHS = {"odd": [277], "docs": [140, 1, 16, 195], "short": [9]}


def dense_truth(mask, lens: list[int]) -> set[tuple[int, int]]:
    pairs, start = set(), 0
    for L in lens:
        i = torch.arange(L)
        ok = mask.allowed(i[:, None], i[None, :], L)
        globals_ = set(mask.global_rows(L))
        for r, c in ok.nonzero().tolist():
            if r not in globals_:   # global rows are computed apart from the kernel
                pairs.add((start + r, start + c))
        start += L
    return pairs


@pytest.fixture(scope="module")
def seq_host(host_program):
    return host_program("seq_mask_host.cu")


WALKS = {"forward": 0, "backward": 1, "keys": 2}   # seq_mask_host.cu's line 4
HOST_WALKS = {**WALKS, "band": 3, "band_bwd": 4}    # and the band kernels' schedules


def kernel_pairs(exe, mask, lens, block_rows=128, walk="forward") -> tuple[list[tuple[int, int]], str]:
    stdin = (" ".join(map(str, kernel_code(mask))) + "\n" + " ".join(map(str, lens)) + f"\n{block_rows}\n"
             f"{HOST_WALKS[walk]}\n")
    run = subprocess.run([str(exe)], input=stdin, capture_output=True, text=True, check=True)
    pairs = [tuple(map(int, ln.split())) for ln in run.stdout.splitlines()]
    return pairs, run.stderr


def walk_counts(stats: str) -> dict[str, int]:
    """The host program's counts (stderr: name value pairs)."""
    words = stats.split()
    return {k: int(v) for k, v in zip(words[::2], words[1::2])}


# backward: keys as rows of the query blocks' walk (seq_bwd_kernel.cuh);
# keys: the key blocks' walk over the transposed mask (seq_bwd_keys_kernel.cuh)
@pytest.mark.parametrize("walk", WALKS.keys())
@pytest.mark.parametrize("block_rows", [64, 128])   # the kernel runs 64; the policy takes any multiple of 16
@pytest.mark.parametrize("lens", LENGTHS.values(), ids=LENGTHS.keys())
@pytest.mark.parametrize("name", MASKS.keys())
def test_kernel_key_sets_equal_dense_truth(seq_host, name, lens, block_rows, walk):
    mask = MASKS[name]
    got, stats = kernel_pairs(seq_host, mask, lens, block_rows, walk)
    if walk == "keys":   # local, dilated and block-dilated parts only: their transposes are such parts
        transposable = not any(isinstance(p, (Global, RandomBlocks)) for p in mask.parts())
        assert walk_counts(stats)["transposable"] == int(transposable)
        if not transposable:
            assert got == []
            return
    truth = dense_truth(mask, lens)
    # the kernel also gives global rows the non-global parts' keys (then overwritten)
    start, grow = 0, set()
    for L in lens:
        grow |= {start + r for r in mask.global_rows(L)}
        start += L
    got_rest = [p for p in got if p[0] not in grow]
    assert len(got_rest) == len(set(got_rest)), "a key given twice to a query"
    assert set(got_rest) == truth


# Documents whose 64-query row blocks fall three to a group of the band
# kernel across one, two and three documents (test_sequence_cuda.py's BAND_DOCS).
BAND_LENGTHS = {"band-docs": [1, 63, 64, 65, 130, 1, 200, 5, 192, 191, 193, 3, 70, 400, 700], "one": [1000],
                "tiny": [2, 1]}   # (fewer tokens than some rates)
BAND_MASKS = {**MASKS, "local-sides": Local(300, right=45), "causal-global": Local(20, causal=True) | Global([0, 5, 64, 199]),
              "global-32": Local(30) | Global(list(range(1, 700, 22))),
              # dilated windows: local ones among a residue's positions (rates 1 to 5)
              "dilated-rate1": Dilated(20, 1), "dilated-sides": Dilated(70, 3, right=9),
              "dilated-rate5-global": Dilated(30, 5) | Global([0, 3, 64, 199, 650]),
              "dilated-causal-global-32": Dilated(40, 2, causal=True) | Global(list(range(1, 700, 22))),
              # random blocks of whole 128-key tiles after a local window
              # (BigBird's): overlapping the band and the global keys, a
              # short last block, lists wrapping past a document's blocks
              "bigbird-128": Local(16) | Global(2) | RandomBlocks(128, 2, seed=3),
              "bigbird-256-globals": Local(30) | Global([0, 5, 130, 399, 650]) | RandomBlocks(256, 1, seed=8),
              "causal-random-128": Local(40, causal=True) | RandomBlocks(128, 3, seed=6),
              "bigbird-many": Local(4) | Global(1) | RandomBlocks(128, 5, seed=2),
              # not the band kernel's: no whole tiles, a part after the random one, no window first
              "bigbird-64": Local(16) | Global(2) | RandomBlocks(64, 2, seed=3),
              "random-then-global": Local(16) | RandomBlocks(128, 2, seed=3) | Global(2),
              "random-none": Local(16) | RandomBlocks(128, 0, seed=3)}


def band_kernel_takes(mask, lens) -> bool:
    """seq_band_takes (and the launch's rule of at least as many tokens as
    the rate): a local or dilated window first, then global keys, then
    (a local window only) random blocks of whole 128-key tiles."""
    parts = mask.parts()
    rest = parts[1:]
    if rest and isinstance(rest[0], Global):
        rest = rest[1:]
    rate = kernel_code(mask)[0]
    if rest and isinstance(rest[-1], RandomBlocks) and rest[-1].block % 128 == 0 and rest[-1].blocks > 0 and rate == 1:
        rest = rest[:-1]
    return isinstance(parts[0], (Local, Dilated)) and not rest and sum(lens) >= rate


@pytest.mark.parametrize("lens", [*LENGTHS.values(), *BAND_LENGTHS.values()], ids=[*LENGTHS, *BAND_LENGTHS])
@pytest.mark.parametrize("name", BAND_MASKS.keys())
def test_band_kernel_schedule_equals_dense_truth(seq_host, name, lens):
    """The band kernel's schedule on the CPU (seq_band_fwd.cuh's SeqBandGroup:
    groups of three row blocks, their passes per document and residue, each
    consumer's 128-key tiles, its mask test and the global keys'): where the
    kernel takes the mask (one local window, or one dilated window, alone or
    with global keys; a local window with random blocks of whole tiles, the
    random tiles as the producer walks them: band_kernel_takes), its pairs
    equal the dense truth, each once; elsewhere it takes none."""
    mask = BAND_MASKS[name]
    got, stats = kernel_pairs(seq_host, mask, lens, 64, "band")
    takes = band_kernel_takes(mask, lens)
    counts = walk_counts(stats)
    assert counts["band"] == int(takes)
    if not takes:
        assert got == []
        return
    assert counts["lost"] == 0
    start, grow = 0, set()   # global rows: computed apart (the kernel's values overwritten)
    for L in lens:
        grow |= {start + r for r in mask.global_rows(L)}
        start += L
    got_rest = [p for p in got if p[0] not in grow]
    assert len(got_rest) == len(set(got_rest)), "a key given twice to a query"
    assert set(got_rest) == dense_truth(mask, lens)


# (Local(126): its first pair's second block starts its tiles at query 0,
# so a full-tile test off by one at the band's start shows.)
BAND_BWD_MASKS = {**BAND_MASKS, "local-126": Local(126), "local-sides-126": Local(126, right=190),
                  "causal-130": Local(130, causal=True)}


@pytest.mark.parametrize("lens", [*LENGTHS.values(), *BAND_LENGTHS.values()], ids=[*LENGTHS, *BAND_LENGTHS])
@pytest.mark.parametrize("name", BAND_BWD_MASKS.keys())
def test_band_backward_schedule_equals_dense_truth(seq_host, name, lens):
    """The band backward's schedule on the CPU (seq_band_bwd.cuh: pairs of
    64-key blocks of the transposed mask, their passes per document, each
    consumer's live 64-query tiles, its full tiles and mask bits as each
    thread computes them): where it takes the mask (one local window), its
    (query, key) pairs equal the dense truth, each once; elsewhere none."""
    mask = BAND_BWD_MASKS[name]
    got, stats = kernel_pairs(seq_host, mask, lens, 64, "band_bwd")
    takes = len(mask.parts()) == 1 and isinstance(mask.parts()[0], Local)
    counts = walk_counts(stats)
    assert counts["bandbwd"] == int(takes)
    if not takes:
        assert got == []
        return
    assert counts["lost"] == 0
    assert len(got) == len(set(got)), "a pair computed twice"
    assert set(got) == dense_truth(mask, lens)
    if max(lens) >= 1000 and mask.parts()[0].left + mask.parts()[0].right >= 200:
        assert counts["full"] > 0, counts   # the full tiles' path is taken


@pytest.mark.parametrize("block_rows", [64, 128])
@pytest.mark.parametrize("lens", LENGTHS.values(), ids=LENGTHS.keys())
@pytest.mark.parametrize("name", MASKS.keys())
def test_walk_full_tiles_by_segment_equal_tile_test(seq_host, name, lens, block_rows):
    """The walk decides which tiles need no mask bits from one interval per
    segment (seq_full_tile_range) where it can: the same tiles as the test
    of each tile (seq_tile_full), which the key-set test above covers."""
    _, stats = kernel_pairs(seq_host, MASKS[name], lens, block_rows)
    counts = walk_counts(stats)
    assert counts["block_full_mismatches"] == 0, counts
    assert counts["nonuniform_pairs"] == 0, counts   # a warp's pairs to compute: the same in every lane


@pytest.mark.parametrize("mask", [Local(300), Local(40), Local(200, right=20), Local(300, causal=True),
                                  Dilated(150, 3), Dilated(40, 2, causal=True), Local(300) | Global(2),
                                  Local(100) | Global([0, 700]) | RandomBlocks(64, 2, seed=4),
                                  Dilated(60, 2) | Global(3)], ids=str)
@pytest.mark.parametrize("block_rows", [64, 128])
def test_band_tile_bits_equal_pair_tests(seq_host, mask, block_rows):
    """The edges of a band (the first part's whole tiles over 16 valid rows)
    take their mask bits from one closed form (seq_band_tile_bits): equal,
    bit for bit, to the per-pair tests on every such tile of the walk, and
    used (not vacuous); the key-set tests above cover the rest."""
    _, stats = kernel_pairs(seq_host, mask, [3000, 1, 777, 64, 130], block_rows)
    counts = walk_counts(stats)
    assert counts["band_tiles"] > 0, counts
    assert counts["band_mismatches"] == 0, counts
    assert counts["nonuniform_pairs"] == 0, counts
    if any(isinstance(p, Global) for p in mask.parts()):   # the global keys' tiles far from the band
        assert counts["global_tiles"] > 0, counts


def test_walk_full_tiles_by_segment_on_long_bands(seq_host):
    """Long bands and compacted dilated windows, with and without global
    tokens before them, have full tiles: the interval is not vacuous."""
    for mask in (Local(300), Dilated(150, 3), Global(2) | Local(300), Local(300) | Global(2),
                 Local(300, causal=True), Local(200, right=20)):
        _, stats = kernel_pairs(seq_host, mask, [3000, 777], 64)
        counts = walk_counts(stats)
        assert counts["block_full_mismatches"] == 0, (mask, counts)
        assert counts["block_full"] > 0, (mask, counts)


def test_dense_tiles_for_bands_and_compacted_dilation(seq_host):
    """Inside a band every tile is full (no per-entry tests), and a dilated
    window compacts its keys (its queries share a residue, its keys are
    every r-th position): per row window, only the two tiles at the band's
    edges are partly masked."""
    L = 4096
    for mask in (Local(64), Dilated(64, 4)):
        _, stats = kernel_pairs(seq_host, mask, [L])
        tiles, full = (walk_counts(stats)[k] for k in ("tiles", "full"))
        windows = L // 16   # warp sub-windows; stats count pairs per warp
        assert tiles <= windows * (2 * 64 // 16 + 2), (mask, stats)   # no key outside the band
        assert tiles - full <= 2 * windows, (mask, stats)


@pytest.mark.parametrize("name", MASKS.keys())
def test_candidates_cover_allowed(name):
    mask, L = MASKS[name], 77
    i = torch.arange(L)
    ok = mask.allowed(i[:, None], i[None, :], L)
    for r0 in range(0, L, 13):
        cand = set(candidate_keys(mask, r0, min(L, r0 + 13), L).tolist())
        need = set(ok[r0:r0 + 13].nonzero()[:, 1].tolist())
        assert need <= cand


def dense_attention(q, k, v, mask, scale=None):
    B, L, H, D = q.shape
    i = torch.arange(L)
    ok = mask.allowed(i[:, None], i[None, :], L)
    s = torch.einsum("blhd,bmhd->bhlm", q, k) * (D ** -0.5 if scale is None else scale)
    p = torch.softmax(s.masked_fill(~ok, float("-inf")), -1).nan_to_num(0.0)
    return torch.einsum("bhlm,bmhd->blhd", p, v)


@pytest.mark.parametrize("name", MASKS.keys())
def test_reference_equals_masked_dense_float64(name):
    torch.manual_seed(0)
    mask = MASKS[name]
    B, L, H, D = 2, 77, 3, 8
    q, k, v = (torch.randn(B, L, H, D, dtype=torch.float64, requires_grad=True) for _ in range(3))
    out = sequence_attention(q, k, v, mask)
    ref = dense_attention(q, k, v, mask)
    assert out.dtype == torch.float64
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)
    g = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v), g)
    want = torch.autograd.grad(ref, (q, k, v), g)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)


def test_packed_documents_equal_one_call_each():
    torch.manual_seed(1)
    mask = Local(4) | Global(2) | RandomBlocks(64, 1, seed=5)
    lens = [140, 1, 133, 17]
    H, D = 2, 8
    q, k, v = (torch.randn(sum(lens), H, D, dtype=torch.float64) for _ in range(3))
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32)
    out = sequence_attention(q, k, v, mask, cu_seqlens=cu)
    start = 0
    for L in lens:
        one = sequence_attention(*(t[None, start:start + L] for t in (q, k, v)), mask)[0]
        torch.testing.assert_close(out[start:start + L], one, rtol=0, atol=1e-12)
        start += L


def test_kernel_code_layout():
    code = kernel_code(Global([3, 1]) | Local(2, right=5))
    assert code == [1, 2, 1, 2, 5, 0, 0, 4, 0, 0, 0, 0, 2, 1, 3]
    # a dilated mask alone (with global tokens) compacts rows by its rate
    assert kernel_code(Dilated(8, 4) | Global(1))[0] == 4
    assert kernel_code(Dilated(8, 4) | Local(3))[0] == 1
    assert isinstance(Local(1) | Local(2), Union)


@pytest.mark.parametrize("make, err", [
    (lambda: Local(-1), ValueError),
    (lambda: Local(2.5), TypeError),
    (lambda: Local(3, right=2, causal=True), ValueError),
    (lambda: Dilated(3, 0), ValueError),
    (lambda: BlockDilated(10, 4), ValueError),
    (lambda: BlockDilated(8, 4, offset=4), ValueError),
    (lambda: Global(33), ValueError),
    (lambda: RandomBlocks(24, 1), ValueError),
    (lambda: Global(1) | Global(2), ValueError),
    (lambda: Local(1) | 3, TypeError),
])
def test_bad_masks_raise(make, err):
    with pytest.raises(err):
        make()


def test_bad_inputs_raise():
    q = torch.randn(1, 8, 1, 4)
    with pytest.raises(TypeError, match="mask"):
        sequence_attention(q, q, q, "local")
    with pytest.raises(ValueError, match=r"\[B, L, H, D\]"):
        sequence_attention(q[0], q[0], q[0], Local(1))
    with pytest.raises(ValueError, match="cu_seqlens"):
        sequence_attention(q[0], q[0], q[0], Local(1), cu_seqlens=torch.tensor([0, 5]))
    with pytest.raises(ValueError, match="share"):
        sequence_attention(q, q[:, :4], q, Local(1))


def test_queries_without_keys_give_zero_and_nan_propagates():
    q = torch.randn(1, 32, 1, 8, dtype=torch.float64)
    out = sequence_attention(q, q, q, BlockDilated(16, 4, offset=0))
    assert torch.all(out[0, 1] == 0) and torch.any(out[0, 0] != 0)
    k = q.clone()
    k[0, 3] = float("nan")
    out = sequence_attention(q, k, q, Local(1))
    assert torch.isnan(out[0, 2:5]).all() and not torch.isnan(out[0, 6:]).any()


@pytest.mark.parametrize("kind", ["local", "dilated", "longformer", "dilated_global", "bigbird"])
def test_flex_baseline_block_lists(kind):
    """The benchmark's FlexAttention BlockMask (kv block lists built without
    an [nb, nb] matrix): every allowed (query, key) lies in a listed block,
    full blocks are wholly allowed, partial and full lists are disjoint."""
    from gt_fused3s.bench import sequence as bench
    L, nb, bs = 4096, 32, bench.FLEX_BLOCK
    mask = bench.make_mask(kind, L, 513 if kind in ("local", "dilated") else 101, density=0.05)
    _, (kn, ki), (fn, fi) = bench._flex_pieces(mask, L, torch.device("cpu"))
    i = torch.arange(L)
    ok = mask.allowed(i[:, None], i[None, :], L)
    rows = mask.global_rows(L)   # computed apart: anything goes in their rows
    need, may = ok.clone(), ok.clone()
    need[rows], may[rows] = False, True
    part, full = torch.zeros(nb, nb, dtype=torch.bool), torch.zeros(nb, nb, dtype=torch.bool)
    for q in range(nb):
        part[q, ki[0, 0, q, :kn[0, 0, q]].long()] = True
        full[q, fi[0, 0, q, :fn[0, 0, q]].long()] = True
    assert ki.shape[-1] == fi.shape[-1]
    assert bool((need.reshape(nb, bs, nb, bs).any(3).any(1) <= (part | full)).all())
    assert bool((full <= may.reshape(nb, bs, nb, bs).all(3).all(1)).all())
    assert not bool((part & full).any())


@pytest.mark.parametrize("kind", ["local", "longformer", "bigbird"])
def test_flex_baseline_block_lists_for_the_backward(kind):
    """For the backward timing (bench_sequence --backward) the lists are as
    wide as the number of key blocks, which Flex's q-block transposition
    assumes (narrower ones indexed out of bounds there with torch 2.11 / 2.13:
    a device-side assert on the GPU, an IndexError on the CPU), with the
    same blocks as the narrow lists."""
    from torch.nn.attention.flex_attention import BlockMask
    from gt_fused3s.bench import sequence as bench
    L, nb = 4096, 32
    mask = bench.make_mask(kind, L, 513 if kind == "local" else 101, density=0.05)
    _, narrow_p, narrow_f = bench._flex_pieces(mask, L, torch.device("cpu"))
    _, (kn, ki), (fn, fi) = bench._flex_pieces(mask, L, torch.device("cpu"), square=True)
    assert ki.shape[-1] == fi.shape[-1] == nb
    for (n0, i0), (n1, i1) in ((narrow_p, (kn, ki)), (narrow_f, (fn, fi))):
        assert torch.equal(n0, n1) and torch.equal(i1[..., :i0.shape[-1]], i0)
    bm = BlockMask.from_kv_blocks(kn, ki, fn, fi, BLOCK_SIZE=bench.FLEX_BLOCK, seq_lengths=(L, L),
                                  compute_q_blocks=True)
    assert bm.q_indices.shape[-1] == nb


@pytest.mark.parametrize("mask", [Local(300), Local(200, right=40), Local(150, causal=True),
                                  Dilated(100, 2), Dilated(64, 3, right=10) | Local(20)],
                         ids=["local", "asym", "causal", "dilated", "dilated+local"])
def test_flex_baseline_query_lists_from_the_transposed_mask(mask):
    """Past 4M tokens Flex's own transposition of the block lists
    (compute_q_blocks, through [nb, nb] lists) does not fit, so for local and
    dilated masks the bench makes the backward's query block lists from the
    transposed mask (bench.transposed): its pattern is the mask's
    transposed, and its lists hold the blocks of Flex's transposition of
    the key lists."""
    from torch.nn.attention.flex_attention import BlockMask
    from gt_fused3s.bench import sequence as bench
    L, nb = 4000, 32
    t = bench.transposed(mask)
    i = torch.arange(L)
    assert torch.equal(as_mask(t).allowed(i[:, None], i[None, :], L), as_mask(mask).allowed(i[None, :], i[:, None], L))
    _, (kn, ki), (fn, fi) = bench._flex_pieces(mask, L, torch.device("cpu"), square=True)
    bm = BlockMask.from_kv_blocks(kn, ki, fn, fi, BLOCK_SIZE=bench.FLEX_BLOCK, seq_lengths=(L, L),
                                  compute_q_blocks=True)
    _, (qn, qi), (fqn, fqi) = bench._flex_pieces(t, L, torch.device("cpu"), rows_are_keys=True)

    def dense(num, idx):
        out = torch.zeros(nb, nb, dtype=torch.bool)
        for r in range(nb):
            out[r, idx[0, 0, r, :num[0, 0, r]].long()] = True
        return out
    ours_p, ours_f = dense(qn, qi), dense(fqn, fqi)
    flex_p, flex_f = dense(bm.q_num_blocks, bm.q_indices), dense(bm.full_q_num_blocks, bm.full_q_indices)
    assert torch.equal(ours_p, flex_p) and torch.equal(ours_f, flex_f)
    assert bench.transposed(mask | Global(2)) is None


def test_plot_sequence_times(tmp_path):
    """Fig. 6-style panels from bench_sequence rows: a PNG for masks with two
    lengths or more; none to draw is an error, not an empty figure."""
    pytest.importorskip("matplotlib")
    from gt_fused3s.bench.plot import plot_sequence_times
    rows = [{"mask": "longformer", "L": 65536, "ours_ms": 0.6, "flex_ms": 0.63},
            {"mask": "longformer", "L": 1048576, "ours_ms": 2.95, "flex_ms": 1.63, "dense_sdpa_ms": ""},
            {"mask": "local", "L": 65536, "ours_ms": 0.2}]
    path = plot_sequence_times(rows, tmp_path / "fig6.png")
    assert path.stat().st_size > 1000
    with pytest.raises(ValueError, match="two lengths"):
        plot_sequence_times(rows[2:], tmp_path / "none.png")


# The path around the sequence kernels on the CPU, through stand-ins of
# seq_fwd / seq_bwd (tests/stand_in_kernels.py: dense per document, with the
# row-block contract checked): casts, padding of the head dim, the negative
# scale's sign flip, global rows written over, autograd (eager and traced).
def _kernel_path_case(name, seed=0, D=48):
    torch.manual_seed(seed)
    q, k, v = (torch.randn(2, 150, 2, D, dtype=torch.float16, requires_grad=True) for _ in range(3))
    return MASKS[name], q, k, v, torch.randn(2, 150, 2, D, dtype=torch.float16)


def _reference_grads(mask, q, k, v, g, scale=None):
    leaves = [t.detach().float().reshape(300, 2, -1).requires_grad_() for t in (q, k, v)]
    ref = sequence_reference(*leaves, mask, [0, 150, 300], scale)
    return ref.reshape(g.shape), torch.autograd.grad(ref, leaves, g.float().reshape(300, 2, -1))


def _assert_near(got, want, rel):
    err, top = (got.float() - want).abs().max().item(), want.abs().max().item()
    assert err <= rel * top, f"{err:.3e} > {rel:.0e} x {top:.3e}"


def test_offsets_made_under_inference_mode_serve_a_training_call(stand_in_kernels):
    """The per-shape offsets and global-row indices a first call makes under
    torch.inference_mode are cached as normal tensors: a later training call
    saves them for its backward (an inference tensor there raised)."""
    from gt_fused3s.sequence import attention as attention_mod
    attention_mod._OFFSETS.clear()
    attention_mod._ROW_INDEX.clear()
    mask, q, k, v, g = _kernel_path_case("bigbird", seed=6)
    with torch.inference_mode():
        first = sequence_attention(q, k, v, mask)
    out = sequence_attention(q, k, v, mask)
    got = torch.autograd.grad(out, (q, k, v), g)
    assert torch.equal(first, out.detach())
    ref, want = _reference_grads(mask, q, k, v, g)
    for a, b in zip(got, want):
        _assert_near(a.reshape(b.shape), b, 2e-2)


@pytest.mark.parametrize("scale", [None, -0.3])
@pytest.mark.parametrize("name", ["local-wider", "bigbird", "dilated", "global-then-wide"])
def test_kernel_path_equals_reference(stand_in_kernels, name, scale):
    mask, q, k, v, g = _kernel_path_case(name)
    out = sequence_attention(q, k, v, mask, scale)
    got = torch.autograd.grad(out, (q, k, v), g)
    assert {"seq_fwd", "seq_bwd"} <= set(stand_in_kernels.calls)
    ref, want = _reference_grads(mask, q, k, v, g, scale)
    _assert_near(out, ref, 1e-2)
    with torch.no_grad():   # (global rows written in place)
        torch.testing.assert_close(sequence_attention(q, k, v, mask, scale), out.detach())
    for a, b in zip(got, want):
        _assert_near(a.reshape(b.shape), b, 2e-2)


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("name", ["longformer", "bigbird", "global-then-wide"])
def test_global_rows_by_dense_rows_kernels(stand_in_kernels, name, compiled):
    """At D = 64 (fp16) the global rows take the dense-rows kernels
    (gt_fused3s::dense_rows_fwd / _bwd: the keys split over thread blocks),
    eagerly and under torch.compile(fullgraph=True): the reference's output
    and gradients."""
    torch._dynamo.reset()
    mask, q, k, v, g = _kernel_path_case(name, seed=4, D=64)
    fn = torch.compile(sequence_attention, fullgraph=True, backend="aot_eager") if compiled else sequence_attention
    out = fn(q, k, v, mask)
    got = torch.autograd.grad(out, (q, k, v), g)
    assert {"dense_rows_fwd", "dense_rows_bwd"} <= set(stand_in_kernels.calls)
    ref, want = _reference_grads(mask, q, k, v, g)
    _assert_near(out, ref, 1e-2)
    for a, b in zip(got, want):
        _assert_near(a.reshape(b.shape), b, 2e-2)


@pytest.mark.parametrize("name", ["bigbird", "dilated"])
def test_compiled_kernel_path_fullgraph_equals_eager(stand_in_kernels, name):
    """torch.compile(fullgraph=True) traces the kernels' call as one custom op
    with its own autograd (gt_fused3s::seq_attention): eager's output and
    gradients."""
    torch._dynamo.reset()
    mask, q, k, v, g = _kernel_path_case(name, seed=1)
    results = []
    for fn in (sequence_attention, torch.compile(sequence_attention, fullgraph=True, backend="aot_eager")):
        out = fn(q, k, v, mask)
        results.append((out, *torch.autograd.grad(out, (q, k, v), g)))
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, atol=2e-3, rtol=2e-3)
    assert stand_in_kernels.calls.count("seq_bwd") == 2


def test_traced_calls_keep_no_tensors(stand_in_kernels, monkeypatch):
    """The per-shape offsets and the global rows' index are made for the call
    while torch.compile traces, never kept in the module's caches (a kept
    graph output is overwritten by the next CUDA-graph replay under
    mode="reduce-overhead"); an eager call keeps them, and a traced call
    then reads them."""
    import gt_fused3s.sequence.attention as att
    monkeypatch.setattr(att, "_OFFSETS", {})
    monkeypatch.setattr(att, "_ROW_INDEX", {})
    torch._dynamo.reset()
    mask, q, k, v, g = _kernel_path_case("longformer", seed=3)     # global rows: the index
    compiled = torch.compile(sequence_attention, fullgraph=True, backend="aot_eager")
    out_c = compiled(q, k, v, mask)
    assert att._OFFSETS == {} and att._ROW_INDEX == {}
    out_e = sequence_attention(q, k, v, mask)
    assert len(att._OFFSETS) == 1 and len(att._ROW_INDEX) == 1
    torch.testing.assert_close(out_c, out_e, atol=2e-3, rtol=2e-3)
    torch.testing.assert_close(compiled(q, k, v, mask), out_e, atol=2e-3, rtol=2e-3)


def test_opcheck_seq_ops(stand_in_kernels):
    from gt_fused3s import ops
    from gt_fused3s.sequence.masks import kernel_code
    torch.manual_seed(2)
    mask = MASKS["bigbird"]
    code = kernel_code(mask)
    q, k, v, do = (torch.randn(200, 2, 64, dtype=torch.float16) for _ in range(4))
    cu = torch.tensor([0, 120, 200], dtype=torch.int32)
    fw, bw = (ops.seq_windows(cu, code[0], ops.seq_block_rows(64, b)) for b in (False, True))
    out, lse = torch.ops.gt_fused3s.seq_fwd(q, k, v, cu, fw, code, 0.125, 10, ops.seq_block_rows(64))
    cases = [
        (torch.ops.gt_fused3s.seq_fwd.default, (q, k, v, cu, fw, code, 0.125, 10, ops.seq_block_rows(64))),
        (torch.ops.gt_fused3s.seq_bwd.default, (do, q, k, v, out, lse, cu, fw, bw, code, 0.125, 10)),
        (torch.ops.gt_fused3s.seq_bwd.default, (do, q, k, v, out, lse, cu, fw, None, code, 0.125, 10)),
        (torch.ops.gt_fused3s.seq_attention.default,
         (q.clone().requires_grad_(), k.clone().requires_grad_(), v, cu, fw, code, 0.125, 10, None)),
        (torch.ops.gt_fused3s.seq_attention.default,
         (q.clone().requires_grad_(), k, v.clone().requires_grad_(), cu, fw, code, 0.125, 10, bw)),
    ]
    qg, dog = q[:3].reshape(1, 3, 2, 64), do[:3].reshape(1, 3, 2, 64)
    kb, vb = k[None], v[None]
    og, lse_g = torch.ops.gt_fused3s.dense_rows_fwd(qg, kb, vb, 0.125)
    cases += [
        (torch.ops.gt_fused3s.dense_rows_fwd.default, (qg, kb, vb, 0.125)),
        (torch.ops.gt_fused3s.dense_rows_bwd.default, (dog, qg, kb, vb, og, lse_g, 0.125)),
        (torch.ops.gt_fused3s.dense_rows.default, (qg.clone().requires_grad_(), kb.clone().requires_grad_(), vb, 0.125)),
    ]
    for op, args in cases:
        torch.library.opcheck(op, args, test_utils=("test_schema", "test_faketensor",
                                                    "test_autograd_registration"))


def test_batched_call_makes_no_row_windows(stand_in_kernels):
    """[B, L, H, D] inputs: the forward's and the backward's row-block offsets
    are made once per shape (15 small ops of every backward before), so a
    second call runs no cumsum."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.names = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.names.append(func.__name__)
            return func(*args, **(kwargs or {}))

    mask, q, k, v, g = _kernel_path_case("local-wider", seed=3)
    torch.autograd.grad(sequence_attention(q, k, v, mask), (q, k, v), g)
    with Ops() as seen:
        torch.autograd.grad(sequence_attention(q, k, v, mask), (q, k, v), g)
    assert "seq_fwd.default" in seen.names and "seq_bwd.default" in seen.names
    assert not any(n.startswith("cumsum") for n in seen.names), seen.names


def test_repeated_eager_calls_take_the_remembered_op(monkeypatch):
    """A call that took the eager C++ op remembers the op's arguments: the
    next call with the same mask object and q's shape, dtype, device and
    scale takes the op with them at once (no checks, caches or lookups);
    another mask object, shape or scale, k or v unlike q, packed documents,
    or the kernel switched off take the whole path. (CPU: the op and the
    conditions for it stood in.)"""
    from gt_fused3s import ops
    import gt_fused3s.sequence.attention as att
    calls, whole = [], []

    def eager(q, k, v, *args):
        calls.append((q, args))
        return q * 2

    check = att._check
    monkeypatch.setattr(att, "_REPEAT", {})
    monkeypatch.setattr(ops, "kernel_available", lambda device: True)
    monkeypatch.setattr(ops, "seq_eager_fits", lambda q, k, v: True)
    monkeypatch.setattr(ops, "_op", lambda name: eager)
    monkeypatch.setattr(att, "_check", lambda *a: (whole.append(1), check(*a))[1])
    monkeypatch.delenv("GT_FUSED3S_DISABLE_KERNEL", raising=False)
    longformer = Local(3) | Global(2)
    q, k, v = (torch.randn(2, 50, 1, 64, dtype=torch.float16) for _ in range(3))

    def run(*args, **kwargs):
        n = len(whole)
        out = sequence_attention(*args, **kwargs)
        return out, len(whole) > n

    for mask, scale in ((longformer, None), (Local(4), -0.3)):
        out, full = run(q, k, v, mask, scale)
        assert full and torch.equal(out, (-q if scale else q) * 2)
        out, full = run(q, k, v, mask, scale)
        assert not full and torch.equal(out, (-q if scale else q) * 2)
        assert calls[-1][1] == calls[-2][1] and calls[-1][0].shape == q.shape
    assert len(calls[-4][1]) == 7 and len(calls[-1][1]) == 6   # (the global rows' index last)
    assert calls[-1][1][4] == pytest.approx(0.3)   # -q and -scale
    n = len(calls)
    for args, kwargs in [((q, k, v, Local(3) | Global(2)), {}),          # an equal mask, another object
                         ((q, k, v, longformer, 0.5), {}),                 # another scale
                         ((q[:1], k[:1], v[:1], longformer), {}),          # another shape
                         ((q, k.float(), v, longformer), {})]:             # k unlike q
        fails = args[1].dtype != q.dtype
        if fails:
            with pytest.raises(ValueError):
                run(*args, **kwargs)
            continue
        assert run(*args, **kwargs)[1]
    assert len(calls) == n + 3
    q3 = q.reshape(100, 1, 64)
    cu = torch.tensor([0, 40, 100], dtype=torch.int32)
    monkeypatch.setattr(ops, "seq_windows", lambda cu, stride, rows: cu)
    local = Local(4)
    assert run(q3, q3, q3, local, cu_seqlens=cu)[1] and run(q3, q3, q3, local, cu_seqlens=cu)[1]
    monkeypatch.setenv("GT_FUSED3S_DISABLE_KERNEL", "1")   # the op no longer: the whole path (here stood in too)
    assert run(q, k, v, longformer)[1]


@pytest.mark.parametrize("probe", ["probe_band_fwd_bound.cu", "probe_bwd_keys_bound.cu"])
def test_bound_probes_build(tmp_path, probe):
    """scripts/probe_*_bound.cu (README: what the band forward's and the
    backward by key blocks' tile steps reach without loads, masks or
    barriers, with the kernels' own pieces) build for sm_80 and sm_90a over
    the kernels' headers; they run on the GPU machine only."""
    import shutil
    from pathlib import Path
    nvcc = shutil.which("nvcc") or shutil.which("/usr/local/cuda/bin/nvcc")
    if nvcc is None:
        pytest.skip("nvcc not found: the probes are built where it is installed")
    root = Path(__file__).resolve().parents[1]
    exe = tmp_path / Path(probe).stem
    subprocess.run([nvcc, "-std=c++17", "-O1", "-I", str(root / "csrc" / "kernels"),
                    "-gencode=arch=compute_80,code=sm_80", "-gencode=arch=compute_90a,code=sm_90a",
                    str(root / "scripts" / probe), "-o", str(exe)], check=True)
    assert exe.stat().st_size > 0
