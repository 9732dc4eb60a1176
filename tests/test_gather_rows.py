"""ops.gather_rows (rows of a tensor by an index, csrc/kernels/gather_rows.h)
on the CPU: the registered op and its fake through the stand-in (opcheck),
and the helper equal to index_select for every caller's shapes and index
dtypes, on the kernel path and off it."""
from __future__ import annotations

import pytest
import torch

from gt_fused3s.ops import gather_rows


def _cases():
    g = torch.Generator().manual_seed(0)
    yield torch.randn(50, 4, 16, generator=g).half(), torch.randint(0, 50, (70,), generator=g)
    yield torch.randn(9, 3, generator=g), torch.tensor([8, 0, 0, 3])
    yield torch.randint(-5, 5, (12, 3), generator=g).to(torch.int8), torch.randperm(12, generator=g)
    yield torch.randn(6, 5, generator=g).bfloat16(), torch.empty(0, dtype=torch.long)
    yield torch.randn(6, generator=g), torch.tensor([5, 1], dtype=torch.int32)      # 1-D rows, int32 index


@pytest.mark.parametrize("kernel_path", [False, True])
def test_equals_index_select(request, kernel_path):
    calls = request.getfixturevalue("stand_in_kernels").calls if kernel_path else []
    for x, index in _cases():
        assert torch.equal(gather_rows(x, index), x.index_select(0, index))
    assert calls.count("gather_rows") == (5 if kernel_path else 0)


def test_opcheck(stand_in_kernels):
    for x, index in _cases():
        if index.dtype == torch.int64:
            torch.library.opcheck(torch.ops.gt_fused3s.gather_rows.default, (x, index))
