"""Per-rank MoE shapes: the named Kimi-K3 ones, `H,I,E,K`, or read from a model's config."""
from __future__ import annotations

from dataclasses import asdict, dataclass

K3_TOPK = 16


@dataclass(frozen=True)
class Shape:
    """One rank's routed-expert layer. `local_experts` < `num_experts`: expert parallel, this
    rank holding experts [0, local_experts) of `num_experts` (routing runs over all of them)."""

    name: str
    hidden: int
    inter: int
    num_experts: int
    topk: int = K3_TOPK
    local_experts: int | None = None

    @property
    def held_experts(self) -> int:
        return self.local_experts or self.num_experts

    @property
    def is_ep(self) -> bool:
        return self.local_experts is not None and self.local_experts < self.num_experts

    def to_json(self) -> dict:
        return asdict(self)


NAMED = {
    "tp8": Shape("tp8", 3584, 384, 896),
    "tp16": Shape("tp16", 3584, 192, 896),
    "ep16": Shape("ep16", 3584, 3072, 896, local_experts=56),
    "tiny": Shape("tiny", 256, 64, 8, topk=2),  # CPU runs (Triton interpreter, emulators)
}


def parse_shape(text: str) -> Shape:
    """'tp8' | 'tp16' | 'ep16' | 'tiny' | 'H,I,E,K'."""
    if text in NAMED:
        return NAMED[text]
    parts = text.split(",")
    if len(parts) != 4 or not all(p.strip().isdigit() for p in parts):
        raise ValueError(f"--shape {text!r}: expected one of {sorted(NAMED)} or H,I,E,K (four integers)")
    h, i, e, k = (int(p) for p in parts)
    if not (h and i and e):
        raise ValueError(f"--shape {text!r}: H, I and E must be positive")
    if h % 32 or i % 32:
        raise ValueError(f"--shape {text!r}: H ({h}) and I ({i}) must be multiples of the MXFP4 block 32")
    if not 0 < k <= e:
        raise ValueError(f"--shape {text!r}: top-k K ({k}) must be in 1..E ({e})")
    return Shape(f"H{h}_I{i}_E{e}_K{k}", h, i, e, topk=k)


def shape_from_model(path: str, tp: int = 8) -> Shape:
    """The per-rank shape of a model folder or config.json at tensor parallel size `tp`."""
    from kimi_k3_moe.configs import K3MoEConfig
    cfg = K3MoEConfig.from_hf_config(path)
    return Shape(f"model_tp{tp}", cfg.routed_expert_hidden_size, cfg.intermediate_per_rank(tp),
                 cfg.num_experts, topk=cfg.num_experts_per_token)


def model_activation(path: str):
    from kimi_k3_moe.configs import K3MoEConfig
    return K3MoEConfig.from_hf_config(path).activation


def add_shape_arguments(parser) -> None:
    """`--model`/`--shape` and `--tp`, read back by `shape_and_activation` (bench and tune)."""
    from kimi_k3_moe.cli import positive_int
    where = parser.add_mutually_exclusive_group()
    where.add_argument("--model", help="model folder or config.json: its per-rank shape and betas (with --tp)")
    where.add_argument("--shape", default="tp8", help="tp8 | tp16 | ep16 | H,I,E,K (default tp8)")
    parser.add_argument("--tp", type=positive_int, default=8, help="tensor-parallel size for --model")


def shape_and_activation(model: str | None, shape: str, tp: int):
    """What `--model`/`--shape` ask for: the model's per-rank shape and its own activation, or a named
    shape with Kimi-K3's published SiTUv2 betas (4, 25)."""
    if model:
        return shape_from_model(model, tp), model_activation(model)
    from kimi_k3_moe.activation import ActivationSpec
    return parse_shape(shape), ActivationSpec.situv2(4.0, 25.0)


def require_gpu(what: str) -> None:
    import torch
    if not torch.cuda.is_available():
        raise ValueError(f"no GPU visible to PyTorch; {what}")
