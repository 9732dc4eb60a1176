"""The sequence kernel against the fp32 reference (run on the GPU machine):
every mask of test_sequence.py, fp16 and bf16, D in {32, 64, 128}, H in {1, 8},
B in {1, 3}, forward and backward (the fused backward's gradients against
the fp32 reference's: on Hopper, D = 64, masks without global or random
parts take the backward by key blocks, the others by query blocks; with
GT_FUSED3S_JIT_ARCH=8.0+PTX every case runs by query blocks); packed
documents with gradients; a q of more than 2^31 elements, forward and
backward.

Tolerance: the max abs error against the fp32 reference is at most twice
the error of the reference computed in the same low precision, plus 1e-3
times the largest magnitude of the output.
"""
from __future__ import annotations

import pytest
import torch

from gt_fused3s import ops
from gt_fused3s.reference import sequence_reference
from gt_fused3s.sequence import BlockDilated, Dilated, Global, Local, RandomBlocks, sequence_attention

from test_sequence import MASKS

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def check(out, q, k, v, mask, cu, dtype):
    ref = sequence_reference(q.float(), k.float(), v.float(), mask, cu)
    low = sequence_reference(q, k, v, mask, cu, compute_dtype=dtype, out_dtype=torch.float32)
    err = (out.float() - ref).abs().max().item()
    tol = 2 * (low - ref).abs().max().item() + 1e-3 * ref.abs().max().item()
    assert err <= tol, f"max |kernel - ref| = {err:.3e} > {tol:.3e}"


def every_case(test):
    """Every mask, fp16 and bf16, D 32, 64 and 128, B1H8 and B3H1."""
    for mark in (pytest.mark.parametrize("shape", [(1, 8), (3, 1)], ids=["B1H8", "B3H1"]),
                 pytest.mark.parametrize("D", [32, 64, 128]),
                 pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"]),
                 pytest.mark.parametrize("name", MASKS.keys())):
        test = mark(test)
    return test


@every_case
def test_forward_matches_reference(name, dtype, D, shape):
    torch.manual_seed(0)
    B, H = shape
    L = 333
    mask = MASKS[name]
    q, k, v = (torch.randn(B, L, H, D, device="cuda", dtype=dtype) for _ in range(3))
    out = sequence_attention(q, k, v, mask)
    assert out.shape == q.shape and out.dtype == dtype
    flat = [t.reshape(B * L, H, D) for t in (q, k, v)]
    check(out.reshape(B * L, H, D), *flat, mask, list(range(0, B * L + 1, L)), dtype)


# Gradients against the fp32 reference's, relative to their largest entry:
# the kernel rounds P and dS to the operands' dtype for its mmas (a pair of
# (query, key) missed or counted twice moves a key's gradient by about 1 /
# its number of queries: 1e-2 and more on these masks).
GRAD_TOL = {torch.float16: 5e-3, torch.bfloat16: 3e-2}


def check_grads(got, q, k, v, g, mask, cu, dtype):
    leaves = [t.detach().float().requires_grad_() for t in (q, k, v)]
    want = torch.autograd.grad(sequence_reference(*leaves, mask, cu), leaves, g.float())
    for name, a, b in zip(("dq", "dk", "dv"), got, want):
        err, top = (a.float() - b).abs().max().item(), b.abs().max().item()
        assert err <= GRAD_TOL[dtype] * top, f"{name}: max |kernel - ref| = {err:.3e} ({err / top:.2e} of max)"


@every_case
def test_backward_matches_reference(name, dtype, D, shape):
    torch.manual_seed(3)
    B, H = shape
    L = 333
    mask = MASKS[name]
    q, k, v = (torch.randn(B, L, H, D, device="cuda", dtype=dtype, requires_grad=True) for _ in range(3))
    out = sequence_attention(q, k, v, mask)
    g = torch.randn_like(out)
    got = [t.reshape(B * L, H, D) for t in torch.autograd.grad(out, (q, k, v), g)]
    flat = [t.detach().reshape(B * L, H, D) for t in (q, k, v)]
    check_grads(got, *flat, g.reshape(B * L, H, D), mask, list(range(0, B * L + 1, L)), dtype)


