"""The pure-PyTorch backend: the reference's arithmetic, on any device."""
from kimi_k3_moe.kernels.torch.backend import TorchBackend

__all__ = ["TorchBackend", "make_backend"]


def make_backend(**options) -> TorchBackend:
    return TorchBackend(**options)
