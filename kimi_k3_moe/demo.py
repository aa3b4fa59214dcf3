"""`kimi-k3-moe demo`: a tiny synthetic Kimi-K3 MoE layer, end to end.

Checkpoint -> config -> experts -> router -> latent projection -> the MoE on
the backend this machine would use, checked against the float64 reference.
"""
from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from kimi_k3_moe import settings
from kimi_k3_moe.act_quant import ActQuant
from kimi_k3_moe.activation import ActivationSpec
from kimi_k3_moe.cli import non_negative_int
from kimi_k3_moe.configs import K3MoEConfig
from kimi_k3_moe.reference import moe_forward, relative_l2
from kimi_k3_moe.routed_experts import RoutedExperts
from kimi_k3_moe.routing import select_experts
from kimi_k3_moe.weights import CheckpointReader, read_layer_experts, read_router
from kimi_k3_moe.weights.checkpoint import moe_tensor_name
from kimi_k3_moe.weights.synthetic import make_checkpoint

HELP = "run a tiny synthetic Kimi-K3 MoE layer on this machine's backend against the float64 reference"
ERROR_BOUND = 1e-2
MAX_TOKENS = 1 << 16   # the float64 reference holds every row on the CPU: the demo stays a tiny check
DEMO_MARKER = "KIMI_K3_MOE_DEMO"  # a folder holding it may be overwritten by the next demo
DEMO_SHAPE = dict(hidden_size=512, routed_expert_hidden_size=256, moe_intermediate_size=128,
                  num_experts=32, num_experts_per_token=4)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", help="folder for the synthetic checkpoint (default: a temporary one)")
    parser.add_argument("--tokens", type=non_negative_int, nargs="+", default=[1, 7, 64],
                        help="batch sizes to run (>= 0; at least one must be >= 1 to measure anything)")
    parser.add_argument("--seed", type=non_negative_int, default=0, help="seed of the synthetic data (>= 0)")


def run(args: argparse.Namespace) -> int:
    if args.seed >= 2**63:
        raise ValueError(f"--seed {args.seed} is too large (must be < 2**63)")
    if max(args.tokens) > MAX_TOKENS:
        raise ValueError(f"--tokens {max(args.tokens)} is above the demo's limit of {MAX_TOKENS} tokens "
                         "(it checks a tiny layer against a float64 reference on the CPU)")
    if args.out:
        out = Path(args.out)
        if out.exists() and not out.is_dir():
            raise ValueError(f"--out {out} is an existing file, not a folder")
        if out.is_dir() and any(out.iterdir()) and not (out / DEMO_MARKER).is_file():
            raise ValueError(f"--out {out} is a non-empty folder that no demo wrote; the demo would overwrite "
                             "its config.json and model.safetensors: name an empty or new folder")
        try:
            out.mkdir(parents=True, exist_ok=True)
            (out / DEMO_MARKER).write_text("written by `kimi-k3-moe demo`; it may overwrite this folder\n")
        except OSError as exc:
            raise ValueError(f"--out {out} cannot be written: {exc.strerror or exc}") from None
        return _run(out, args)
    with tempfile.TemporaryDirectory(prefix="kimi-k3-moe-demo-") as tmp:
        return _run(Path(tmp), args)


def _latent(x: torch.Tensor, reader: CheckpointReader, layer: int, eps: float) -> torch.Tensor:
    """The routed experts' input: RMSNorm(down_proj(x)) at the latent width."""
    def weight(suffix: str) -> torch.Tensor:
        return reader.get(moe_tensor_name(layer, suffix, reader.prefix)).float()

    z = x.float() @ weight("routed_expert_down_proj.weight").T
    z = z * torch.rsqrt(z.pow(2).mean(-1, keepdim=True) + eps)
    return (z * weight("routed_expert_norm.weight")).to(torch.bfloat16)


