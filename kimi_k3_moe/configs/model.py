"""Everything the routed-expert MoE needs from a Kimi-K3 HF config."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kimi_k3_moe.activation import ActivationSpec
from kimi_k3_moe.configs.hf_dict import ConfigError, load_config_dict, lookup, text_config
from kimi_k3_moe.formats import mxfp4

SUPPORTED_QUANT_FORMATS = ("mxfp4-pack-quantized",)


@dataclass(frozen=True)
class QuantizationInfo:
    quant_method: str
    format: str
    num_bits: int
    group_size: int
    ignore: tuple[str, ...] = ()

    @classmethod
    def from_dict(cls, q: dict[str, Any]) -> QuantizationInfo:
        method = q.get("quant_method")
        quant_format = q.get("format")
        if quant_format not in SUPPORTED_QUANT_FORMATS:
            raise ConfigError(f"quantization_config.format {quant_format!r} is not supported; "
                              f"expected one of {SUPPORTED_QUANT_FORMATS}")
        weights = [g.get("weights") or {} for g in (q.get("config_groups") or {}).values()]
        bits = {w.get("num_bits") for w in weights if w} or {4}
        groups = {w.get("group_size") for w in weights if w} or {mxfp4.BLOCK_SIZE}
        if bits != {4} or groups != {mxfp4.BLOCK_SIZE}:
            raise ConfigError(f"quantization_config: expected 4-bit weights in groups of "
                              f"{mxfp4.BLOCK_SIZE}, found num_bits {sorted(bits)} and "
                              f"group_size {sorted(groups)}")
        return cls(method, quant_format, 4, mxfp4.BLOCK_SIZE, tuple(q.get("ignore") or ()))


@dataclass(frozen=True)
class RouterConfig:
    scoring_func: str
    topk_method: str
    use_grouped_topk: bool
    num_expert_group: int
    topk_group: int
    renormalize: bool
    routed_scaling_factor: float


@dataclass(frozen=True)
class K3MoEConfig:
    """The MoE-relevant fields of a Kimi-K3 (or kimi_linear) config."""

    hidden_size: int
    routed_expert_hidden_size: int  # the latent width the experts run at
    moe_intermediate_size: int
    num_experts: int
    num_experts_per_token: int
    num_shared_experts: int
    num_hidden_layers: int
    first_k_dense_replace: int
    moe_layer_freq: int
    router: RouterConfig
    activation: ActivationSpec
    quantization: QuantizationInfo | None
    model_type: str = ""
    rms_norm_eps: float = 1e-6
    raw: dict = field(default_factory=dict, repr=False, compare=False)

    @classmethod
    def from_hf_config(cls, config: Any) -> K3MoEConfig:
        top = load_config_dict(config)
        text = text_config(top)

        def need(key: str, kind=int):
            value = lookup(text, key, top)
            if value is None:
                raise ConfigError(f"HF config has no {key!r} (looked in text_config and top level)")
            if kind is int and (isinstance(value, bool) or not isinstance(value, int) or value <= 0):
                raise ConfigError(f"HF config field {key!r} must be a positive integer, got {value!r}")
            return value

        def opt(key: str, default):
            value = lookup(text, key, top)
            return default if value is None else value

        def opt_num(key: str, default, kind=int, minimum=0):
            value = opt(key, default)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or \
                    (kind is int and not isinstance(value, int)) or not minimum <= value < float("inf"):
                raise ConfigError(f"HF config field {key!r} must be {'an integer' if kind is int else 'a number'}"
                                  f" >= {minimum}, got {value!r}")
            return kind(value)

        hidden = need("hidden_size")
        routed_hidden = opt("routed_expert_hidden_size", hidden)
        inter = need("moe_intermediate_size")
        experts = need("num_experts")
        top_k = need("num_experts_per_token")
        if top_k > experts:
            raise ConfigError(f"num_experts_per_token {top_k} exceeds num_experts {experts}")
        for key, value in (("routed_expert_hidden_size", routed_hidden), ("moe_intermediate_size", inter)):
            if value % mxfp4.BLOCK_SIZE:
                raise ConfigError(f"{key} {value} is not a multiple of the MXFP4 block {mxfp4.BLOCK_SIZE}")
        router = RouterConfig(
            scoring_func=opt("moe_router_activation_func", "sigmoid"),
            topk_method=opt("topk_method", "noaux_tc"),
            use_grouped_topk=bool(opt("use_grouped_topk", False)),
            num_expert_group=opt_num("num_expert_group", 1, minimum=1),
            topk_group=opt_num("topk_group", 1, minimum=1),
            renormalize=bool(opt("moe_renormalize", True)),
            routed_scaling_factor=opt_num("routed_scaling_factor", 1.0, float),
        )
        if router.scoring_func != "sigmoid":
            raise ConfigError(f"moe_router_activation_func {router.scoring_func!r} is not supported "
                              "(Kimi-K3 routes with 'sigmoid')")
        if experts % router.num_expert_group:
            raise ConfigError(f"num_expert_group {router.num_expert_group} does not divide "
                              f"num_experts {experts}")
        quant = lookup(top, "quantization_config", text)
        return cls(
            hidden_size=hidden,
            routed_expert_hidden_size=routed_hidden,
            moe_intermediate_size=inter,
            num_experts=experts,
            num_experts_per_token=top_k,
            num_shared_experts=opt_num("num_shared_experts", 0),
            num_hidden_layers=need("num_hidden_layers"),
            first_k_dense_replace=opt_num("first_k_dense_replace", 0),
            moe_layer_freq=opt_num("moe_layer_freq", 1, minimum=1),
            router=router,
            activation=ActivationSpec.from_hf_config(top),
            quantization=None if quant is None else QuantizationInfo.from_dict(quant),
            model_type=str(top.get("model_type", "")),
            rms_norm_eps=opt_num("rms_norm_eps", 1e-6, float),
            raw=top,
        )

    def moe_layers(self) -> list[int]:
        return [i for i in range(self.first_k_dense_replace, self.num_hidden_layers)
                if (i - self.first_k_dense_replace) % self.moe_layer_freq == 0]

    def require_moe_layers(self) -> list[int]:
        """`moe_layers()`, or ConfigError when there are none (nothing for this package to serve)."""
        layers = self.moe_layers()
        if not layers:
            raise ConfigError(f"no MoE layers: first_k_dense_replace {self.first_k_dense_replace} >= "
                              f"num_hidden_layers {self.num_hidden_layers}, so every layer is dense")
        return layers

    def intermediate_per_rank(self, tp_size: int) -> int:
        if tp_size < 1 or self.moe_intermediate_size % tp_size:
            raise ConfigError(f"tensor parallel size {tp_size} does not divide "
                              f"moe_intermediate_size {self.moe_intermediate_size}")
        per_rank = self.moe_intermediate_size // tp_size
        if per_rank % mxfp4.BLOCK_SIZE:
            raise ConfigError(f"intermediate size per rank {per_rank} (TP {tp_size}) is not a "
                              f"multiple of the MXFP4 block {mxfp4.BLOCK_SIZE}")
        return per_rank

    def expert_bytes(self, tp_size: int = 1) -> int:
        """MXFP4 bytes of one expert on one rank (codes and scales)."""
        h, i = self.routed_expert_hidden_size, self.intermediate_per_rank(tp_size)
        codes = 3 * h * i // 2
        return codes + codes * 2 // mxfp4.BLOCK_SIZE

    def routed_expert_bytes(self, tp_size: int = 1) -> int:
        """MXFP4 bytes of all routed experts of the model on one rank."""
        return len(self.moe_layers()) * self.num_experts * self.expert_bytes(tp_size)
