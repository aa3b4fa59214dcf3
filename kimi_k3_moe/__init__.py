"""Kimi-K3 routed-expert MoE kernels and vLLM/SGLang plugins.

Importing the package is cheap: engines and kernel compilers (vllm, sglang,
triton, flydsl) are imported only by the code that needs them.
"""
__version__ = "0.1.0"
