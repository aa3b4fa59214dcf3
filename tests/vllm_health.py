"""Waiting for a vLLM OpenAI server a test started (shared by the suites that serve one)."""
from __future__ import annotations

import subprocess
import time
import urllib.request
from pathlib import Path


def wait_healthy(url: str, proc: subprocess.Popen, log: Path, limit_s: float) -> None:
    """Return once `url`/health answers 200; fail with the server's log tail if it exits or times out."""
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"vLLM exited with {proc.returncode}:\n{log.read_text()[-6000:]}")
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(2)
    raise AssertionError(f"vLLM not healthy after {limit_s} s:\n{log.read_text()[-6000:]}")