def _kernels_of(fn, part: str):
    """fn's result and the names of the kernels it ran whose name holds `part`."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        result = fn()
        torch.cuda.synchronize()
    return result, {e.key.split("<")[0].split("(")[0] for e in prof.key_averages() if part in e.key}


def _backward_kernels(mask, D: int) -> set[str]:
    q, k, v = (torch.randn(1, 300, 2, D, device="cuda", dtype=torch.float16, requires_grad=True) for _ in range(3))
    out = sequence_attention(q, k, v, mask)
    return _kernels_of(lambda: torch.autograd.grad(out, (q, k, v), torch.randn_like(out)), "bwd")[1]


def _hopper_built() -> bool:
    """An H100 / H200 running sm_90a code (not GT_FUSED3S_JIT_ARCH's sm_80)."""
    import os
    return torch.cuda.get_device_capability() == (9, 0) and "9.0a" in os.environ.get("GT_FUSED3S_JIT_ARCH", "9.0a")


def test_backward_by_key_blocks_where_it_runs(monkeypatch):
    """Hopper built for sm_90a (not GT_FUSED3S_JIT_ARCH's sm_80 code), D = 64
    and a mask whose transpose the walk knows (local, dilated, block-dilated
    parts): the backward by key blocks, and for a mask of one local window
    its band kernel (seq_band_bwd.cuh; GT_FUSED3S_SEQ_BAND_BWD=0: the
    other); global or random parts, another head dim, another GPU: by query
    blocks. (Each against the reference above.)"""
    hopper = _hopper_built()
    names = {"band": "gt_fused3s::seq_band_bwd_kernel", "keys": "gt_fused3s::seq_bwd_keys_kernel",
             "queries": "gt_fused3s::seq_bwd_kernel"}
    for name, D, kind in (("local-wider", 64, "band"), ("causal", 64, "band"), ("dilated", 64, "keys"),
                          ("two-block-dilated", 64, "keys"), ("longformer", 64, "queries"),
                          ("bigbird", 64, "queries"), ("local-wider", 32, "queries"), ("local-wider", 128, "queries")):
        want = kind if hopper else "queries"
        ran = _backward_kernels(MASKS[name], D)
        assert [k for k, n in names.items() if any(r.endswith(n) for r in ran)] == [want], (name, D, ran)
    if hopper:
        monkeypatch.setenv("GT_FUSED3S_SEQ_BAND_BWD", "0")
        ran = _backward_kernels(MASKS["local-wider"], 64)
        assert [k for k, n in names.items() if any(r.endswith(n) for r in ran)] == ["keys"], ran


@pytest.mark.parametrize("name", ["local-wider", "longformer", "bigbird"])
def test_eager_step_is_one_cpp_autograd_node(name):
    """Eagerly, a batched call is one C++ autograd node (seq_attention_eager:
    SeqAttentionFn in csrc/bindings.cpp; with a mask's global rows inside it
    too) whose edges go straight to q, k and v (no Python node, no view
    nodes); its gradients for a non-contiguous output gradient equal those
    for the same values contiguous and the fp32 reference's; under
    torch.inference_mode the op's CUDA kernel gives the same output; opcheck
    passes on CUDA."""
    torch.manual_seed(5)
    mask = MASKS[name]
    q, k, v = (torch.randn(2, 300, 2, 64, device="cuda", dtype=torch.float16, requires_grad=True) for _ in range(3))
    out = sequence_attention(q, k, v, mask)
    assert "SeqAttentionFn" in out.grad_fn.name(), out.grad_fn.name()
    assert [type(f).__name__ for f, _ in out.grad_fn.next_functions[:3]] == ["AccumulateGrad"] * 3
    assert out.shape == q.shape and out.is_contiguous()
    g = torch.randn(2, 2, 300, 64, device="cuda", dtype=torch.float16).transpose(1, 2)   # strided
    got = torch.autograd.grad(out, (q, k, v), g, retain_graph=True)
    want = torch.autograd.grad(out, (q, k, v), g.contiguous())
    for a, b in zip(got, want):
        assert (a - b).abs().max() < 1e-2   # atomics add in any order
    flat = [t.detach().reshape(600, 2, 64) for t in (q, k, v)]
    check(out.detach().reshape(600, 2, 64), *flat, mask, [0, 300, 600], torch.float16)
    check_grads([t.reshape(600, 2, 64) for t in got], *flat, g.reshape(600, 2, 64), mask, [0, 300, 600],
                torch.float16)
    with torch.inference_mode():
        assert torch.equal(sequence_attention(q, k, v, mask), out.detach())
    from gt_fused3s import ops
    from gt_fused3s.sequence.masks import as_mask, kernel_code
    code = kernel_code(as_mask(mask))
    cu = torch.tensor([0, 300, 600], device="cuda", dtype=torch.int32)
    fw = ops.seq_windows(cu, code[0], 64)
    rows = as_mask(mask).global_rows(300)
    idx = torch.tensor(rows, device="cuda") if rows else None
    torch.library.opcheck(torch.ops.gt_fused3s.seq_attention_eager.default,
                          (q, k, v, cu, fw, None, code, 0.125, int(fw[-1]), idx),
                          test_utils=("test_schema", "test_faketensor", "test_autograd_registration"))


@pytest.mark.parametrize("name", ["longformer", "bigbird", "dilated", "block-dilated"])
def test_packed_documents_and_gradients(name):
    torch.manual_seed(1)
    mask = MASKS[name]
    lens = [300, 17, 1, 128]
    cu = [0] + torch.tensor(lens).cumsum(0).tolist()
    H, D = 2, 64
    q, k, v = (torch.randn(sum(lens), H, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
               for _ in range(3))
    out = sequence_attention(q, k, v, mask, cu_seqlens=torch.tensor(cu, device="cuda", dtype=torch.int32))
    check(out.detach(), q.detach(), k.detach(), v.detach(), mask, cu, torch.bfloat16)
    g = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v), g)
    check_grads(got, q, k, v, g, mask, cu, torch.bfloat16)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("name", ["local-wider", "dilated-wide", "global-then-wide"])
