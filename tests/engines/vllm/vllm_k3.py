"""Builds vLLM's real Kimi-K3 MoE block on a CPU box, for the vLLM suite.

What is real here: vLLM's `ModelConfig` / `VllmConfig` read from our synthetic
checkpoint's config.json (so the quantization config is the one vLLM resolves
for it); K3's `KimiMoE` block in both variants vLLM has (`models/kimi_k3/nvidia`
with `LatentMoERunner`, which vLLM uses on CUDA and the CPU, and
`models/kimi_k3/amd` with `ROCmLatentMoERunner`, which it uses on ROCm), built
through `FusedMoEFactory` with its router and shared experts; K3's
`KimiLinearModel.load_weights` and `RoutedExperts.weight_loader` fed by vLLM's
own safetensors iterator; `set_forward_context`; torch.distributed (gloo) for
the TP/EP groups.

What stands in, and why:
- `Holder` replaces `KimiLinearModel`: the full model's attention layers need
  vLLM's compiled CPU/CUDA ops, which this wheel does not ship for the CPU
  (`vllm._C` is missing). `KimiLinearModel.load_weights` is called unbound on
  it with the names `KimiK3ForConditionalGeneration`'s weight mapper would
  hand over (the `language_model.model.` prefix stripped).
- `torch.cpu._is_amx_tile_supported` reports no AMX (see below).
- `process_after_loading` runs each layer's `process_weights_after_loading`
  as vLLM's loader does; vLLM's helper of that name first re-ties the word
  embeddings of a full model, which the holder does not have.
"""
from __future__ import annotations

import contextlib
import socket
from pathlib import Path

import torch

# On a CPU with AMX, vLLM's CPU linear layers pack their weights with `vllm._C`'s
# convert_weight_packed, which the CUDA wheel installed here does not ship (CI machines with
# and without AMX both occur). Reporting no AMX sends them down vLLM's torch path. Only the
# block's dense layers (router, shared experts, latent projections) take it: the routed
# experts run our method. Set here, at import, so spawned ranks get it too.
torch.cpu._is_amx_tile_supported = lambda: False

CHECKPOINT_PREFIX = "language_model.model."
LAYER = 1
# A scaled-down Kimi-K3: latent MoE (hidden 256 -> experts at 128), 8 experts,
# top-2, I = 64: at TP 2 each rank's 32 are padded by K3 to 256.
SHAPE = dict(num_layers=2, hidden_size=256, routed_expert_hidden_size=128, moe_intermediate_size=64,
             num_experts=8, num_experts_per_token=2, num_shared_experts=1, first_k_dense_replace=1)
HIDDEN, LATENT, INTER, EXPERTS = (SHAPE["hidden_size"], SHAPE["routed_expert_hidden_size"],
                                  SHAPE["moe_intermediate_size"], SHAPE["num_experts"])


def write_checkpoint(path: Path, seed: int, **options) -> Path:
    from kimi_k3_moe.weights.synthetic import make_checkpoint

    return make_checkpoint(path, seed=seed, **{**SHAPE, **options})


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def make_vllm_config(checkpoint: Path, *, tp: int = 1, ep: bool = False):
    """vLLM's config for serving `checkpoint` (config.json only is read), as `vllm serve` builds it."""
    from vllm.config import CacheConfig, ModelConfig, ParallelConfig, VllmConfig

    model = ModelConfig(model=str(checkpoint), dtype="bfloat16", max_model_len=512, enforce_eager=True,
                        skip_tokenizer_init=True, limit_mm_per_prompt={"image": 0})
    # The CPU platform turns prefix caching off for MLA models after the hybrid
    # model hook set a mamba block size; saying so up front keeps the config valid.
    return VllmConfig(model_config=model, cache_config=CacheConfig(enable_prefix_caching=False),
                      parallel_config=ParallelConfig(tensor_parallel_size=tp, enable_expert_parallel=ep))


