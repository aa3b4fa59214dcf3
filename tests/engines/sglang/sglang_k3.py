"""Builds SGLang's real Kimi-K3 MoE pieces on a CPU box, for the SGLang suite.

What is real here: SGLang's `KimiK3MoE` block and `FusedMoE`, its
compressed-tensors and `Mxfp4Config` configs, its `ModelConfig` read from our
synthetic checkpoint, K3's `load_weights` name pipeline and
`FusedMoE.weight_loader`, `DefaultModelLoader.postprocess_weights`, `TopK`, the
standard dispatcher, and the plugin hook installed by SGLang's own loader.

What stands in, and why (each stand-in says so in its docstring):
- the server's topology comes from `sglang.test.test_utils.published_topology`
  (SGLang's own test helper; a real server publishes it while launching);
- `TextModelHoldingMoE` / `ModelHoldingText` replace the full K3 model, whose
  attention layers are not needed and whose `post_load_weights` walks them;
- `tp_group_stand_in` and `cpu_device_for_ep_dispatch` (see their docstrings).
"""
from __future__ import annotations

import contextlib
import json
import types
from pathlib import Path

import torch
from safetensors import safe_open

MODEL_PREFIX = "model.layers"

# A scaled-down Kimi-K3: latent MoE (hidden 256 -> experts at 128), 16 experts,
# top-4, I = 128 so that TP 2 and 4 leave per-rank slices of 64 and 32.
SHAPE = dict(num_layers=3, hidden_size=256, routed_expert_hidden_size=128, moe_intermediate_size=128,
             num_experts=16, num_experts_per_token=4, num_shared_experts=1, first_k_dense_replace=1)
MOE_LAYERS = (1, 2)
LATENT, INTER, EXPERTS = SHAPE["routed_expert_hidden_size"], SHAPE["moe_intermediate_size"], SHAPE["num_experts"]


def reference_experts(checkpoint: Path, layer: int, **slicing):
    """The layer's experts read by our own checkpoint reader, independent of SGLang's loader."""
    from kimi_k3_moe.weights.checkpoint import read_layer_experts

    return read_layer_experts(checkpoint, layer, hidden_size=LATENT, intermediate_size=INTER,
                              num_experts=EXPERTS, **slicing)

# ModelConfig derives attention shapes from these; make_checkpoint writes only
# the MoE fields, so the suite adds small MLA dimensions to its config.json.
ATTENTION_FIELDS = dict(num_attention_heads=2, num_key_value_heads=2, q_lora_rank=None, kv_lora_rank=64,
                        qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32, max_position_embeddings=512)


def add_attention_fields(path: Path) -> dict:
    config = config_of(path)
    config["text_config"].update(ATTENTION_FIELDS)
    (path / "config.json").write_text(json.dumps(config, indent=2))
    return config


def config_of(path: Path) -> dict:
    return json.loads((path / "config.json").read_text())


@contextlib.contextmanager
def serving(checkpoint: Path, *, tp_size: int = 1, ep_size: int = 1, rank: int = 0, **server_args):
    """SGLang's process state for one TP/EP rank of a server loading `checkpoint`.

    `published_topology` publishes ServerArgs(model_path="dummy"); publishing a
    real model path runs SGLang's device resolution, which needs an
    accelerator. The ModelConfig is therefore built from the checkpoint by
    SGLang's own class and handed to `model_config_of`'s memo (the slot it
    documents for fixtures), so `process_model_config()` returns it as in a server.
    """
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.test.test_utils import published_topology

    with published_topology(tp_size=tp_size, ep_size=ep_size, ranks=dict(world_rank=rank), **server_args) as args:
        args._model_config = ModelConfig(str(checkpoint))
        yield args


def text_config():
    from sglang.srt.runtime_context import process_model_config

    return process_model_config().hf_config.text_config


def quant_config(config_dict: dict):
    """The compressed-tensors config SGLang builds from the checkpoint's quantization_config."""
    from sglang.srt.layers.quantization.compressed_tensors.compressed_tensors import CompressedTensorsConfig

    return CompressedTensorsConfig.from_config(config_dict["quantization_config"])


def build_block(config_dict: dict, layer: int):
    """SGLang's real KimiK3MoE for `layer`, as the model builds it (params in bf16)."""
    from sglang.srt.models.kimi_k3 import KimiK3MoE

    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)  # the loader builds models under model_config.dtype
    try:
        return KimiK3MoE(text_config(), quant_config=quant_config(config_dict),
                         prefix=f"{MODEL_PREFIX}.{layer}.mlp", layer_idx=layer)
    finally:
        torch.set_default_dtype(previous)