def test_large_scores_equal_reference(name, dtype):
    """Scores spread over tens of log2 units (q and k times 4, keys growing
    along the sequence): the full tiles' lazy reference point (moved only
    when a row's max passes it by 2^8) must move, and give the reference."""
    torch.manual_seed(9)
    L, H, D = 700, 2, 64
    q = torch.randn(1, L, H, D, device="cuda") * 4
    k = torch.randn(1, L, H, D, device="cuda") * 4 + torch.linspace(0, 3, L, device="cuda")[None, :, None, None]
    v = torch.randn(1, L, H, D, device="cuda")
    q, k, v = (t.to(dtype) for t in (q, k, v))
    out = sequence_attention(q, k, v, MASKS[name])
    check(out[0], q[0], k[0], v[0], MASKS[name], [0, L], dtype)


def long_documents_case(mask, dtype):
    """Output and gradients against the reference on documents of lengths
    that start a segment's runs of whole tiles on either stage and end them
    anywhere, with larger scores so that the lazy reference point moves
    inside a run."""
    torch.manual_seed(10)
    lens = [2900, 1, 1500, 777, 64, 1201]
    cu = [0] + torch.tensor(lens).cumsum(0).tolist()
    H, D = 2, 64
    q, k, v = (torch.randn(cu[-1], H, D, device="cuda") * 2 for _ in range(3))
    q, k, v = (t.to(dtype).requires_grad_() for t in (q, k, v))
    out = sequence_attention(q, k, v, mask, cu_seqlens=torch.tensor(cu, device="cuda", dtype=torch.int32))
    check(out.detach(), q.detach(), k.detach(), v.detach(), mask, cu, dtype)
    g = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v), g)
    check_grads(got, q.detach(), k.detach(), v.detach(), g, mask, cu, dtype)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("mask", [Local(600), Local(150, right=700), Local(900, causal=True)],
                         ids=["local600", "asym", "causal900"])
def test_long_band_runs_equal_reference(mask, dtype):
    """Bands long enough for runs of many full tiles (on Hopper the band's
    own loops: the forward's, and the backward by key blocks' without a
    barrier at each tile's end: seq_bwd_keys_kernel.cuh, band_run)."""
    long_documents_case(mask, dtype)


