"""`kimi-k3-moe convert`: write a pre-converted int4 checkpoint that the plugins load directly.

gfx942 GPUs run the experts in int4; converting 92 layers from MXFP4 at
every server start costs minutes. This does it once, on the GPU when there
is one. Put the output at <model>/kimi_k3_moe_int4 to have it found
automatically, or point $KIMI_K3_MOE_CONVERTED at it.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from kimi_k3_moe import settings
from kimi_k3_moe.cli import positive_int
from kimi_k3_moe.formats import int4
from kimi_k3_moe.weights.convert_run import convert_checkpoint, verify_sources
from kimi_k3_moe.weights.converted import (
    CONVERTED_DIRNAME,
    ENV_CONVERTED,
    RECORD_FILE,
    TARGETS,
    ConvertedCheckpointError,
    open_converted,
)

HELP = "convert a Kimi-K3 MXFP4 checkpoint's experts to int4 once, for gfx942 servers to load directly"


MAX_LAYER = 100_000  # far above any model's depth; bounds what a typo can ask for


def _layers(text: str) -> list[int]:
    """'1-4,9' -> [1, 2, 3, 4, 9]; a reversed or empty range, or nothing at all, is refused."""
    out = []
    for part in text.split(","):
        lo, dash, hi = part.strip().partition("-")
        try:
            first, last = int(lo), int(hi if dash else lo)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{part!r} is not N or N-M (layer numbers >= 0)") from None
        if not 0 <= first <= MAX_LAYER or not 0 <= last <= MAX_LAYER:
            raise argparse.ArgumentTypeError(f"{part!r}: layer numbers run from 0 to {MAX_LAYER}")
        if last < first:
            raise argparse.ArgumentTypeError(f"{part!r} is a reversed range (no layer from {first} down to "
                                             f"{last}); write {last}-{first}")
        out += range(first, last + 1)
    return out


def _device(text: str) -> str:
    """A torch device this machine has: cpu, cuda or cuda:N (ROCm GPUs are cuda devices in torch)."""
    import torch

    try:
        device = torch.device(text)
    except (RuntimeError, ValueError):
        raise argparse.ArgumentTypeError(f"{text!r} is not a device; use cpu, cuda or cuda:N") from None
    if device.type == "cpu":
        return text
    if device.type != "cuda":
        raise argparse.ArgumentTypeError(f"{text!r}: converting runs on cpu or cuda[:N] only")
    if not torch.cuda.is_available():
        raise argparse.ArgumentTypeError(f"{text!r}: no GPU is visible here (torch.cuda.is_available() "
                                         "is False); use --device cpu or leave --device out")
    if device.index is not None and device.index >= torch.cuda.device_count():
        raise argparse.ArgumentTypeError(f"{text!r}: this machine has {torch.cuda.device_count()} GPU(s)")
    return text


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True, help="the MXFP4 model folder (config.json + safetensors)")
    parser.add_argument("--out", required=True,
                        help=f"output folder (MODEL/{CONVERTED_DIRNAME} is found automatically; "
                             f"elsewhere set {ENV_CONVERTED})")
    parser.add_argument("--target", required=True, choices=TARGETS, help="GPU architecture to serve on")
    parser.add_argument("--tp", type=positive_int, default=1, help="tensor-parallel size of the server (default 1)")
    parser.add_argument("--method", choices=int4.METHODS, default=int4.DEFAULT_METHOD,
                        help=f"int4 conversion (default {int4.DEFAULT_METHOD}; docs/FORMATS.md compares them)")
    parser.add_argument("--layers", type=_layers, help="only these MoE layers, e.g. 1-4,9")
    parser.add_argument("--device", type=_device, help="where to compute (default: a GPU if there is one, else cpu)")
    parser.add_argument("--chunk-mib", type=positive_int, help="scratch budget per chunk in MiB (>= 1)")
    parser.add_argument("--verify", action="store_true",
                        help="check an existing --out against the model's MXFP4 bytes instead of converting")
    parser.add_argument("--force", action="store_true",
                        help="replace a conversion of another model found in --out (refused without it)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")


def run(args: argparse.Namespace) -> int:
    # errors (ConvertedCheckpointError, ConfigError, CheckpointError, ...) end in cli.main as one line
    for problem in settings.check_all():  # not read here, but the server will refuse them
        print(f"kimi-k3-moe convert: warning: {problem}; a server started with it will refuse to load",
              file=sys.stderr)
    if args.verify:
        return _verify(args)
    start = time.perf_counter()
    done = convert_checkpoint(
        args.model, args.out, target=args.target, tp_size=args.tp, method=args.method,
        layers=args.layers, device=args.device,
        chunk_bytes=None if args.chunk_mib is None else args.chunk_mib << 20,
        progress=not args.no_progress, force=args.force)
    files = done.record["files"]
    total = sum(f["size"] for f in files.values())
    print(f"converted {len(done.layers)} MoE layer(s) x TP {done.tp_size} with method {done.method!r} "
          f"for {args.target}: {len(files)} files, {total / 2**30:.2f} GiB in {done.path} "
          f"({time.perf_counter() - start:.1f} s)")
    if Path(args.out).resolve() != (Path(args.model) / CONVERTED_DIRNAME).resolve():
        print(f"serve with {ENV_CONVERTED}={Path(args.out).resolve()}")
    return 0


def _verify(args: argparse.Namespace) -> int:
    checkpoint = open_converted(args.out)
    record = checkpoint.record
    asked = {"--tp": args.tp, "--method": args.method, "--target": args.target}
    held = {"--tp": record.get("tp_size"), "--method": record.get("method"), "--target": record.get("target")}
    if args.layers is not None:
        asked["--layers"], held["--layers"] = sorted(set(args.layers)), checkpoint.layers
    differ = [k for k in asked if asked[k] != held[k]]
    if differ:  # else a TP 1 folder would pass `--verify --tp 8`, and the TP 8 server then refuses it
        raise ConvertedCheckpointError(
            f"--out {args.out} holds a conversion made with " + ", ".join(f"{k} {held[k]}" for k in differ)
            + ", not " + ", ".join(f"{k} {asked[k]}" for k in differ) + " as asked; verify with the options "
            "it was made with, or convert again")
    damaged = checkpoint.check_files()  # the folder against its manifest, before the source
    if damaged:
        for line in damaged[:20]:
            print(f"DAMAGED: {line}")
        more = f" ({len(damaged) - 20} more not shown)" if len(damaged) > 20 else ""
        print(f"DAMAGED: {len(damaged)} problem(s) with the files of {checkpoint.path}{more}; convert again")
        return 1
    checkpoint.check_source(args.model)
    changed = verify_sources(checkpoint, args.model, progress=not args.no_progress)
    if changed:
        print(f"STALE: the MXFP4 source of {len(changed)} file(s) changed: {', '.join(changed[:8])}")
        return 1
    print(f"OK: {len(checkpoint.record['files'])} file(s) match their SHA-256 in {RECORD_FILE} and the "
          f"source bytes of {args.model}")
    return 0
