"""Ahead-of-time compilation of the Triton kernels for sm_90, gfx942 and gfx950 (no GPU).

Needs compiled, not interpreted, kernels: run this suite in its own process
(`make test-compile-triton`), never together with tests/triton.
"""
import os

import pytest

pytest.importorskip("triton")


def pytest_collection_modifyitems(config, items):
    if os.environ.get("TRITON_INTERPRET", "0") == "1":
        skip = pytest.mark.skip(reason="TRITON_INTERPRET=1 is set: run tests/compile on its own")
        for item in items:
            item.add_marker(skip)
