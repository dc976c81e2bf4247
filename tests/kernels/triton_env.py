"""Where the Triton kernel tests run: compiled on a CUDA device, else through Triton's
interpreter on the CPU at small sizes. TRITON_INTERPRET must be set before triton is first
imported, so a test module imports this before anything that imports triton; the importing
module is skipped where neither is possible (no triton, or no CUDA with the interpreter off).
"""

import os

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton")

from dspark.layers import triton_ops as ops  # noqa: E402

INTERPRET = ops.INTERPRET
if not HAS_CUDA and not INTERPRET:
    pytest.skip("no CUDA device and TRITON_INTERPRET is off", allow_module_level=True)
DEVICE = "cpu" if INTERPRET else "cuda"
cuda_only = pytest.mark.skipif(not HAS_CUDA or INTERPRET, reason="needs a CUDA device")
