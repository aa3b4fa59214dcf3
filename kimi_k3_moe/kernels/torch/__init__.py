"""The pure-PyTorch backend: the reference's arithmetic, on any device."""
from kimi_k3_moe.act_quant import ACT_DTYPES
from kimi_k3_moe.kernels.torch.backend import TorchBackend

__all__ = ["TorchBackend", "make_backend", "supported_act_dtypes"]


def supported_act_dtypes(arch: str | None) -> tuple[str, ...]:
    """Every act dtype on any arch: quantized activations are emulated (quantize, dequantize, fp32)."""
    return ACT_DTYPES


def make_backend(**options) -> TorchBackend:
    return TorchBackend(**options)