# Documents whose 64-query row blocks fall three to a block of the band
# kernel (seq_band_fwd.cuh) across one, two and three documents, documents
# of one token and of multiples of 64 and 192 tokens.
BAND_DOCS = [1, 63, 64, 65, 130, 1, 200, 5, 192, 191, 193, 3, 70, 400, 2000]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("mask", [Local(20), Local(100, causal=True), Local(0, right=130), Local(2000, right=10),
                                  Local(0), Local(50) | Global(3), Local(20, causal=True) | Global([0, 5, 64, 199, 1999]),
                                  Local(30) | Global(list(range(1, 2000, 63))), Dilated(60, 2, causal=True),
                                  Dilated(25, 2) | Global(3), Dilated(30, 2, right=7) | Global(list(range(1, 2000, 63))),
                                  Local(50) | Global(3) | RandomBlocks(128, 2, seed=3),
                                  Local(20, causal=True) | Global([0, 5, 64, 199, 1999]) | RandomBlocks(256, 3, seed=5),
                                  Local(10) | RandomBlocks(128, 4, seed=9)],
                         ids=["local20", "causal100", "right130", "left2000", "diagonal", "longformer",
                              "causal+global", "local+32global", "causal-dilated", "dilated+global",
                              "dilated+32global", "bigbird128", "bigbird256-causal", "local+random"])
def test_band_kernel_documents_equal_reference(mask, dtype):
    """The forward of one local window, or one dilated window (rate 2: the
    documents' 3,578 tokens a multiple of it), alone or with global keys, or
    a local window with random blocks of whole 128-key tiles (BigBird's), at
    D = 64 (on Hopper the warp-specialised band kernel, three row blocks a
    thread block, a pass per document and residue among them; the global
    keys by mma.sync first, each document its own, a key both global and in
    the band once; the random tiles after the passes', each document's and
    query block's list, a key the band or the global part gives counted there):
    output and gradients against the reference on packed documents of every
    length class."""
    torch.manual_seed(11)
    cu = [0] + torch.tensor(BAND_DOCS).cumsum(0).tolist()
    q, k, v = (torch.randn(cu[-1], 2, 64, device="cuda") * 2 for _ in range(3))
    q, k, v = (t.to(dtype).requires_grad_() for t in (q, k, v))
    out = sequence_attention(q, k, v, mask, cu_seqlens=torch.tensor(cu, device="cuda", dtype=torch.int32))
    check(out.detach(), q.detach(), k.detach(), v.detach(), mask, cu, dtype)
    g = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v), g)
    if mask == Local(0):   # one key a query: out = v, so dq = dk = 0 exactly (a relative check has no scale)
        errs = [(got[2].float() - g.float()).abs().max().item()] + [t.float().abs().max().item() for t in got[:2]]
        assert max(errs) <= 1e-3 * g.float().abs().max().item(), errs
    else:
        check_grads(got, q.detach(), k.detach(), v.detach(), g, mask, cu, dtype)


@pytest.mark.parametrize("mask", [Local(300, right=450), Local(50) | Global([0, 7, 4000]), Dilated(150, 2),
                                  Dilated(60, 3, right=20) | Global([0, 7, 4000]), Dilated(100, 4, causal=True),
                                  Local(50) | Global([0, 7, 4000]) | RandomBlocks(128, 3, seed=1)],
                         ids=["local", "longformer", "dilated2", "dilated3+global", "causal-dilated4", "bigbird"])
@pytest.mark.parametrize("shape", [(1, 70001, 1), (3, 1000, 4), (2, 4096, 2), (5, 9001, 3), (1, 72000, 1)],
                         ids=["L70001", "B3", "B2H2", "B5H3", "L72000"])
