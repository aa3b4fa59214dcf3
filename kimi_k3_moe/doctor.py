"""`kimi-k3-moe doctor`: what this machine has and what would serve the model here."""
from __future__ import annotations

import argparse
import importlib.metadata as md
import platform as py_platform
import sys
from pathlib import Path

import torch

from kimi_k3_moe import __version__, settings
from kimi_k3_moe.cli import positive_int
from kimi_k3_moe.configs import ConfigError, K3MoEConfig
from kimi_k3_moe.dispatch import plan_backends
from kimi_k3_moe.kernels.base import BackendUnavailable
from kimi_k3_moe.loading import resolve
from kimi_k3_moe.platform import arch_of, detect_platform

HELP = "report versions, GPUs, the backend that would serve here, and (with --model) the MoE it would serve"
OPTIONAL_PACKAGES = ("vllm", "sglang", "triton", "flydsl", "safetensors", "transformers")
# (package, entry-point group, filter variable, whether the engine reads the filter verbatim)
ENGINE_PLUGINS = (("vllm", "vllm.general_plugins", "VLLM_PLUGINS", True),
                  ("sglang", "sglang.srt.plugins", "SGLANG_PLUGINS", False))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", help="a model folder to check: config, then every shard and expert tensor")
    parser.add_argument("--tp", type=positive_int, default=1, help="tensor-parallel size to size the model for")
    parser.add_argument("--config-only", action="store_true",
                        help="with --model: check config.json only, not the weights (quick)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar while checking weights")


def _version(package: str) -> str:
    try:
        return md.version(package)
    except md.PackageNotFoundError:
        return "not installed"


def _gpus() -> list[str]:
    if not torch.cuda.is_available():
        return []
    rows = []
    for i in range(torch.cuda.device_count()):
        p = torch.cuda.get_device_properties(i)
        rows.append(f"[{i}] {p.name}: {arch_of(p)}, {p.total_memory / 2**30:.0f} GiB")
    return rows


def _plugin_lines() -> list[str]:
    """Whether each engine would load our entry point in this environment."""
    import os

    from kimi_k3_moe.plugin_entrypoints.common import PLUGIN_NAME, plugin_enabled

    lines = []
    for package, group, env_var, verbatim in ENGINE_PLUGINS:
        if not any(ep.name == PLUGIN_NAME for ep in md.entry_points(group=group)):
            state = "entry point not installed"
        elif not plugin_enabled(env_var, verbatim=verbatim):
            state = f"off: {env_var}={os.environ[env_var]!r} leaves {PLUGIN_NAME} out"
        elif _version(package) == "not installed":
            state = f"entry point {group}:{PLUGIN_NAME} installed; {package} is not"
        else:
            state = f"on: {package} loads {group}:{PLUGIN_NAME} in each of its processes"
        lines.append(f"{package:<7} {state}")
    return lines


def _memory_bytes() -> tuple[int, str]:
    if torch.cuda.is_available():
        total = sum(torch.cuda.get_device_properties(i).total_memory
                    for i in range(torch.cuda.device_count()))
        return total, f"{torch.cuda.device_count()} GPU(s)"
    import os
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"), "system RAM"


def run(args: argparse.Namespace) -> int:
    # usage errors before the report; a model that exists but cannot be served is the report's answer (1)
    if args.config_only and not args.model:
        raise ValueError("--config-only needs --model")
    if args.model and not Path(args.model).exists():
        raise ValueError(f"--model {args.model} does not exist")
    print(f"kimi-k3-moe {__version__}")
    print(f"python {sys.version.split()[0]} ({py_platform.machine()}), torch {torch.__version__}")
    for package in OPTIONAL_PACKAGES:
        print(f"  {package:<13} {_version(package)}")
    print("engine plugins:")
    for line in _plugin_lines():
        print("  " + line)
    gpus = _gpus()
    print("GPUs: " + ("none" if not gpus else ""))
    for row in gpus:
        print("  " + row)
    platform = detect_platform()
    print(f"platform: {platform}")
    problems = settings.check_all()
    try:
        plan = plan_backends(platform)
        print("backend plan (first that runs and passes its self-check serves):")
        for choice in plan:
            print(f"  {choice}: {choice.reason}")
        backend, choice, skipped = resolve(plan)
        for line in skipped:
            print(f"  skipped {line}")
        print(f"would serve with: {backend.describe()} ({choice.reason})")
        print(_tables_line(backend.name))
        print(_engine_line(platform, args.tp))
    except (BackendUnavailable, ValueError) as exc:
        if str(exc) not in problems:  # an invalid setting is listed once
            problems.append(str(exc))
    if args.model:
        problems += _check_model(args.model, args.tp, weights=not args.config_only,
                                 progress=not args.no_progress)
    if problems:
        for p in problems:
            print(f"CANNOT SERVE: {p}")
        return 1
    print("OK")
    return 0


