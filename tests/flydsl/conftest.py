"""FlyDSL suite: CPU checks of the kernels' address logic, and compile-only checks.

The forward's alignment and top-k sum are Triton kernels: here they run under Triton's
interpreter, which must be on before triton is first imported (triton.jit reads it when
the kernels are defined), so it is set at collection time.
"""
from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402


@pytest.fixture(autouse=True)
def _one_thread():
    # the emulator multiplies many tiny tiles; threads only add contention on a 2-core box
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)
