"""FlyDSL suite: CPU checks of the kernels' address logic, and compile-only checks."""
from __future__ import annotations

import pytest
import torch


@pytest.fixture(autouse=True)
def _one_thread():
    # the emulator multiplies many tiny tiles; threads only add contention on a 2-core box
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)
