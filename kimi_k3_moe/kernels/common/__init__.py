"""What the Triton and the FlyDSL backends both launch around their GEMMs: the token alignment
(`alignment`), the top-k sum (`topk_sum`), the zero fill and cast of the atomic reduction
(`elementwise`), and `launch.Launch`, a kernel launch as data. Written in Triton: on ROCm the
engines' Triton compiles them, on the CPU they run under Triton's interpreter.

This package imports neither backend; both import it (tests/core/test_import_layers.py).
"""
