"""What a result or a tuned table was measured on: device, arch, driver, versions, git."""
from __future__ import annotations

import importlib.metadata as md
import subprocess
import time
from pathlib import Path

import torch

from kimi_k3_moe import __version__

INTERPRETER = "interpreter"


def _pkg(name: str) -> str | None:
    try:
        return md.version(name)
    except md.PackageNotFoundError:
        return None


def driver_version() -> str:
    """NVIDIA driver, or the HIP/ROCm version on AMD; 'none' without a GPU."""
    if getattr(torch.version, "hip", None):
        return f"hip {torch.version.hip}"
    if not torch.cuda.is_available():
        return "none"
    try:
        text = Path("/proc/driver/nvidia/version").read_text()
        for word in text.split():
            if word.count(".") >= 1 and word.replace(".", "").isdigit():
                return f"nvidia {word}"
    except OSError:
        pass
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20)
        if out.returncode == 0 and out.stdout.strip():
            return f"nvidia {out.stdout.split()[0]}"
    except (OSError, subprocess.SubprocessError):
        pass
    return f"cuda {torch.version.cuda}"


def device_identity(device: int = 0) -> dict:
    """The key a tuned table is valid for: device name, arch, driver (and a filesystem-safe key)."""
    from kimi_k3_moe.configs.triton_table import device_key
    from kimi_k3_moe.dispatch import gfx_arch
    if not torch.cuda.is_available():
        return {"name": INTERPRETER, "key": INTERPRETER, "arch": INTERPRETER, "driver": "none"}
    props = torch.cuda.get_device_properties(device)
    if getattr(torch.version, "hip", None):
        arch = gfx_arch(getattr(props, "gcnArchName", ""))
    else:
        arch = f"sm_{props.major}{props.minor}"
    return {"name": props.name, "key": device_key(props.name), "arch": arch, "driver": driver_version()}


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