def test_band_kernel_equals_the_band_instance(shape, mask, monkeypatch):
    """GT_FUSED3S_SEQ_BAND=0 runs the sequence kernel's instances instead
    (the A/B switch of the benchmarks): outputs within fp16's
    rounding of each other, log-sum-exps (the backward's input) to 1e-5.
    GT_FUSED3S_SEQ_BAND=g launches the band kernel with a block a work item
    instead of a block an SM walking items (L70001 and B5H3 give a block
    several items, several heads): the same bits. On Hopper the band kernel
    runs where it takes the mask: a local window, or a dilated one (its TMA
    maps' rows rate apart: two maps a tensor where the tokens are not a
    multiple of the rate, L70001 and B5H3), or BigBird's with random blocks
    of 128 keys."""
    from gt_fused3s.sequence.masks import kernel_code
    torch.manual_seed(12)
    B, L, H = shape
    q, k, v = (torch.randn(B * L, H, 64, device="cuda", dtype=torch.float16) * 2 for _ in range(3))
    code = kernel_code(mask)
    cu = torch.arange(0, B + 1, device="cuda", dtype=torch.int32) * L
    rate = code[0]
    windows = ops.seq_windows(cu, rate, ops.seq_block_rows(64))
    num_windows = B * rate * (((L + rate - 1) // rate + 63) // 64)
    runs = []
    for env in ("1", "g", "0"):
        monkeypatch.setenv("GT_FUSED3S_SEQ_BAND", env)
        assert ops.kernel_available(q.device)   # (loads the extension)
        fwd = lambda: torch.ops.gt_fused3s.seq_fwd(q, k, v, cu, windows, code, 0.125, num_windows, 64)  # noqa: E731
        if env != "1":
            runs.append(fwd())
            continue
        run, ran = _kernels_of(fwd, "seq_")
        runs.append(run)
        band = _hopper_built() and B * L >= rate
        assert any(r.endswith("gt_fused3s::seq_band_fwd_kernel") for r in ran) == band, ran
    (out, lse), (out_g, lse_g), (out0, lse0) = runs
    assert torch.equal(out, out_g) and torch.equal(lse, lse_g)
    err = (out.float() - out0.float()).abs().max().item()
    assert err <= 2e-3 * out0.float().abs().max().item() + 1e-3, err
    assert torch.allclose(lse, lse0, rtol=0, atol=1e-5), (lse - lse0).abs().max().item()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("mask", [Local(300, right=450), Local(100, causal=True), Local(20)],
                         ids=["local", "causal", "narrow"])
@pytest.mark.parametrize("lens,H", [([70001], 1), ([1000] * 3, 4), ([9001, 1, 64, 65, 130, 7000], 3)],
                         ids=["L70001", "B3H4", "docsH3"])
def test_band_backward_equals_the_key_blocks_kernel(lens, H, mask, dtype, monkeypatch):
    """GT_FUSED3S_SEQ_BAND_BWD=0 runs the backward by key blocks instead of
    the band backward (seq_band_bwd.cuh; the A/B switch of the benchmarks):
    gradients within rounding of each other (dQ's atomics add in any order).
    The band backward's item orders (its counter; "s": each block striding
    the items; "g": a block an item) give the same dK and dV bits. On Hopper
    (D = 64) it runs for a mask of one local window; packed documents put
    a pair's two key blocks in two documents (docsH3)."""
    torch.manual_seed(13)
    T = sum(lens)
    q, k, v = (torch.randn(T, H, 64, device="cuda", dtype=dtype, requires_grad=True) for _ in range(3))
    g = torch.randn(T, H, 64, device="cuda", dtype=dtype)
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], device="cuda", dtype=torch.int32)
    out = sequence_attention(q, k, v, mask, cu_seqlens=cu)
    runs = {}
    for env in ("1", "s", "g", "0"):
        monkeypatch.setenv("GT_FUSED3S_SEQ_BAND_BWD", env)
        grads, ran = _kernels_of(lambda: torch.autograd.grad(out, (q, k, v), g, retain_graph=True), "bwd")
        runs[env] = grads
        band = any(r.endswith("gt_fused3s::seq_band_bwd_kernel") for r in ran)
        assert band == (_hopper_built() and env != "0"), (env, ran)
    for env in ("s", "g"):
        assert torch.equal(runs[env][1], runs["1"][1]) and torch.equal(runs[env][2], runs["1"][2]), env
    for a, b in zip(runs["1"], runs["0"]):
        err = (a.float() - b.float()).abs().max().item()
        assert err <= 4e-3 * b.float().abs().max().item() + 1e-3, err
    if T <= 4000:   # (the dense fp32 reference; the key blocks' kernel is checked against it above)
        check_grads(runs["1"], q.detach(), k.detach(), v.detach(), g, mask, cu.tolist(), dtype)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("mask", [Dilated(300, 2), Dilated(200, 3, causal=True), BlockDilated(1024, 4, offset=1),
                                  Dilated(300, 2) | Global([0, 5, 2000])],
                         ids=["dilated300x2", "causal200x3", "block1024x4", "dilated+global"])
