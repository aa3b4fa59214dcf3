"""What a result was measured on: device (as configs.user_tables identifies it), versions, git."""
from __future__ import annotations

import importlib.metadata as md
import subprocess
import time
from pathlib import Path

import torch

from kimi_k3_moe import __version__
from kimi_k3_moe.configs.user_tables import device_identity


def _pkg(name: str) -> str | None:
    try:
        return md.version(name)
    except md.PackageNotFoundError:
        return None


def git_version() -> str | None:
    root = Path(__file__).resolve().parents[2]
    if not (root / ".git").exists():
        return None
    try:
        out = subprocess.run(["git", "-C", str(root), "describe", "--always", "--dirty"],
                             capture_output=True, text=True, timeout=10)
        return out.stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def run_info() -> dict:
    """Everything a user sends us with a result."""
    info = {"date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "package": __version__, "git": git_version(),
            "device": device_identity(), "torch": torch.__version__, "cuda": torch.version.cuda,
            "hip": getattr(torch.version, "hip", None)}
    for name in ("triton", "flydsl", "humming-kernels", "amd-aiter", "aiter", "vllm", "sglang"):
        info[name] = _pkg(name)
    if torch.cuda.is_available():
        info["sms"] = torch.cuda.get_device_properties(0).multi_processor_count
    return info