def _run(folder: Path, args: argparse.Namespace) -> int:
    console = Console(soft_wrap=True)  # one printed line per message, whatever the terminal width
    make_checkpoint(folder, seed=args.seed, **DEMO_SHAPE)
    cfg = K3MoEConfig.from_hf_config(folder)
    layer = cfg.moe_layers()[0]
    reader = CheckpointReader(folder)
    experts = read_layer_experts(reader, layer, hidden_size=cfg.routed_expert_hidden_size,
                                 intermediate_size=cfg.moe_intermediate_size,
                                 num_experts=cfg.num_experts)
    gate, bias = read_router(reader, layer)
    console.print(f"synthetic Kimi-K3 checkpoint: {escape(str(folder))}")
    console.print(f"activation from config.json: [bold]{escape(str(cfg.activation))}[/bold]")
    if cfg.activation.defaults_note():
        console.print(f"  ({escape(cfg.activation.defaults_note())})")
    console.print(f"MoE layer {layer}: {cfg.num_experts} experts, top-{cfg.num_experts_per_token}, "
                  f"hidden {cfg.hidden_size} -> latent {cfg.routed_expert_hidden_size}, "
                  f"intermediate {cfg.moe_intermediate_size}, MXFP4 {experts.nbytes / 2**20:.2f} MiB")

    runner = RoutedExperts(cfg.activation, layer_name=f"layer {layer}")
    device = torch.device("cuda") if runner.platform.is_gpu else torch.device("cpu")
    runner.load(experts.to(device))
    backend_name = runner.backend.describe()  # e.g. torch[mxfp4, a8 emulated]: brackets printed literally
    console.print(f"platform: {escape(str(runner.platform))}; backend: [bold]{escape(backend_name)}[/bold] "
                  f"({escape(runner.choice.reason)})")

    silu = ActivationSpec.silu()
    # quantized activations (KIMI_K3_MOE_ACT_DTYPE): the reference rounds them the same way, so the bound
    # measures the kernels, as the self-check's does; the format's own price (vs unquantized) is shown, not
    # judged: at 1-2 tokens it spreads up to its estimate (fp4 0.21-0.25 over seeds, estimate 2^-2)
    act_quant = getattr(runner.backend, "act_quant", None) or ActQuant()
    quantized = act_quant.quantizes
    columns = ["backend", "tokens", "rel. L2 vs float64" + (f" ({act_quant.tag()} alike)" if quantized else ""),
               "SiLU vs SiTUv2 (rel. L2)"]
    columns += [f"{act_quant.dtype} cost: vs unquantized"] if quantized else []
    table = Table(title="Kimi-K3 routed experts vs the float64 reference")
    for column in (*columns, "time (ms)"):
        table.add_column(column, justify="right")
    gen = torch.Generator().manual_seed(args.seed + 1)
    worst, least_distinct, worst_cost, measured = 0.0, float("inf"), 0.0, []
    for tokens in args.tokens:
        x = torch.randn(tokens, cfg.hidden_size, generator=gen).to(torch.bfloat16)
        weights, ids = select_experts(
            x.float() @ gate.float().T, bias, cfg.num_experts_per_token,
            num_expert_group=cfg.router.num_expert_group, topk_group=cfg.router.topk_group,
            renormalize=cfg.router.renormalize,
            routed_scaling_factor=cfg.router.routed_scaling_factor)
        hidden = _latent(x, reader, layer, cfg.rms_norm_eps)
        start = time.perf_counter()
        out = runner(hidden.to(device), weights.to(device), ids.to(device))
        if device.type == "cuda":
            torch.cuda.synchronize()
        elapsed = (time.perf_counter() - start) * 1e3
        packed = experts.tensors()

        def reference(activation, quant, hidden=hidden, packed=packed, weights=weights, ids=ids):
            return moe_forward(hidden.double(), *packed, weights, ids, activation, compute_dtype=torch.float64,
                               act_quant=quant)
        ref, ref_silu = reference(cfg.activation, act_quant), reference(silu, act_quant)
        if tokens == 0:
            table.add_row(escape(backend_name), "0", "n/a (empty batch)", *["n/a"] * (len(columns) - 3),
                          f"{elapsed:.1f}")
            continue
        err, distinct = relative_l2(out.cpu(), ref), relative_l2(ref_silu, ref)
        cost = relative_l2(out.cpu(), reference(cfg.activation, None)) if quantized else 0.0
        if not (torch.isfinite(out).all() and err == err and cost == cost):
            err = cost = float("inf")
        worst, least_distinct, worst_cost = max(worst, err), min(least_distinct, distinct), max(worst_cost, cost)
        measured.append(tokens)
        table.add_row(escape(backend_name), str(tokens), f"{err:.2e}", f"{distinct:.3f}",
                      *([f"{cost:.2e}"] if quantized else []), f"{elapsed:.1f}")
    console.print(table)
    ok, verdict = _verdict(backend_name, cfg.activation, measured, worst, least_distinct, act_quant, worst_cost)
    console.print(escape(verdict))
    return 0 if ok else 1


def _verdict(backend: str, activation: ActivationSpec, measured: list[int], worst: float,
             least_distinct: float, act_quant: ActQuant = ActQuant(), worst_cost: float = 0.0) -> tuple[bool, str]:
    """(passed, the line saying what was measured); a claim about the activation only when it was shown.

    `worst` is against the reference that quantizes activations as `act_quant` does; `worst_cost` (quantized
    activations only) against unquantized ones, reported as the format's price."""
    if not measured:
        return False, ("FAIL: nothing measured: every --tokens value is 0, so no output was compared "
                       "with the float64 reference")
    what = (f"{backend} on {len(measured)} batch(es) of {'/'.join(map(str, measured))} token(s) vs the "
            f"float64 reference with {activation}")
    if act_quant.quantizes:
        what += f" and the same activation quantization, {act_quant} ({settings.ACT_DTYPE})"
    if worst > ERROR_BOUND:
        return False, (f"FAIL: {what}: worst relative L2 {worst:.2e} exceeds the bound {ERROR_BOUND:g}; "
                       "the output does not match the reference")
    cost = (f"; against unquantized activations {worst_cost:.2e}, the price of {act_quant.dtype} itself "
            "(docs/FORMATS.md)") if act_quant.quantizes else ""
    if not least_distinct > 10 * ERROR_BOUND:
        return False, (f"FAIL: {what}: within the bound ({worst:.2e} <= {ERROR_BOUND:g}), but SiLU differs "
                       f"from SiTUv2 by only {least_distinct:.3f} on these rows, so this run cannot tell "
                       "which activation was applied")
    return True, (f"PASS: {what}: worst relative L2 {worst:.2e} (bound {ERROR_BOUND:g}){cost}; SiLU would "
                  f"differ by at least {least_distinct:.3f}, so the output follows SiTUv2, not SiLU")
