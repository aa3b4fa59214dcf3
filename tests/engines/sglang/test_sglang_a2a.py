"""`--moe-a2a-backend deepep` (normal mode) and `mori`: SGLang's real MoE layers, the plugin's method, EP 2.

Real here: SGLang's `DeepEPMoE` (MoRI EPv2: `FusedMoE`) chosen by `get_moe_impl_class`, its
`forward` -> `forward_impl` -> `run_moe_core` -> the method's `apply`, SGLang's dispatch-output and
combine-input classes, K3's `load_weights` filling this rank's experts.

Stand-ins, because deep_ep and mori need their GPUs and NICs (neither imports on a CPU box):
- `StandInDispatcher` replaces the layer's dispatcher. `Fabric` plays the all-to-all for two EP
  ranks in one process: it builds each rank's dispatch output in the layout deep_ep's
  `Buffer.dispatch` / mori's `EpDispatchCombineOp.dispatch` give (SGLang's `dispatch_b` wraps
  them unchanged), and sums the ranks' combine inputs per source token as their combine does.
- DeepEP normal: DeepGEMM JIT is reported on (`ENABLE_JIT_DEEPGEMM`), as on an H100, without
  which SGLang's DeepEP normal combine raises. MoRI: the platform is reported as ROCm (`_is_hip`).
"""
from __future__ import annotations

import contextlib

import pytest
import torch
from moe_helpers import SITU
from sglang_k3 import (
    EXPERTS,
    LATENT,
    MODEL_PREFIX,
    MOE_LAYERS,
    load_into,
    reference_experts,
    serving,
    tp_group_stand_in,
)

from kimi_k3_moe.activation import ActivationSpec
from kimi_k3_moe.plugin_entrypoints._sglang_method import K3RoutedExpertsMethod, UnsupportedSGLangSetup
from kimi_k3_moe.reference import moe_forward, relative_l2

LAYER = MOE_LAYERS[0]
EP = 2
TOKENS_PER_RANK = 7
TOP_K = 4
CAPACITY = 40  # MoRI's receive buffer: more rows than any rank receives here


class StandInDispatcher:
    """The layer's dispatcher: hands over what `Fabric` staged for this rank and keeps the combine input."""

    def __init__(self):
        self.quant_config = None
        self.staged = None
        self.combine_input = None

    def set_quant_config(self, quant_config: dict) -> None:
        self.quant_config = quant_config

    def dispatch(self, hidden_states, topk_output):
        return self.staged

    def combine(self, combine_input):
        self.combine_input = combine_input
        return torch.zeros(TOKENS_PER_RANK, LATENT, dtype=torch.bfloat16)  # the real combine returns the sums