def test_long_dilated_segments_equal_reference(mask, dtype):
    """Compacted dilated segments with many whole tiles of keys the mask's
    row stride apart, whose band edges take the closed-form mask bits
    (seq_mask.cuh: seq_band_tile_bits), one with global keys beside them;
    output and gradients (on Hopper the backward by key blocks, except with
    the global keys)."""
    long_documents_case(mask, dtype)


@pytest.mark.parametrize("name", ["local-wider", "bigbird"])
def test_negative_scale_equals_reference(name):
    """A negative scale (the kernel folds the scale into its exponent after a
    row max of raw scores, so the op passes -q and -scale): output and
    gradients equal the reference with that scale."""
    torch.manual_seed(8)
    mask, L, scale = MASKS[name], 333, -0.2
    q, k, v = (torch.randn(L, 2, 64, device="cuda", dtype=torch.float16, requires_grad=True) for _ in range(3))
    cu = torch.tensor([0, L], device="cuda", dtype=torch.int32)
    out = sequence_attention(q, k, v, mask, scale, cu_seqlens=cu)
    g = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v), g)
    leaves = [t.detach().float().requires_grad_() for t in (q, k, v)]
    ref = sequence_reference(*leaves, mask, [0, L], scale)
    want = torch.autograd.grad(ref, leaves, g.float())
    err = (out.float() - ref).abs().max().item()
    assert err <= 1e-2 * ref.abs().max().item(), err
    for name_, a, b in zip(("dq", "dk", "dv"), got, want):
        e, top = (a.float() - b).abs().max().item(), b.abs().max().item()
        assert e <= GRAD_TOL[torch.float16] * top, f"{name_}: {e:.3e} of {top:.3e}"


def test_more_than_2_31_elements():
    """q, k, v of 2^22 + 5 tokens x 8 heads x 64: offsets past 2^31 elements;
    the last 300 queries against the reference on the slice they see."""
    torch.manual_seed(2)
    L, H, D, w = (1 << 22) + 5, 8, 64, 64
    assert L * H * D > 2 ** 31
    q, k, v = (torch.randn(1, L, H, D, device="cuda", dtype=torch.float16) for _ in range(3))
    out = sequence_attention(q, k, v, Local(w))
    lo = L - 300 - w
    sl = [t[0, lo:] for t in (q, k, v)]
    ref = sequence_reference(*(t.float() for t in sl), Local(w), [0, L - lo])[w:]
    err = (out[0, L - 300:].float() - ref).abs().max().item()
    assert err < 1e-2, err


def test_backward_more_than_2_31_elements():
    """The backward past 2^31 elements (2^22 + 5 tokens x 8 heads x 64): dq of
    the last 300 queries and dk, dv of the last 300 - w keys (every query
    that sees them is among those 300) against the reference's gradients on
    the slice they see."""
    torch.manual_seed(4)
    L, H, D, w = (1 << 22) + 5, 8, 64, 64
    q, k, v = (torch.randn(1, L, H, D, device="cuda", dtype=torch.float16, requires_grad=True)
               for _ in range(3))
    g = torch.randn(1, L, H, D, device="cuda", dtype=torch.float16)
    dq, dk, dv = torch.autograd.grad(sequence_attention(q, k, v, Local(w)), (q, k, v), g)
    lo = L - 300 - w
    leaves = [t.detach()[0, lo:].float().requires_grad_() for t in (q, k, v)]
    g_ref = g[0, lo:].float().clone()
    g_ref[:w] = 0            # queries before the last 300: not compared, their keys reach outside the slice
    want = torch.autograd.grad(sequence_reference(*leaves, Local(w), [0, L - lo]), leaves, g_ref)
    for name, got, ref in (("dq", dq[0, L - 300:], want[0][w:]), ("dk", dk[0, L - 300 + w:], want[1][2 * w:]),
                           ("dv", dv[0, L - 300 + w:], want[2][2 * w:])):
        err, top = (got.float() - ref).abs().max().item(), ref.abs().max().item()
        assert err <= GRAD_TOL[torch.float16] * top, f"{name}: {err:.3e} of {top:.3e}"


