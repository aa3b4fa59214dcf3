"""The Triton backend's CPU suite: kernels run under Triton's interpreter.

TRITON_INTERPRET must be set before triton is first imported (triton.jit reads
it when the kernels are defined), so it is set here, at collection time.
Run this suite on its own (`make test-triton`); the ahead-of-time compile
suite (tests/compile) needs compiled, not interpreted, kernels.
"""
import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

pytest.importorskip("triton")
