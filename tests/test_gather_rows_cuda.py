"""gather_rows on the GPU (csrc/kernels/gather_rows.cu) against
index_select: every word width the kernel picks (16, 8, 4, 2, 1 bytes: rows
of 128, 24, 12, 6 and 3 bytes, and a slice whose pointer is only 2-byte
aligned), power-of-two and other row lengths, dtypes, a non-contiguous
input, an empty index, and an index out of range (its row all 0xff bytes,
NaN in a float type, the others right)."""
from __future__ import annotations

import pytest
import torch

from gt_fused3s.ops import gather_rows

from cuda_marks import GPU_TESTS

pytestmark = GPU_TESTS


@pytest.mark.parametrize("shape,dtype", [((1000, 4, 16), torch.float16), ((700, 6), torch.float32),
                                         ((700, 3), torch.float32), ((513, 3), torch.float16),
                                         ((300, 3), torch.int8), ((400, 4), torch.float32),
                                         ((400, 8, 32), torch.bfloat16), ((257,), torch.int64),
                                         ((2000, 5), torch.bool)])
def test_equals_index_select(shape, dtype):
    g = torch.Generator(device="cuda").manual_seed(1)
    x = (torch.randn(shape, device="cuda", generator=g) * 4).to(dtype)
    for n in (0, 1, 5000):
        index = torch.randint(0, shape[0], (n,), device="cuda", generator=g)
        assert torch.equal(gather_rows(x, index), x.index_select(0, index))


def test_unaligned_and_non_contiguous_inputs():
    x = torch.randn(401, 3, device="cuda").half()[1:]          # 6-byte rows from a 6-byte offset
    index = torch.randperm(400, device="cuda")
    assert torch.equal(gather_rows(x, index), x.index_select(0, index))
    y = torch.randn(16, 300, device="cuda").t()                 # rows not contiguous
    assert torch.equal(gather_rows(y, index[:100] % 300), y.index_select(0, index[:100] % 300))


def test_index_out_of_range_fills_its_row():
    x = torch.randn(50, 8, device="cuda")
    index = torch.tensor([3, 50, -1, 7], device="cuda")
    out = gather_rows(x, index)
    assert out[1:3].isnan().all() and torch.equal(out[[0, 3]], x[[3, 7]])
