"""Shared fixtures. Every run draws fresh seeds; set KIMI_K3_MOE_TEST_SEED to replay one."""
from __future__ import annotations

import os
import random
import zlib

import pytest
import torch

_BASE_SEED = int(os.environ.get("KIMI_K3_MOE_TEST_SEED") or random.SystemRandom().randrange(2**31))
# pytest-xdist's workers start from this environment: one base seed for the whole run
os.environ["KIMI_K3_MOE_TEST_SEED"] = str(_BASE_SEED)


def pytest_report_header(config):
    return f"kimi-k3-moe test seed: {_BASE_SEED} (replay with KIMI_K3_MOE_TEST_SEED={_BASE_SEED})"


def _derived(nodeid: str) -> int:
    # Distinct per test (or module), reproducible from the base seed: crc32, unlike hash(), is the
    # same in every process.
    return (_BASE_SEED + zlib.crc32(nodeid.encode()) % 100_003) % 2**31


@pytest.fixture
def seed(request) -> int:
    value = _derived(request.node.nodeid)
    print(f"seed={value} (base {_BASE_SEED})")
    return value


@pytest.fixture
def gen(seed) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


@pytest.fixture(scope="module")
def module_gen(request) -> torch.Generator:
    """For module-scoped data (e.g. one problem shared by a module's tests)."""
    value = _derived(request.node.nodeid)
    print(f"module seed={value} (base {_BASE_SEED})")
    return torch.Generator().manual_seed(value)


@pytest.fixture(scope="session")
def session_seed() -> int:
    """For session-scoped data (e.g. a synthetic checkpoint shared by a suite)."""
    return _BASE_SEED


@pytest.fixture
def tables(tmp_path, monkeypatch):
    """User tables (`kimi-k3-moe tune`) go to tmp_path/tables for this test; yields tmp_path."""
    from kimi_k3_moe.configs import user_tables
    monkeypatch.setenv(user_tables.ENV_DIR, str(tmp_path / "tables"))
    user_tables.clear_cache()
    yield tmp_path
    user_tables.clear_cache()


@pytest.fixture
def gsm8k(capsys):
    """`kimi-k3-moe gsm8k ...` in this process: (exit code, stdout, stderr)."""
    from kimi_k3_moe import cli

    def run(args: list[str]) -> tuple[int, str, str]:
        code = cli.main(args)
        out, err = capsys.readouterr()
        return code, out, err
    return run
