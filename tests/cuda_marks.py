"""What the GPU test files share: their marks (``pytestmark = GPU_TESTS``:
the ``cuda`` marker that CI deselects, a skip without a GPU, and the
extension built once through conftest.py's ``ops`` fixture, so that a failed
build is each test's error, not a skip) and the low-precision dtypes by name."""
import pytest
import torch

GPU_TESTS = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.usefixtures("ops"),
]

LOW = {"fp16": torch.float16, "bf16": torch.bfloat16}