def init_distributed(vllm_config, world: int, rank: int, port: int) -> None:
    from vllm.config import set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel

    with set_current_vllm_config(vllm_config):
        init_distributed_environment(world_size=world, rank=rank, local_rank=rank,
                                     distributed_init_method=f"tcp://127.0.0.1:{port}", backend="gloo")
        initialize_model_parallel(tensor_model_parallel_size=world)


@contextlib.contextmanager
def bf16_default():
    # vLLM's model loader builds models under the model dtype.
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


PREFIX = f"language_model.model.layers.{LAYER}.block_sparse_moe"
# vLLM builds K3 from `models/kimi_k3/amd` on ROCm and from `nvidia` on CUDA (and the CPU).
VARIANTS = ("nvidia", "amd")


def build_block(vllm_config, text_config=None, variant: str = "nvidia", use_sequence_parallel: bool = False):
    """K3's MoE block for `vllm_config`'s model (or `text_config`, to build a mismatching layer).

    `use_sequence_parallel`: what K3's decoder layer passes under DP x TP with EP (each TP rank's MoE
    input is its slice of the DP rank's tokens)."""
    from vllm.config import set_current_vllm_config

    config = text_config if text_config is not None else vllm_config.model_config.hf_text_config
    quant_config = vllm_config.quant_config
    with set_current_vllm_config(vllm_config), bf16_default():
        if variant == "amd":
            from vllm.models.kimi_k3.amd.linear import KimiMoE

            return KimiMoE(config, quant_config=quant_config, prefix=PREFIX, layer_idx=LAYER)
        from vllm.models.kimi_k3.nvidia.model import KimiMoE

        return KimiMoE(config, vllm_config, quant_config=quant_config, prefix=PREFIX, layer_idx=LAYER,
                       use_sequence_parallel=use_sequence_parallel)


class Holder(torch.nn.Module):
    """Stands in for KimiLinearModel (module docstring): `layers.<L>.block_sparse_moe` and `config`."""

    def __init__(self, block, config):
        super().__init__()
        self.config = config
        self.layers = torch.nn.ModuleDict({str(LAYER): torch.nn.ModuleDict({"block_sparse_moe": block})})


def load_block(block, vllm_config, checkpoint: Path, variant: str = "nvidia") -> set[str]:
    """vLLM's own loading of `checkpoint` into `block`; returns the parameter names it filled."""
    import importlib

    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader.weight_utils import safetensors_weights_iterator

    module = {"nvidia": "vllm.models.kimi_k3.nvidia.model", "amd": "vllm.models.kimi_k3.amd.linear"}[variant]
    KimiLinearModel = importlib.import_module(module).KimiLinearModel
    holder = Holder(block, vllm_config.model_config.hf_text_config)
    files = sorted(str(p) for p in Path(checkpoint).glob("*.safetensors"))
    weights = ((name[len(CHECKPOINT_PREFIX):], tensor)
               for name, tensor in safetensors_weights_iterator(files, use_tqdm_on_load=False)
               if name.startswith(CHECKPOINT_PREFIX))
    with set_current_vllm_config(vllm_config):
        loaded = KimiLinearModel.load_weights(holder, weights)
    unfilled = {n for n, _ in holder.named_parameters()} - loaded
    assert not unfilled, f"parameters vLLM's loader did not fill: {sorted(unfilled)}"
    return loaded


def process_after_loading(block, vllm_config) -> None:
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.layers.quantization.base_config import QuantizeMethodBase

    with set_current_vllm_config(vllm_config):
        for module in block.modules():
            method = getattr(module, "quant_method", None)
            if isinstance(method, QuantizeMethodBase):
                method.process_weights_after_loading(module)


def routed_layer(block):
    """vLLM's RoutedExperts of the block (the parameters' owner; `quant_method` is ours)."""
    return block.experts.routed_experts