class Fabric:
    """The all-to-all between EP ranks, rank r holding experts [r*E/EP, (r+1)*E/EP)."""

    def __init__(self, xs, ids, weights, gen):
        self.xs, self.ids, self.weights, self.gen = xs, ids, weights, gen
        self.per_rank = EXPERTS // EP
        self.sources: dict[int, list[tuple[int, int]]] = {}

    def _received(self, rank):
        """(source rank, token) of every token with at least one expert on `rank`, in deep_ep's order."""
        first, last = rank * self.per_rank, (rank + 1) * self.per_rank
        here = [((ids >= first) & (ids < last)).any(dim=1) for ids in self.ids]
        return [(src, t) for src in range(EP) for t in torch.nonzero(here[src]).flatten().tolist()]

    def deepep_normal(self, rank):
        from sglang.srt.layers.moe.token_dispatcher.deepep import DeepEPNormalDispatchOutput

        rows = self.sources[rank] = self._received(rank)
        hidden = torch.stack([self.xs[s][t] for s, t in rows])
        glob = torch.stack([self.ids[s][t] for s, t in rows]).long()
        local = torch.where((glob // self.per_rank) == rank, glob - rank * self.per_rank, torch.full_like(glob, -1))
        weights = torch.stack([self.weights[s][t] for s, t in rows])
        counts = [int((local == e).sum()) for e in range(self.per_rank)]
        return DeepEPNormalDispatchOutput(hidden, None, local, weights, counts)

    def mori(self, rank, low_latency: bool, recv_cap: int):
        from sglang.srt.layers.moe.token_dispatcher.moriep import MoriEPLLDispatchOutput, MoriEPNormalDispatchOutput

        rows = self.sources[rank] = self._received(rank)
        n = len(rows)
        # Stale rows past the count: finite garbage with ids that name this rank's experts.
        hidden = 50 * torch.randn(CAPACITY, LATENT, generator=self.gen).to(torch.bfloat16)
        ids = torch.randint(0, EXPERTS, (CAPACITY, TOP_K), generator=self.gen).to(torch.int32)
        weights = torch.rand(CAPACITY, TOP_K, generator=self.gen)
        hidden[:n] = torch.stack([self.xs[s][t] for s, t in rows])
        ids[:n] = torch.stack([self.ids[s][t] for s, t in rows]).to(torch.int32)  # global ids, all k slots
        weights[:n] = torch.stack([self.weights[s][t] for s, t in rows])
        kind = MoriEPLLDispatchOutput if low_latency else MoriEPNormalDispatchOutput
        return kind(hidden_states=hidden, hidden_states_scale=None, topk_ids=ids, topk_weights=weights,
                    num_recv_tokens_per_expert=torch.tensor([n], dtype=torch.int32), origin_topk_ids=self.ids[rank],
                    origin_topk_weights=self.weights[rank], out_dtype=torch.bfloat16, recv_cap=recv_cap)

    def combine(self, outputs: dict[int, torch.Tensor]) -> torch.Tensor:
        """Each source token's sum of the rows the ranks returned for it (rows past the count unread)."""
        total = torch.zeros(EP, TOKENS_PER_RANK, LATENT, dtype=torch.float64)
        for rank, out in outputs.items():
            for row, (src, t) in enumerate(self.sources[rank]):
                total[src, t] += out[row].double()
        return total.reshape(EP * TOKENS_PER_RANK, LATENT)


@contextlib.contextmanager
def a2a_backend(backend: str, mode: str):
    from sglang.srt.layers.moe.utils import DeepEPMode, MoeA2ABackend
    from sglang.srt.runtime_context import get_flags

    with get_flags().moe.override(a2a_backend=MoeA2ABackend(backend), deepep_mode=DeepEPMode(mode)):
        yield


@contextlib.contextmanager
def gpu_reported(monkeypatch, backend: str, mori_epv2: bool = True):
    """See the module docstring: what the stand-ins report, and the stand-in dispatcher."""
    import sglang.srt.layers.deep_gemm_wrapper as deep_gemm_wrapper
    import sglang.srt.layers.moe.ep_moe.layer as ep_layer
    import sglang.srt.layers.moe.fused_moe_triton.layer as fused_layer

    with monkeypatch.context() as patch:
        patch.setattr(fused_layer, "create_moe_dispatcher", lambda config, quant_method: StandInDispatcher())
        if backend == "deepep":
            patch.setattr(deep_gemm_wrapper, "ENABLE_JIT_DEEPGEMM", True)
        else:
            patch.setattr(ep_layer, "_is_hip", True)
            patch.setenv("SGLANG_MORI_EP_V2", "1" if mori_epv2 else "0")
        yield


def build_experts():
    """K3's routed experts as KimiK3MoE builds them under the current flags (kimi_k3.py, SGLang 0.5.23)."""
    from sglang.srt.layers.moe.ep_moe.layer import get_moe_impl_class
    from sglang.srt.layers.quantization.mxfp4 import Mxfp4Config

    quant = Mxfp4Config(is_checkpoint_mxfp4_serialized=True)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        return get_moe_impl_class(quant)(
            num_experts=EXPERTS, top_k=TOP_K, hidden_size=LATENT, intermediate_size=LATENT, layer_id=LAYER,
            quant_config=quant, routed_scaling_factor=1.0, activation="situ", gemm1_alpha=4.0,
            gemm1_clamp_limit=25.0, gate_up_interleaved=False, params_dtype=torch.bfloat16,
            prefix=f"{MODEL_PREFIX}.{LAYER}.mlp.experts")
    finally:
        torch.set_default_dtype(previous)


def routing(gen):
    """Each DP rank's own tokens with K3-like routing (k distinct experts, fp32 weights)."""
    xs = [torch.randn(TOKENS_PER_RANK, LATENT, generator=gen).to(torch.bfloat16) for _ in range(EP)]
    ids = [torch.stack([torch.randperm(EXPERTS, generator=gen)[:TOP_K] for _ in range(TOKENS_PER_RANK)])
           for _ in range(EP)]
    weights = [torch.rand(TOKENS_PER_RANK, TOP_K, generator=gen) for _ in range(EP)]
    return xs, ids, weights


def serve_rank(path, rank):
    """One EP rank of `--tp 2 --dp 2 --ep 2 --enable-dp-attention --moe-a2a-backend <backend>`, loaded."""
    layer = build_experts()
    assert isinstance(layer.quant_method, K3RoutedExpertsMethod)
    assert (layer.moe_ep_rank, layer.num_local_experts) == (rank, EXPERTS // EP)
    holder = torch.nn.Module()
    holder.experts = layer
    load_into({LAYER: holder}, path, experts_only=True)
    return layer


CASES = [  # backend, --deepep-mode, MoRI EPv2, recv_cap, the class SGLang builds
    ("deepep", "normal", None, 0, "DeepEPMoE"),
    ("mori", "normal", True, 0, "FusedMoE"),
    ("mori", "low_latency", False, 0, "DeepEPMoE"),
    ("mori", "normal", False, 2 * TOKENS_PER_RANK + 2, "DeepEPMoE"),  # a row cap under the capacity
]


@pytest.mark.parametrize("backend,mode,epv2,recv_cap,layer_class", CASES)
def test_ep2_all_to_all_matches_the_float_reference(backend, mode, epv2, recv_cap, layer_class, k3_checkpoint,
                                                    sglang_plugins_loaded, monkeypatch, gen):
    path = k3_checkpoint
    xs, ids, weights = routing(gen)
    fabric = Fabric(xs, ids, weights, gen)
    outputs = {}
    for rank in range(EP):
        with (serving(path, tp_size=EP, ep_size=EP, rank=rank, dp_size=EP, enable_dp_attention=True),
              a2a_backend(backend, mode), gpu_reported(monkeypatch, backend, bool(epv2))):
            layer = serve_rank(path, rank)
            assert type(layer).__name__ == layer_class
            assert getattr(layer, "deprecate_flag", True)  # DeepEPMoE now calls the method's apply
            want_dtype = {"dispatcher_output_dtype": "bf16"} if backend == "deepep" else {}
            assert layer.dispatcher.quant_config == want_dtype  # bf16 dispatch asked for
            if backend == "deepep":
                layer.dispatcher.staged = fabric.deepep_normal(rank)
            else:
                layer.dispatcher.staged = fabric.mori(rank, mode == "low_latency", recv_cap)
            with torch.inference_mode(), tp_group_stand_in():
                layer(xs[rank], _topk(ids[rank], weights[rank]))
            combine_input = layer.dispatcher.combine_input
            want_kind = ("DeepEPNormalCombineInput" if backend == "deepep" else
                         "MoriEPLLCombineInput" if mode == "low_latency" else "MoriEPNormalCombineInput")
            assert type(combine_input).__name__ == want_kind
            outputs[rank] = combine_input.hidden_states
            assert torch.isfinite(outputs[rank]).all()
    combined = fabric.combine(outputs)
    x, all_ids, all_weights = torch.cat(xs), torch.cat(ids), torch.cat(weights)
    experts = reference_experts(path, LAYER).tensors()
    whole = moe_forward(x.double(), *experts, all_weights, all_ids, SITU, compute_dtype=torch.float64)
    assert relative_l2(combined, whole) <= 1e-2
    silu = moe_forward(x.double(), *experts, all_weights, all_ids, ActivationSpec.silu(), compute_dtype=torch.float64)
    assert relative_l2(combined, silu) > 5e-2


def _topk(ids, weights):
    from sglang.srt.layers.moe.topk import StandardTopKOutput

    return StandardTopKOutput(weights, ids.to(torch.int32), torch.zeros(ids.shape[0], EXPERTS))


@pytest.mark.parametrize("backend,mode,setting,says", [
    ("deepep", "low_latency", {}, "--deepep-mode low_latency: DeepEP's low-latency mode"),
    ("deepep", "auto", {}, "--deepep-mode auto"),
    ("deepep", "normal", {"deepep_dispatcher_output_dtype": "fp8"}, "--deepep-dispatcher-output-dtype fp8"),
    ("mori", "normal", {"SGLANG_MORI_DISPATCH_DTYPE": "fp8"}, "SGLANG_MORI_DISPATCH_DTYPE=fp8"),
    ("mooncake", "normal", {}, "--moe-a2a-backend mooncake moves tokens"),
    ("deepep_v2", "normal", {}, "--moe-a2a-backend deepep_v2 moves tokens"),
])
def test_unserved_a2a_settings_are_refused_in_one_line(backend, mode, setting, says, k3_checkpoint,
                                                       sglang_plugins_loaded, monkeypatch):
    from sglang.srt.runtime_context import get_exec

    exec_args = {k: v for k, v in setting.items() if not k.isupper()}
    for name, value in setting.items():
        if name.isupper():
            monkeypatch.setenv(name, value)
    with (serving(k3_checkpoint, tp_size=EP, ep_size=EP), a2a_backend(backend, mode),
          gpu_reported(monkeypatch, "deepep" if backend != "mori" else "mori"), get_exec().moe.override(**exec_args),
          pytest.raises(UnsupportedSGLangSetup, match=says) as refused):
        build_experts()
    assert "\n" not in str(refused.value)


def test_deepep_without_deepgemm_is_refused_in_one_line(k3_checkpoint, sglang_plugins_loaded):
    """Off a GPU (and on NVIDIA with DeepGEMM off) SGLang's DeepEP normal combine would raise NotImplementedError."""
    with (serving(k3_checkpoint, tp_size=EP, ep_size=EP), a2a_backend("deepep", "normal"),
          pytest.raises(UnsupportedSGLangSetup, match="DeepEP normal-mode combine runs only with DeepGEMM")):
        build_experts()


def test_quantised_tokens_from_the_all_to_all_are_refused(k3_checkpoint, sglang_plugins_loaded,
                                                          monkeypatch, gen):
    xs, ids, weights = routing(gen)
    with (serving(k3_checkpoint, tp_size=EP, ep_size=EP, dp_size=EP, enable_dp_attention=True),
          a2a_backend("deepep", "normal"), gpu_reported(monkeypatch, "deepep")):
        layer = serve_rank(k3_checkpoint, 0)
        staged = Fabric(xs, ids, weights, gen).deepep_normal(0)
        layer.dispatcher.staged = staged._replace(hidden_states_scale=torch.ones(staged.hidden_states.shape[0], 1))
        with torch.inference_mode(), tp_group_stand_in(), pytest.raises(UnsupportedSGLangSetup, match="bf16 tokens"):
            layer(xs[0], _topk(ids[0], weights[0]))