def test_compiled_gradients_equal_eager():
    """torch.compile(fullgraph=True) of sequence_attention: the kernels'
    call is one custom op with its own autograd (gt_fused3s::seq_attention);
    eager's output and gradients. (The edge-feature products' traced
    autograd.Functions once got zero gradients on CUDA only: dynamo traced
    their backward with zeros for the incoming gradient.)"""
    torch._dynamo.reset()
    torch.manual_seed(6)
    mask = MASKS["longformer"]
    q, k, v = (torch.randn(2, 200, 2, 64, device="cuda", dtype=torch.float16, requires_grad=True)
               for _ in range(3))
    g = torch.randn(2, 200, 2, 64, device="cuda", dtype=torch.float16)
    results = []
    for fn in (sequence_attention, torch.compile(sequence_attention, fullgraph=True)):
        out = fn(q, k, v, mask)
        results.append((out, *torch.autograd.grad(out, (q, k, v), g)))
    for name, a, b in zip(("out", "dq", "dk", "dv"), *results):
        assert b.abs().max() > 0, name
        torch.testing.assert_close(a, b, atol=2e-3, rtol=2e-3, msg=lambda m: f"{name}: {m}")


def test_reduce_overhead_steps_equal_eager(monkeypatch):
    """torch.compile(mode="reduce-overhead") from empty caches, three steps:
    eager's output and gradients at every step. (The per-shape offsets and
    the global rows' index made by the first traced call were kept in the
    module's caches: CUDA-graph outputs, overwritten by the next replay.)"""
    import gt_fused3s.sequence.attention as att
    monkeypatch.setattr(att, "_OFFSETS", {})
    monkeypatch.setattr(att, "_ROW_INDEX", {})
    torch._dynamo.reset()
    torch.manual_seed(7)
    mask = MASKS["longformer"]
    q, k, v = (torch.randn(2, 200, 2, 64, device="cuda", dtype=torch.float16, requires_grad=True)
               for _ in range(3))
    compiled = torch.compile(sequence_attention, mode="reduce-overhead")
    for step in range(3):
        g = torch.randn(2, 200, 2, 64, device="cuda", dtype=torch.float16)
        torch.compiler.cudagraph_mark_step_begin()
        out_c = compiled(q, k, v, mask)
        got = [out_c.clone()] + [t.clone() for t in torch.autograd.grad(out_c, (q, k, v), g)]
        out_e = sequence_attention(q, k, v, mask)
        want = [out_e] + list(torch.autograd.grad(out_e, (q, k, v), g))
        for name, a, b in zip(("out", "dq", "dk", "dv"), got, want):
            torch.testing.assert_close(a, b, atol=2e-3, rtol=2e-3, msg=lambda m: f"step {step} {name}: {m}")
    torch._dynamo.reset()


@pytest.mark.parametrize("mask_name", ["longformer", "dilated+global"])
@pytest.mark.parametrize("rows_sms, L", [(None, 1 << 16), ("0", 1 << 16), ("7", 1 << 16), (None, 1 << 19)],
                         ids=["default", "one_stream", "7_sms", "default_512k"])
