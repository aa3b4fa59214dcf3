"""The plugin's vLLM method as a modular kernel (vLLM's `FusedMoEKernel`), single process.

Real: vLLM's K3 block, loader, runner, `FusedMoEKernel`, the prepare/finalize
vLLM picks for a no-DP config (`maybe_make_prepare_finalize`), its
`is_supported_config` check, `FusedMoEParallelConfig` for every all2all backend.
Stand-in (DeepEP and MoRI cannot run without their GPU libraries): `StandInAll2All`
below, a prepare/finalize that hands the experts exactly the layouts vLLM's
DeepEP high-throughput and MoRI prepare/finalize produce (read from
`prepare_finalize/deepep_ht.py` and `mori.py` of vllm 0.33.0): int64 global ids
with DeepEP's -1 rewritten to another rank's expert, and per-expert counts; a
MoRI capacity buffer with int32 global ids and the received-token count on the
device, garbage (NaN rows, ids of local experts) past it. Two EP ranks are
emulated in this process; the combine sums their outputs per source token.
vLLM 0.33's `FusedMoEConfig` asserts that a MoRI layer runs with AITER's fused
MoE enabled (VLLM_ROCM_USE_AITER=1, VLLM_ROCM_USE_AITER_MOE=1, ROCm only), so
the MoRI config here is built with that switch reported on.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch
from moe_helpers import SITU

from kimi_k3_moe.activation import ActivationSpec

SILU = ActivationSpec.silu()
TOKENS = 11
EP = 2


@pytest.fixture(scope="module")
def served(single_rank, k3_checkpoint):
    """(vllm config, block, our method, its RoutedExperts layer) for the single-rank K3 block."""
    import vllm_k3 as k3

    config = k3.make_vllm_config(k3_checkpoint)
    block = k3.build_block(config)
    k3.load_block(block, config, k3_checkpoint)
    k3.process_after_loading(block, config)
    layer = k3.routed_layer(block)
    return config, block, layer.quant_method, layer


def test_method_holds_vllms_modular_kernel(served):
    import vllm.model_executor.layers.fused_moe.modular_kernel as mk
    from vllm.model_executor.layers.fused_moe.prepare_finalize.no_dp_ep import MoEPrepareAndFinalizeNoDPEPModular

    from kimi_k3_moe.plugin_entrypoints._vllm_modular import K3ModularExperts

    _, block, method, layer = served
    assert isinstance(method.moe_kernel, mk.FusedMoEKernel) and not method.moe_kernel.is_monolithic
    assert isinstance(method.moe_kernel.prepare_finalize, MoEPrepareAndFinalizeNoDPEPModular)
    assert isinstance(method.moe_kernel.fused_experts, K3ModularExperts)
    assert method.supports_internal_mk and not method.is_monolithic
    quant = method.moe_quant_config  # tokens travel unquantized: no fp8/fp4 dispatch in DeepEP or MoRI
    assert quant.quant_dtype is None and not (quant.is_block_quantized or quant.is_per_act_token or quant.is_per_tensor)
    assert method.moe_quant_config.weight_quant_dtype == "mxfp4"
    # With a kernel, vLLM's runner never takes the legacy DP dispatch (dispatch_router_logits).
    assert not block.experts.do_naive_dispatch_combine
    ok, why = K3ModularExperts.is_supported_config(K3ModularExperts, method.moe, None, None,
                                                   mk.FusedMoEActivationFormat.Standard)
    assert ok, why
    silu = dataclasses.replace(method.moe, activation=type(method.moe.activation).SILU)
    assert not K3ModularExperts.is_supported_config(K3ModularExperts, silu, None, None,
                                                    mk.FusedMoEActivationFormat.Standard)[0]
    batched = K3ModularExperts.is_supported_config(K3ModularExperts, method.moe, None, None,
                                                   mk.FusedMoEActivationFormat.BatchedExperts)
    assert not batched[0] and "batched" in batched[1]


@pytest.mark.parametrize("id_dtype", [torch.int32, torch.int64])
def test_apply_through_the_kernel_matches_the_reference(served, k3_checkpoint, gen, id_dtype):
    import vllm_k3 as k3

    _, _, method, layer = served
    x = torch.randn(TOKENS, k3.LATENT, generator=gen).to(torch.bfloat16)
    ids = torch.stack([torch.randperm(k3.EXPERTS, generator=gen)[:2] for _ in range(TOKENS)]).to(id_dtype)
    weights = torch.rand(TOKENS, 2, generator=gen)
    out = method.apply(layer=layer, x=x, topk_weights=weights, topk_ids=ids, shared_experts=None,
                       shared_experts_input=None)
    assert out.dtype == x.dtype and out.shape == x.shape
    experts = k3.reference_experts(k3_checkpoint)
    assert k3.rel_l2(out, k3.routed_reference(experts, x, weights, ids, SITU)) <= 1e-2
    assert k3.rel_l2(out, k3.routed_reference(experts, x, weights, ids, SILU)) > 5e-2


# ---- DeepEP high-throughput and MoRI layouts, two EP ranks in one process -------------------
class Fabric:
    """The tokens of every source rank and what each destination rank sent back (the stand-in's wire)."""

    def __init__(self, tokens, weights, ids, num_experts: int, layout: str):
        self.tokens, self.weights, self.ids = tokens, weights, ids  # per source rank
        self.num_experts, self.layout = num_experts, layout
        self.local = num_experts // EP
        self.sent: dict[int, tuple[torch.Tensor, list[tuple[int, int]]]] = {}

    def received(self, dest: int):
        """What `dest` receives: (hidden, ids, weights, expert_tokens_meta, origin of each row)."""
        import vllm.model_executor.layers.fused_moe.modular_kernel as mk

        rows, origin = [], []
        for src, ids in enumerate(self.ids):
            for t in range(ids.shape[0]):
                if ((ids[t] // self.local) == dest).any():
                    rows.append((src, t))
        origin = rows
        x = torch.stack([self.tokens[s][t] for s, t in rows])
        w = torch.stack([self.weights[s][t] for s, t in rows]).float()
        g = torch.stack([self.ids[s][t] for s, t in rows]).long()
        offset = dest * self.local
        if self.layout == "deepep_ht":
            # DeepEP gives local ids with -1 elsewhere; vLLM's receiver makes them global again and
            # points -1 at an expert of another rank (deepep_ht.py, _receiver).
            local = torch.where((g // self.local) == dest, g - offset, torch.full_like(g, -1))
            ids = torch.where(local == -1, torch.full_like(g, self.num_experts - 1 if offset == 0 else 0),
                              local + offset)
            counts = [int((local == e).sum()) for e in range(self.local)]
            return x, ids.to(torch.int64), w, mk.ExpertTokensMetadata.make_from_list(counts, "cpu"), origin
        # MoRI: a capacity buffer; rows past the count hold garbage that must never be read.
        n, capacity = len(rows), len(rows) + 5
        buf = torch.full((capacity, x.shape[1]), float("nan"), dtype=x.dtype)
        buf[:n] = x
        ids = torch.full((capacity, g.shape[1]), offset, dtype=torch.int32)  # a local expert: would run if read
        ids[:n] = g.to(torch.int32)
        wb = torch.ones(capacity, g.shape[1])
        wb[:n] = w
        count = torch.tensor([n], dtype=torch.int32)
        return buf, ids, wb, mk.ExpertTokensMetadata(expert_num_tokens=count, expert_num_tokens_cpu=None), origin

    def combined(self, src: int) -> torch.Tensor:
        out = torch.zeros(self.tokens[src].shape, dtype=torch.float64)
        for dest_out, origin in self.sent.values():
            for row, (s, t) in enumerate(origin):
                if s == src:
                    out[t] += dest_out[row].double()
        return out


def stand_in_all2all(fabric: Fabric, dest: int, topk_dtype: torch.dtype):
    import vllm.model_executor.layers.fused_moe.modular_kernel as mk

    class StandInAll2All(mk.FusedMoEPrepareAndFinalizeModular):
        """Hands `dest` the layout its DeepEP-HT / MoRI prepare would (see the module docstring)."""

        activation_format = mk.FusedMoEActivationFormat.Standard

        def topk_indices_dtype(self):
            return topk_dtype

        def max_num_tokens_per_rank(self):
            return None

        def num_dispatchers(self):
            return EP

        def output_is_reduced(self):
            return True

        def prepare(self, a1, topk_weights, topk_ids, num_experts, expert_map, apply_router_weight_on_input,
                    quant_config, defer_input_quant=False):
            assert quant_config.quant_dtype is None  # bf16 dispatch
            x, ids, w, meta, self.origin = fabric.received(dest)
            return x, None, meta, ids, w

        def finalize(self, output, fused_expert_output, topk_weights, topk_ids, apply_router_weight_on_input,
                     weight_and_reduce_impl):
            out = weight_and_reduce_impl.apply(output=None, fused_expert_output=fused_expert_output,
                                               topk_weights=topk_weights, topk_ids=topk_ids,
                                               apply_router_weight_on_input=apply_router_weight_on_input)
            fabric.sent[dest] = (out.clone(), self.origin)
            self.tail = out[len(self.origin):].clone()
            output.zero_()  # the real combine fills it once every rank has sent

    return StandInAll2All()


def ep_parallel_config(backend: str, rank: int):
    from vllm.model_executor.layers.fused_moe.config import FusedMoEParallelConfig

    return FusedMoEParallelConfig(tp_size=1, pcp_size=1, dp_size=EP, ep_size=EP, tp_rank=0, pcp_rank=0, dp_rank=rank,
                                  ep_rank=rank, sp_size=1, use_ep=True, all2all_backend=backend, enable_eplb=False)


def as_on_rocm_with_aiter_moe(monkeypatch):
    from vllm._aiter_ops import rocm_aiter_ops

    monkeypatch.setattr(rocm_aiter_ops, "is_fused_moe_enabled", classmethod(lambda cls: True))


@pytest.mark.parametrize("backend", ["deepep_high_throughput", "mori_high_throughput"])
def test_all_to_all_layouts_sum_to_the_layer(served, k3_checkpoint, gen, backend, monkeypatch):
    import vllm.model_executor.layers.fused_moe.modular_kernel as mk
    import vllm_k3 as k3

    from kimi_k3_moe.dispatch import BackendChoice
    from kimi_k3_moe.platform import Platform
    from kimi_k3_moe.plugin_entrypoints._vllm_modular import K3ModularExperts, shape_carriers, weight_only_quant_config
    from kimi_k3_moe.routed_experts import RoutedExperts

    _, _, method, _ = served
    layout = "deepep_ht" if backend.startswith("deepep") else "mori"
    if layout == "mori":
        as_on_rocm_with_aiter_moe(monkeypatch)
    topk_dtype = torch.int64 if layout == "deepep_ht" else torch.int32
    experts = k3.reference_experts(k3_checkpoint)
    local = k3.EXPERTS // EP
    sizes = (7, 4)  # DP ranks' batches differ
    tokens = [torch.randn(n, k3.LATENT, generator=gen).to(torch.bfloat16) for n in sizes]
    ids = [torch.stack([torch.randperm(k3.EXPERTS, generator=gen)[:2] for _ in range(n)]) for n in sizes]
    weights = [torch.rand(n, 2, generator=gen) for n in sizes]
    fabric = Fabric(tokens, weights, ids, k3.EXPERTS, layout)
    tails = []
    for dest in range(EP):
        moe = dataclasses.replace(method.moe, moe_parallel_config=ep_parallel_config(backend, dest),
                                  num_local_experts=local)
        routed = RoutedExperts(SITU, platform=Platform("cpu"),
                               plan=[BackendChoice("torch", {"weight_format": "mxfp4"})])
        routed.load(experts.select(list(range(dest * local, (dest + 1) * local))))
        fused = K3ModularExperts(moe, weight_only_quant_config(), routed)
        assert fused.counts_valid_rows == (layout == "mori")
        assert K3ModularExperts.is_supported_config(K3ModularExperts, moe, None, None,
                                                    mk.FusedMoEActivationFormat.Standard)[0]
        stand_in = stand_in_all2all(fabric, dest, topk_dtype)
        kernel = mk.FusedMoEKernel(stand_in, fused)
        expert_map = torch.full((k3.EXPERTS,), -1, dtype=torch.int32)
        expert_map[dest * local:(dest + 1) * local] = torch.arange(local, dtype=torch.int32)
        w1, w2 = shape_carriers(local, k3.INTER, torch.device("cpu"))
        own = tokens[dest]
        kernel.apply(hidden_states=own, w1=w1, w2=w2, topk_weights=weights[dest], topk_ids=ids[dest].to(topk_dtype),
                     activation=method.moe.activation, global_num_experts=k3.EXPERTS, expert_map=expert_map,
                     apply_router_weight_on_input=False)
        tails.append(stand_in.tail)
    for src in range(EP):
        whole = fabric.combined(src)
        assert k3.rel_l2(whole, k3.routed_reference(experts, tokens[src], weights[src], ids[src], SITU)) <= 1e-2
        assert k3.rel_l2(whole, k3.routed_reference(experts, tokens[src], weights[src], ids[src], SILU)) > 5e-2
    if layout == "mori":  # the capacity rows past the count were never read: no NaN, no expert ran on them
        assert all(t.shape[0] == 5 and torch.isfinite(t).all() and not t.any() for t in tails)


# ---- formats and setups refused at load, in one line ---------------------------------------
@pytest.mark.parametrize("backend", ["deepep_low_latency", "nixl_ep", "moonep", "deepep_v2",
                                     "flashinfer_nvlink_one_sided", "flashinfer_nvlink_two_sided", "passthrough"])
def test_unserved_all2all_backends_refused_in_one_line(served, backend, monkeypatch):
    as_on_rocm_with_aiter_moe(monkeypatch)  # MoRI configs need it (module docstring)
    from vllm.config import set_current_vllm_config

    from kimi_k3_moe.plugin_entrypoints._vllm_method import K3RoutedExpertsMethod, UnsupportedVllmSetup

    config, _, method, _ = served
    moe = dataclasses.replace(method.moe, moe_parallel_config=ep_parallel_config(backend, 0))
    with set_current_vllm_config(config), pytest.raises(UnsupportedVllmSetup) as caught:
        K3RoutedExpertsMethod.for_moe(moe)
    message = str(caught.value)
    assert "\n" not in message and f"--all2all-backend {backend} is not supported" in message
    assert "deepep_high_throughput" in message  # what to use instead


@pytest.mark.parametrize("backend", ["allgather_reducescatter", "deepep_high_throughput", "mori_high_throughput",
                                     "mori_low_latency"])
def test_served_all2all_backends_accepted(served, backend, monkeypatch):
    as_on_rocm_with_aiter_moe(monkeypatch)  # MoRI configs need it (module docstring)
    from vllm.config import set_current_vllm_config

    from kimi_k3_moe.plugin_entrypoints._vllm_method import K3RoutedExpertsMethod

    config, _, method, _ = served
    moe = dataclasses.replace(method.moe, moe_parallel_config=ep_parallel_config(backend, 0))
    with set_current_vllm_config(config):
        assert isinstance(K3RoutedExpertsMethod.for_moe(moe), K3RoutedExpertsMethod)


def test_hidden_padding_for_deepep_refused(served, monkeypatch):
    """vLLM pads the hidden size for DeepEP-HT to whole 512-byte transfer atoms; deep_ep is not installed
    here, so its prepare/finalize class (which holds that rule) is stood in for by the same rule."""
    from vllm.model_executor.layers.fused_moe import all2all_utils

    from kimi_k3_moe.plugin_entrypoints._vllm_method import UnsupportedVllmSetup

    class DeepEPHTRule:
        @staticmethod
        def maybe_roundup_layer_hidden_size(hidden_size, dtype):
            atom = 512 // dtype.itemsize
            return -(-hidden_size // atom) * atom

    monkeypatch.setattr(all2all_utils, "DeepEPHTPrepareAndFinalize", DeepEPHTRule, raising=False)
    _, _, method, _ = served
    deepep = ep_parallel_config("deepep_high_throughput", 0)
    assert method.maybe_roundup_sizes(3584, 384, torch.bfloat16, deepep) == (3584, 384)  # Kimi-K3's latent size
    with pytest.raises(UnsupportedVllmSetup, match="pads the experts' hidden size 128 to 256"):
        method.maybe_roundup_sizes(128, 32, torch.bfloat16, deepep)


def test_dp_without_ep_refused_for_the_latent_tail_bug(served, monkeypatch):
    """DP > 1 without EP: refused (vLLM's LatentMoERunner tail bug, test_dp.py shows it), unless no batch can
    reach the faulty tail."""
    from vllm.config import set_current_vllm_config

    from kimi_k3_moe.plugin_entrypoints._vllm_method import K3RoutedExpertsMethod, UnsupportedVllmSetup

    config, _, method, _ = served
    parallel = dataclasses.replace(method.moe.moe_parallel_config, dp_size=2, tp_size=2, use_ep=False)
    moe = dataclasses.replace(method.moe, moe_parallel_config=parallel)
    with set_current_vllm_config(config), pytest.raises(UnsupportedVllmSetup) as caught:
        K3RoutedExpertsMethod.for_moe(moe)
    assert "\n" not in str(caught.value) and "_shard_up_proj_tail" in str(caught.value)
    assert "--enable-expert-parallel" in str(caught.value)
    # vLLM's CPU platform turns the shared-experts stream off (so every batch takes the faulty tail); on a GPU
    # it is on, and a threshold at max_num_batched_tokens keeps every batch on the correct tail.
    monkeypatch.setenv("VLLM_DISABLE_SHARED_EXPERTS_STREAM", "0")
    monkeypatch.setenv("VLLM_SHARED_EXPERTS_STREAM_TOKEN_THRESHOLD",
                       str(config.scheduler_config.max_num_batched_tokens))
    with set_current_vllm_config(config):
        K3RoutedExpertsMethod.for_moe(moe)
    with_ep = dataclasses.replace(parallel, use_ep=True, tp_size=1, ep_size=2)
    monkeypatch.delenv("VLLM_SHARED_EXPERTS_STREAM_TOKEN_THRESHOLD")
    with set_current_vllm_config(config):
        K3RoutedExpertsMethod.for_moe(dataclasses.replace(method.moe, moe_parallel_config=with_ep))
