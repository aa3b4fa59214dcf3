"""The pure-PyTorch backend: the reference's arithmetic, on any device."""
from kimi_k3_moe.act_quant import ACT_DTYPES
from kimi_k3_moe.kernels.spec import BackendSpec

__all__ = ["SPEC", "make_backend"]


def _runs_on(platform, weight_format):
    return True, "pure PyTorch, runs anywhere (the last fallback)"


# Every act dtype on any arch: quantized activations are emulated (quantize, dequantize, fp32).
# Picks experts with host round trips, so it cannot run inside a CUDA graph capture.
SPEC = BackendSpec("torch", __name__, _runs_on, act_dtypes=lambda platform, weight_format: ACT_DTYPES,
                   graph_safe=False, self_checked=False, emulates=True)


def make_backend(**options):
    from kimi_k3_moe.kernels.torch.backend import TorchBackend
    return TorchBackend(**options)