def test_global_rows_node_equals_the_composition_and_its_capture(rows_sms, L, mask_name, monkeypatch):
    """The eager node with a mask's global rows inside (SeqAttentionFn: the
    kernel, the dense rows over its rows, both backwards), at 65k and 512k
    tokens (Longformer and dilated + global, 2 heads; on Hopper both the
    band kernel's): its output and gradients equal those of the
    composition through Python (ops.DENSE_ROWS_MAX = 0: the kernel's op,
    then the rows written over it), and a whole step captured in a CUDA
    graph (gt_fused3s.capture), replayed on new inputs, equals the eager step.
    The node's forward runs the rows after the kernel on one stream (=0,
    and by default below 2^20 keys x batch x heads: 65k) or on a second
    stream beside it (GT_FUSED3S_ROWS_SMS=7: 7 SMs for the rows, the kernel
    on the others; by default from 2^20: 512k x 2 heads); the kernel's rows
    are the same bits either way."""
    import gt_fused3s.ops as ops
    import gt_fused3s.sequence.attention as att
    from gt_fused3s.capture import CudaGraphRunner
    mask = MASKS[mask_name]
    if rows_sms is not None:
        monkeypatch.setenv("GT_FUSED3S_ROWS_SMS", rows_sms)

    def step(q, k, v, g):
        leaves = [t.detach().requires_grad_() for t in (q, k, v)]
        out = sequence_attention(*leaves, mask)
        return [out, *torch.autograd.grad(out, leaves, g)]

    def inputs(seed):
        gen = torch.Generator(device="cuda").manual_seed(seed)
        return [torch.randn(1, L, 2, 64, generator=gen, device="cuda", dtype=torch.float16) for _ in range(4)]

    def assert_equal(got, want, what):
        for name, a, b in zip(("out", "dq", "dk", "dv"), got, want):
            assert b.abs().max() > 0, name
            torch.testing.assert_close(a, b, atol=2e-3, rtol=2e-3, msg=lambda m: f"{what} {name}: {m}")

    x = inputs(11)
    eager = step(*x)
    assert "SeqAttentionFn" in eager[0].grad_fn.name()
    with monkeypatch.context() as m:
        m.setenv("GT_FUSED3S_ROWS_SMS", "0")
        serial = step(*x)[0]
    rows = torch.tensor(mask.global_rows(L), device="cuda")
    kernel_rows = torch.ones(L, dtype=torch.bool, device="cuda").index_fill_(0, rows, False)
    assert torch.equal(eager[0][:, kernel_rows], serial[:, kernel_rows])
    torch.testing.assert_close(eager[0][:, rows], serial[:, rows], atol=1e-3, rtol=1e-3)
    with monkeypatch.context() as m:
        m.setattr(ops, "DENSE_ROWS_MAX", 0)
        m.setattr(att, "_REPEAT", {})   # (the eager calls above were remembered: the node again)
        one_stream = step(*x)
        assert "SeqAttentionFn" not in one_stream[0].grad_fn.name()
        assert_equal(eager, one_stream, "composition")
    runner = CudaGraphRunner(step)
    for seed in range(3):   # first: eager + capture; then replays
        x = inputs(seed)
        assert_equal([t.clone() for t in runner(*x)], step(*x), f"call {seed}")
    assert runner.captures == 1 and runner.replays == 2


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("D", [32, 64, 128])
@pytest.mark.parametrize("G, L", [(1, 1), (3, 1000), (32, 3000), (5, 2048), (12, 777), (3, 65543)])
def test_dense_rows_kernels_equal_reference(G, L, D, dtype):
    """The global rows' kernels (csrc/kernels/dense_rows.cu: keys split over
    warps (forward: 4 a multiprocessor, 128 keys at least; 65543 keys: 513
    chunks) or blocks (backward), merged; 1 to 32 queries: one or two m-tiles
    of 16) against fp32 softmax attention: output and the
    gradients of qg, k and v; k and v as views of [B, H, L, D] tensors (the
    strides Flex's side of the benchmark passes)."""
    from gt_fused3s import ops
    torch.manual_seed(G + L + D)
    B, H = 2, 3
    qg = torch.randn(B, G, H, D, device="cuda", dtype=dtype, requires_grad=True)
    kt, vt = (torch.randn(B, H, L, D, device="cuda", dtype=dtype, requires_grad=True) for _ in range(2))
    k, v = kt.transpose(1, 2), vt.transpose(1, 2)
    scale = D ** -0.5
    out = ops.dense_rows(qg, k, v, scale)
    g = torch.randn_like(out)
    got = torch.autograd.grad(out, (qg, kt, vt), g)
    leaves = [t.detach().float().requires_grad_() for t in (qg, kt, vt)]
    s = torch.einsum("bghd,bhld->bhgl", leaves[0], leaves[1]) * scale
    ref = torch.einsum("bhgl,bhld->bghd", torch.softmax(s, -1), leaves[2])
    want = torch.autograd.grad(ref, leaves, g.float())
    tol = 2e-3 if dtype == torch.float16 else 2e-2
    # Relative to the largest entry, with a floor: with one key (L = 1) the
    # softmax is 1 and dq is exactly 0, so both sides are rounding noise.
    _err = lambda a, b: ((a.float() - b).abs().max() / b.abs().max().clamp_min(1e-2)).item()   # noqa: E731
    assert _err(out, ref) <= tol
    for name, a, b in zip(("dq", "dk", "dv"), got, want):
        assert _err(a, b) <= 4 * tol, name