def _engine_line(platform, tp: int) -> str:
    """Whether vLLM's own Kimi-K3 path keeps the layers here (gfx950 with aiter), for K3 at this TP."""
    from kimi_k3_moe.bench.shapes import NAMED
    from kimi_k3_moe.configs import engine_verdicts
    from kimi_k3_moe.dispatch import aiter_situ_path, engine_keeps_layer
    k3 = NAMED["tp8"]   # Kimi-K3's published layer, sized here for --tp
    key = engine_verdicts.shape_key(k3.hidden, k3.inter * 8 // tp, k3.num_experts, k3.topk)
    reason = engine_keeps_layer(platform, aiter_situ_path, key)
    if reason is None:
        return f"under vLLM: kimi-k3-moe serves the Kimi-K3 MoE layers ({key} at TP{tp})"
    return f"under vLLM: the engine's own path keeps the Kimi-K3 MoE layers ({key} at TP{tp}): {reason}"


def _tables_line(backend: str) -> str:
    from kimi_k3_moe.dispatch import serving_table
    line = serving_table(backend)
    return f"tiles: {line}" if line else f"tiles: none ({backend} has no tile table)"


def _check_model(model: str, tp: int, *, weights: bool, progress: bool) -> list[str]:
    try:
        cfg = K3MoEConfig.from_hf_config(model)
        per_rank = cfg.intermediate_per_rank(tp)
        cfg.require_moe_layers()
    except (ConfigError, ValueError) as exc:
        return [f"model config {model}: {exc}"]
    print(f"model: {model} ({cfg.model_type or 'unknown type'})")
    print(f"  activation: {cfg.activation}")
    if cfg.activation.defaults_note():
        print(f"    ({cfg.activation.defaults_note()})")
    print(f"  MoE layers: {len(cfg.moe_layers())} of {cfg.num_hidden_layers}; experts {cfg.num_experts}, "
          f"top-{cfg.num_experts_per_token}, shared {cfg.num_shared_experts}")
    print(f"  routed experts: hidden {cfg.routed_expert_hidden_size} (model {cfg.hidden_size}), "
          f"intermediate {cfg.moe_intermediate_size} -> {per_rank} per rank at TP {tp}")
    q = cfg.quantization
    print(f"  quantization: {q.quant_method} / {q.format}, {q.num_bits}-bit, group {q.group_size}"
          if q else "  quantization: none (bf16 experts are not served by this package)")
    problems = [] if q else ["experts are not MXFP4-quantized; this package serves MXFP4 checkpoints"]
    need = cfg.routed_expert_bytes(tp) * tp
    have, where = _memory_bytes()
    print(f"  routed experts need {need / 2**30:.2f} GiB in MXFP4 across TP {tp}; {where} hold "
          f"{have / 2**30:.1f} GiB")
    if need > have:
        problems.append(f"the routed experts alone need {need / 2**30:.1f} GiB; {where} here hold "
                        f"{have / 2**30:.1f} GiB")
    if not weights:
        print("  weights: not checked (--config-only)")
        return problems
    from kimi_k3_moe.weights.check import check_weights

    folder = Path(model).parent if Path(model).is_file() else Path(model)
    weight_problems, summary = check_weights(folder, cfg, progress=progress)
    print(f"  {summary}: {'OK' if not weight_problems else f'{len(weight_problems)} problem(s)'}")
    return problems + weight_problems + _check_converted(folder)


def _check_converted(folder: Path) -> list[str]:
    """The full manifest check of the converted int4 folder a plugin would load, when there is one."""
    from kimi_k3_moe.weights.converted import converted_location, open_converted

    try:
        where, _ = converted_location(folder)
    except ValueError as exc:  # an invalid KIMI_K3_MOE_CONVERTED, listed with the settings already
        return [] if str(exc) in settings.check_all() else [str(exc)]
    if where is None or not where.exists():
        print("  converted int4 experts: none")
        return []
    try:
        found = open_converted(where)
        problems = [f"converted int4 experts: {line}" for line in found.check_files()]
        found.check_source(folder)
    except ValueError as exc:  # ConvertedCheckpointError, or CheckpointError from the source's shards
        print(f"  converted int4 experts: {where}: refused")
        return [str(exc)]
    files = len(found.record["files"])
    print(f"  converted int4 experts: {where}: {files} file(s) checked against their SHA-256: "
          + ("OK" if not problems else f"{len(problems)} problem(s)"))
    return problems
