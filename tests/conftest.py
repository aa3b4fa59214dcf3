"""Shared fixtures. Every run draws fresh seeds; set KIMI_K3_MOE_TEST_SEED to replay one."""
from __future__ import annotations

import os
import random

import pytest
import torch

_BASE_SEED = int(os.environ.get("KIMI_K3_MOE_TEST_SEED") or random.SystemRandom().randrange(2**31))


def pytest_report_header(config):
    return f"kimi-k3-moe test seed: {_BASE_SEED} (replay with KIMI_K3_MOE_TEST_SEED={_BASE_SEED})"


@pytest.fixture
def seed(request) -> int:
    # Distinct per test, reproducible from the base seed.
    value = (_BASE_SEED + hash(request.node.nodeid) % 100_003) % 2**31
    print(f"seed={value} (base {_BASE_SEED})")
    return value


@pytest.fixture
def gen(seed) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


@pytest.fixture(scope="session")
def session_seed() -> int:
    """For session-scoped data (e.g. a synthetic checkpoint shared by a suite)."""
    return _BASE_SEED
