"""The load-time self-check runs inside vLLM's weight processing, before any forward.

No GPU backend runs on this box, so the plan is replaced by a deliberately
broken backend (the torch kernel computing SiLU whatever it is asked, the
defect class where a kernel ignores the activation) followed by the torch
reference backend, as a GPU plan puts torch behind its kernels.
"""
from __future__ import annotations

import logging

import pytest
from moe_helpers import broken_plan as make_broken_plan

from kimi_k3_moe.loading import SelfCheckCache


@pytest.fixture
def broken_plan(monkeypatch):
    from kimi_k3_moe import routed_experts
    from kimi_k3_moe.plugin_entrypoints._vllm_method import K3RoutedExpertsMethod

    monkeypatch.setattr(K3RoutedExpertsMethod, "self_checks", SelfCheckCache())
    plan = make_broken_plan()
    monkeypatch.setattr(routed_experts, "plan_backends", lambda platform: plan)


def _built_and_loaded(checkpoint):
    import vllm_k3 as k3

    config = k3.make_vllm_config(checkpoint)
    block = k3.build_block(config)
    k3.load_block(block, config, checkpoint)
    return block, config


def test_strict_stops_the_load(single_rank, k3_checkpoint, broken_plan, monkeypatch):
    import vllm_k3 as k3

    from kimi_k3_moe.self_check import SelfCheckFailed

    monkeypatch.setenv("KIMI_K3_MOE_SELF_CHECK", "strict")
    block, config = _built_and_loaded(k3_checkpoint)
    with pytest.raises(SelfCheckFailed, match=r"silu-only.* disagrees with the reference"):
        k3.process_after_loading(block, config)


def test_fallback_refuses_loudly_and_serves_with_the_next(single_rank, k3_checkpoint, broken_plan, monkeypatch):
    import vllm_k3 as k3

    monkeypatch.setenv("KIMI_K3_MOE_SELF_CHECK", "fallback")
    block, config = _built_and_loaded(k3_checkpoint)
    records = []
    handler = logging.Handler()
    handler.emit = records.append  # stands in for vLLM's configured stream handler
    logging.getLogger("vllm").addHandler(handler)
    try:
        k3.process_after_loading(block, config)
    finally:
        logging.getLogger("vllm").removeHandler(handler)
    assert k3.routed_layer(block).quant_method.routed.backend.name == "torch"
    assert any(r.levelno == logging.ERROR and "REFUSING backend silu-only" in r.getMessage() for r in records)
