"""The Triton backend: fused MoE kernels over MXFP4 or int4 experts.

Importing this package imports neither triton nor torch's GPU state; the
kernels are loaded when the backend first prepares or runs experts.
"""
from __future__ import annotations

__all__ = ["make_backend"]


def make_backend(**options):
    from kimi_k3_moe.kernels.triton.backend import TritonBackend
    return TritonBackend(**options)