def build_fused_moe(*, activation="situ", beta=4.0, linear_beta=25.0, quant=None, num_experts=16,
                    hidden=128, inter=128, top_k=4, routed_scaling_factor=1.0, layer=1):
    """A FusedMoE built with the arguments KimiK3MoE passes (kimi_k3.py, SGLang 0.5.23)."""
    from sglang.srt.layers.moe.fused_moe_triton import FusedMoE
    from sglang.srt.layers.quantization.mxfp4 import Mxfp4Config

    return FusedMoE(num_experts=num_experts, top_k=top_k, hidden_size=hidden, intermediate_size=inter,
                    layer_id=layer, quant_config=quant or Mxfp4Config(is_checkpoint_mxfp4_serialized=True),
                    routed_scaling_factor=routed_scaling_factor, activation=activation,
                    gemm1_alpha=beta, gemm1_clamp_limit=linear_beta, gate_up_interleaved=False,
                    params_dtype=torch.bfloat16, prefix=f"{MODEL_PREFIX}.{layer}.mlp.experts")


def checkpoint_tensors(checkpoint: Path, layers, experts_only: bool = False):
    """(name, tensor) of the given layers, in file order, as SGLang's safetensors iterator yields them."""
    wanted = tuple(f".layers.{layer}." for layer in layers)
    for shard in sorted(checkpoint.glob("*.safetensors")):
        with safe_open(shard, framework="pt") as f:
            for name in f.keys():
                if any(tag in name for tag in wanted) and (".experts." in name or not experts_only):
                    yield name, f.get_tensor(name)


def load_into(blocks: dict[int, torch.nn.Module], checkpoint: Path, experts_only: bool = False) -> torch.nn.Module:
    """Run K3's real load_weights over the checkpoint, then SGLang's post-load step.

    Only the blocks' layers are streamed (the model here holds no others), and
    only the routed experts' tensors when the blocks hold nothing else.
    """
    from sglang.srt.model_loader.loader import DefaultModelLoader
    from sglang.srt.models.kimi_k3 import KimiK3ForConditionalGeneration

    model = ModelHoldingText(TextModelHoldingMoE(text_config(), blocks))
    KimiK3ForConditionalGeneration.load_weights(model, checkpoint_tensors(checkpoint, blocks, experts_only))
    DefaultModelLoader.postprocess_weights(model, torch.device("cpu"))
    return model


class TextModelHoldingMoE(torch.nn.Module):
    """Stands in for KimiK3LinearForCausalLM with only its MoE layers built.

    `load_weights` is K3's real function; the layers list holds the real
    KimiK3MoE blocks where the model would. The real `post_load_weights`
    absorbs MLA attention weights, which this model does not build, so it is
    a no-op here (its MoE-related part returns early off CUDA/HIP anyway).
    """

    def __init__(self, config, blocks: dict[int, torch.nn.Module]):
        super().__init__()
        self.config = config
        self.model = torch.nn.Module()
        self.model.start_layer, self.model.end_layer = 0, config.num_hidden_layers
        layers = [torch.nn.Module() for _ in range(config.num_hidden_layers)]
        for index, block in blocks.items():
            layers[index].mlp = block
        self.model.layers = torch.nn.ModuleList(layers)

    def load_weights(self, weights):
        from sglang.srt.models.kimi_k3 import KimiK3LinearForCausalLM

        return KimiK3LinearForCausalLM.load_weights(self, weights)

    def post_load_weights(self):
        pass


class ModelHoldingText(torch.nn.Module):
    """Stands in for KimiK3ForConditionalGeneration without its vision tower (language_only)."""

    def __init__(self, language_model: torch.nn.Module):
        from sglang.srt.models.kimi_k3 import KimiK3ForConditionalGeneration

        super().__init__()
        self.hf_to_sglang_mapper = KimiK3ForConditionalGeneration.hf_to_sglang_mapper
        self.config = types.SimpleNamespace(language_only=True)
        self.language_model = language_model


@contextlib.contextmanager
def tp_group_stand_in():
    """FusedMoE.forward reads get_parallel().tp_group to decide on symmetric memory.

    No torch.distributed group exists on this box; SGLang validates that the
    stand-in's world_size equals the published tp_size, and nothing else of it
    is used on the CPU path (K3 skips its all-reduce when tp_size is 1; under
    TP>1 the tests sum the ranks' partial outputs themselves).
    """
    from sglang.srt.runtime_context import get_parallel

    parallel = get_parallel()
    with parallel.override(tp_group=types.SimpleNamespace(world_size=parallel.tp_size)):
        yield


@contextlib.contextmanager
def cpu_device_for_ep_dispatch():
    """StandardDispatcher.dispatch (EP > 1) asks get_device() where to build its
    global-to-local id map; without an accelerator that raises, so it gets "cpu"."""
    import sglang.srt.layers.moe.token_dispatcher.standard as standard

    original = standard.get_device
    standard.get_device = lambda *args, **kwargs: "cpu"
    try:
        yield
    finally:
        standard.get_device = original


def k3_topk(block, hidden: torch.Tensor):
    """The block's own router: gate (fp32 logits) and SGLang's TopK."""
    logits = block.gate(hidden)
    return block.topk(hidden, logits)