class ApplyRecorder:
    """Wraps the method's apply to keep what vLLM's runner passed and got back."""

    def __init__(self, method):
        self.calls = []
        inner = method.apply

        def apply(layer, x, topk_weights, topk_ids, shared_experts, shared_experts_input):
            out = inner(layer=layer, x=x, topk_weights=topk_weights, topk_ids=topk_ids,
                        shared_experts=shared_experts, shared_experts_input=shared_experts_input)
            self.calls.append(dict(x=x.clone(), topk_weights=topk_weights.clone(), topk_ids=topk_ids.clone(),
                                   expert_map=None if layer.expert_map is None else layer.expert_map.clone(),
                                   out=out.clone()))
            return out

        method.apply = apply


def forward(block, vllm_config, x: torch.Tensor) -> torch.Tensor:
    from vllm.forward_context import set_forward_context

    with torch.no_grad(), set_forward_context(None, vllm_config):
        return block(x)


# ---- the float64 truth ------------------------------------------------------------------------
def checkpoint_tensors(checkpoint: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    out = {}
    for f in sorted(Path(checkpoint).glob("*.safetensors")):
        out.update(load_file(f))
    return out


def reference_experts(checkpoint: Path, **slicing):
    """The layer's experts read by our own checkpoint reader, independent of vLLM's loader."""
    from kimi_k3_moe.weights.checkpoint import read_layer_experts

    return read_layer_experts(checkpoint, LAYER, hidden_size=LATENT, intermediate_size=INTER,
                              num_experts=EXPERTS, **slicing)


def routed_reference(experts, x, topk_weights, topk_ids, activation, expert_map=None) -> torch.Tensor:
    """Our float64 reference of the routed experts on the inputs vLLM's runner produced."""
    from kimi_k3_moe.reference import dense_moe

    return dense_moe(x.double(), lambda e: experts.dequantize(e)[0].double(),
                     lambda e: experts.dequantize(e)[1].double(), topk_weights, topk_ids, activation,
                     expert_map, compute_dtype=torch.float64).double()


# Selection-score gap within which vLLM's router and the float64 one may pick different
# experts: a pair 2e-4 apart was picked differently on CPU (test seed 864151496); vLLM's
# router arithmetic is its own and not mirrored here. Wider gaps must agree.
ROUTING_TIE = 5e-3


def engine_routing_checked(selection: torch.Tensor, engine_ids: torch.Tensor, k: int) -> torch.Tensor:
    """The engine's expert ids, after checking that each token's set differs from the float64
    top-k only by experts whose selection score ties the k-th best within ROUTING_TIE."""
    ours = selection.topk(k, -1).indices
    for row in range(selection.shape[0]):
        differ = set(ours[row].tolist()) ^ set(engine_ids[row].tolist())
        kth = selection[row].sort(descending=True).values[k - 1]
        for e in differ:
            gap = abs(float(selection[row, e] - kth))
            assert gap <= ROUTING_TIE, (f"token {row}: the engine's experts {sorted(engine_ids[row].tolist())} "
                                        f"differ from float64's {sorted(ours[row].tolist())} at expert {e}, "
                                        f"{gap:.3g} from the k-th selection score (tie bound {ROUTING_TIE})")
    return engine_ids.long()


def block_reference(checkpoint: Path, x: torch.Tensor, routed_activation, shared_activation, eps: float,
                    engine_ids: torch.Tensor | None = None):
    """The whole K3 MoE block in float64: router, latent down-projection, routed experts
    (our reference), RMSNorm, up-projection, plus the shared experts. With `engine_ids` (the
    experts vLLM's router picked) those are used where they differ from ours at a near-tie."""
    routed, shared = block_reference_parts(checkpoint, x, routed_activation, shared_activation, eps, engine_ids)
    return routed + shared


def block_reference_parts(checkpoint: Path, x: torch.Tensor, routed_activation, shared_activation, eps: float,
                          engine_ids: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """`block_reference`'s two terms: (routed output after the up-projection, shared experts' output)."""
    t = checkpoint_tensors(checkpoint)
    p = f"{CHECKPOINT_PREFIX}layers.{LAYER}.block_sparse_moe."
    xd = x.double()
    # The gate runs in fp32 (GateLinear out_dtype) in vLLM, so the logits are fp32 and the
    # rest float64.
    logits = (x.float() @ t[p + "gate.weight"].float().T).double()
    scores = logits.sigmoid()
    selection = scores + t[p + "gate.e_score_correction_bias"].double()
    k = SHAPE["num_experts_per_token"]
    ids = selection.topk(k, -1).indices if engine_ids is None else engine_routing_checked(selection, engine_ids, k)
    weights = scores.gather(1, ids)
    weights = weights / weights.sum(-1, keepdim=True)
    latent = xd @ t[p + "routed_expert_down_proj.weight"].double().T
    routed = routed_reference(reference_experts(checkpoint), latent, weights, ids.to(torch.int32), routed_activation)
    routed = (routed * torch.rsqrt(routed.pow(2).mean(-1, keepdim=True) + eps)
              * t[p + "routed_expert_norm.weight"].double())
    routed = routed @ t[p + "routed_expert_up_proj.weight"].double().T
    gate_up = torch.cat([xd @ t[p + "shared_experts.gate_proj.weight"].double().T,
                         xd @ t[p + "shared_experts.up_proj.weight"].double().T], -1)
    shared = shared_activation.apply(gate_up) @ t[p + "shared_experts.down_proj.weight"].double().T
    return routed, shared


def rel_l2(actual: torch.Tensor, expected: torch.Tensor) -> float:
    from kimi_k3_moe.reference import relative_l2

    return relative_l2(actual, expected)


# ---- two ranks ----------------------------------------------------------------------------------
def two_rank_tokens(seed: int) -> torch.Tensor:
    return torch.randn(6, HIDDEN, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)


def two_rank_worker(rank: int, port: int, checkpoint: str, out_dir: str, seed: int) -> None:
    """One rank of a TP 2 and an EP 2 block (spawned); writes rank<r>.pt, or rank<r>.err on failure.

    Results go through files: tensors sent back through a multiprocessing queue
    share memory with a process that is about to exit.
    """
    import copy
    import traceback

    try:
        import vllm.plugins

        vllm.plugins.load_general_plugins()
        checkpoint_path = Path(checkpoint)
        configs = {"tp": make_vllm_config(checkpoint_path, tp=2),
                   "ep": make_vllm_config(checkpoint_path, tp=2, ep=True),
                   "amd-tp": make_vllm_config(checkpoint_path, tp=2)}
        init_distributed(configs["tp"], world=2, rank=rank, port=port)
        x = two_rank_tokens(seed)
        result: dict = {"eps": configs["tp"].model_config.hf_text_config.rms_norm_eps}
        for mode, config in configs.items():
            variant, text = "nvidia", None
            if mode == "amd-tp":
                # vLLM 0.33's amd KimiMoE fails whenever it pads I (it looks for
                # `w13_weight_packed` on the runner): keep the tiny model unpadded.
                variant, text = "amd", copy.deepcopy(config.model_config.hf_text_config)
                text.min_moe_intermediate_per_partition = INTER // 2
            block = build_block(config, text, variant)
            load_block(block, config, checkpoint_path, variant)
            layer = routed_layer(block)
            loaded = [t.data.clone() for t in (layer.w13_weight, layer.w13_weight_scale, layer.w2_weight,
                                               layer.w2_weight_scale)]
            process_after_loading(block, config)
            recorder = ApplyRecorder(layer.quant_method)
            out = forward(block, config, x)
            moe = layer.quant_method.moe
            result[mode] = dict(out=out, call=recorder.calls[0], loaded=loaded, local_experts=layer.local_num_experts,
                                intermediate_per_partition=moe.intermediate_size_per_partition,
                                unpadded=moe.intermediate_size_per_partition_unpadded,
                                prepared_intermediate=layer.quant_method.routed.prepared.intermediate_size,
                                released=layer.w13_weight.numel() == 0)
        torch.save(result, Path(out_dir) / f"rank{rank}.pt")
    except BaseException:
        (Path(out_dir) / f"rank{rank}.err").write_text(f"rank {rank}:\n{traceback.format_exc()}")
        raise
