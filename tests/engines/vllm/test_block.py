"""vLLM's own K3 MoE block (FusedMoEFactory, LatentMoERunner) served by our method, single rank.

Built from vLLM's config for a synthetic checkpoint, loaded by vLLM's weight
loader from the safetensors, run through vLLM's runner (router, shared
experts, latent norm and up-projection), and compared with our float64
reference.
"""
from __future__ import annotations

import logging

import pytest
import torch
from moe_helpers import SITU

from kimi_k3_moe.activation import ActivationSpec

SILU = ActivationSpec.silu()
TOKENS = 9


class Lines(logging.Handler):
    def __init__(self):
        super().__init__()
        self.records = []

    def emit(self, record):
        self.records.append(record)


RUNNERS = {"nvidia": "LatentMoERunner", "amd": "ROCmLatentMoERunner"}


@pytest.fixture(scope="module", params=[("nvidia", "2-D scales"), ("nvidia", "4-D scales"), ("amd", "2-D scales")],
                ids=lambda p: f"{p[0]}, {p[1]}")
def served(request, single_rank, session_seed):
    """One block per K3 variant and scale layout:
    (checkpoint, vllm config, block, input, output, recorder, log lines, variant)."""
    import vllm_k3 as k3

    from kimi_k3_moe.plugin_entrypoints import common

    variant, scales = request.param
    checkpoint = request.getfixturevalue("k3_checkpoint" if scales == "2-D scales" else "k3_checkpoint_4d_scales")
    config = k3.make_vllm_config(checkpoint)
    block = k3.build_block(config, variant=variant)
    k3.load_block(block, config, checkpoint, variant)
    # Stands in for the stream handler vLLM's logging config puts on its `vllm` logger.
    lines, vllm_logger = Lines(), logging.getLogger("vllm")
    vllm_logger.addHandler(lines)
    common._logged.clear()
    try:
        k3.process_after_loading(block, config)
    finally:
        vllm_logger.removeHandler(lines)
    recorder = k3.ApplyRecorder(k3.routed_layer(block).quant_method)
    x = torch.randn(TOKENS, k3.HIDDEN, generator=torch.Generator().manual_seed(session_seed)).to(torch.bfloat16)
    return checkpoint, config, block, x, k3.forward(block, config, x), recorder, lines.records, variant


def test_block_gets_our_method_and_vllms_parameters(served):
    import vllm_k3 as k3

    from kimi_k3_moe.plugin_entrypoints._vllm_method import K3RoutedExpertsMethod

    _, _, block, *_, variant = served
    layer = k3.routed_layer(block)
    assert type(layer.quant_method) is K3RoutedExpertsMethod
    assert type(block.experts).__name__ == RUNNERS[variant]
    e, h, i = k3.EXPERTS, k3.LATENT, k3.INTER
    params = {n: (tuple(p.shape), p.dtype) for n, p in layer.named_parameters() if n.startswith("w")}
    assert params == {"w13_weight": ((e, 2 * i, h // 2), torch.uint8),
                      "w13_weight_scale": ((e, 2 * i, h // 32), torch.uint8),
                      "w2_weight": ((e, h, i // 2), torch.uint8),
                      "w2_weight_scale": ((e, h, i // 32), torch.uint8)}
    assert layer.w13_weight_scale.quant_method == layer.w2_weight_scale.quant_method == "block"


def test_vllms_loader_put_w1_then_w3(served):
    """The parameters hold the checkpoint's bytes: w1 in the first half of w13, w3 in the second."""
    import vllm_k3 as k3

    checkpoint, _, block, *_ = served
    layer = k3.routed_layer(block)
    expected = k3.reference_experts(checkpoint)  # our own reader (it squeezes 4-D scales itself)
    for ours, theirs in zip(expected.tensors(), (layer.w13_weight, layer.w13_weight_scale, layer.w2_weight,
                                                 layer.w2_weight_scale)):
        assert torch.equal(ours, theirs.data)
    i = k3.INTER
    w1 = k3.checkpoint_tensors(checkpoint)[
        f"{k3.CHECKPOINT_PREFIX}layers.{k3.LAYER}.block_sparse_moe.experts.3.w1.weight_packed"]
    assert torch.equal(layer.w13_weight.data[3, :i], w1)


def test_forward_matches_the_float64_reference(served):
    """The whole block through vLLM's runner, against our float64 block (router included)."""
    import vllm_k3 as k3

    checkpoint, config, block, x, out, recorder, *_ = served
    recorder.calls.clear()
    assert torch.equal(k3.forward(block, config, x), out)
    (call,) = recorder.calls
    eps = config.model_config.hf_text_config.rms_norm_eps
    expected = k3.block_reference(checkpoint, x, SITU, SITU, eps, engine_ids=call["topk_ids"])
    with_silu = k3.block_reference(checkpoint, x, SILU, SITU, eps, engine_ids=call["topk_ids"])
    assert k3.rel_l2(out, expected) <= 1e-2
    assert k3.rel_l2(out, with_silu) > 5e-2


def test_apply_gets_vllms_topk_and_returns_the_routed_sum(served):
    """What vLLM's runner handed to apply and got back, against the float64 routed experts."""
    import vllm_k3 as k3

    checkpoint, config, block, x, *_ = served
    recorder = served[5]
    recorder.calls.clear()
    k3.forward(block, config, x)
    (call,) = recorder.calls
    assert call["x"].shape == (TOKENS, k3.LATENT) and call["out"].dtype == call["x"].dtype
    assert call["topk_ids"].shape == (TOKENS, k3.SHAPE["num_experts_per_token"]) and call["expert_map"] is None
    experts = k3.reference_experts(checkpoint)
    args = (call["x"], call["topk_weights"], call["topk_ids"])
    assert k3.rel_l2(call["out"], k3.routed_reference(experts, *args, SITU)) <= 1e-2
    assert k3.rel_l2(call["out"], k3.routed_reference(experts, *args, SILU)) > 5e-2


def test_one_log_line_names_version_backend_activation(served):
    from kimi_k3_moe import __version__

    records = served[6]
    lines = [r.getMessage() for r in records if "serving Kimi-K3" in r.getMessage()]
    assert lines == [f"kimi-k3-moe {__version__} serving Kimi-K3 routed experts in vllm: backend torch[mxfp4], "
                     "activation situv2(beta=4, linear_beta=25.0)"]
    assert all(r.levelno == logging.INFO for r in records if "serving Kimi-K3" in r.getMessage())
