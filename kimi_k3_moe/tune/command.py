"""`kimi-k3-moe tune`: tune this GPU's tiles for one shape and leave a table the plugin then uses."""
from __future__ import annotations

import argparse
import sys
import time

from kimi_k3_moe.bench.routing import ROUTINGS, routings_arg
from kimi_k3_moe.bench.shapes import add_shape_arguments
from kimi_k3_moe.cli import count_list, positive_float, positive_int
from kimi_k3_moe.kernels import SPECS

HELP = ("tune the kernels' tiles on this GPU for one per-rank shape (each candidate checked against the "
        "reference, then timed) and write a user table that dispatch reads")
# what a target's constructor raises when this machine cannot run the backend (BackendUnavailable, a
# missing toolchain, a shape the kernels refuse, a compiler that does not import); other types are bugs
CANNOT_RUN_HERE = (RuntimeError, ValueError, ImportError)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--backend", choices=[s.name for s in SPECS if s.user_table], default=None,
                        help="default: flydsl on AMD, triton on NVIDIA")
    add_shape_arguments(parser)
    parser.add_argument("--format", dest="weight_format", choices=("mxfp4", "int4"), default="mxfp4",
                        help="triton: the weight format to tune (default mxfp4)")
    parser.add_argument("--tiers", default=None,
                        help="comma list of token tiers (>= 1; default: the backend's)")
    parser.add_argument("--budget-min", type=positive_float, default=10.0,
                        help="minutes, shared by the tiers (each gets its part of what is left); no candidate "
                             "starts after it")
    parser.add_argument("--quick", action="store_true", help="triton: the first few candidates per stage only")
    parser.add_argument("--reps", type=positive_int, default=25, help="graph replays per figure (median)")
    parser.add_argument("--restart", action="store_true", help="ignore the saved progress of an earlier run")
    parser.add_argument("--routing", default="uniform", type=routings_arg,
                        help=f"{ROUTINGS}, or a comma list of them (e.g. uniform,skewed): the routings every "
                             "candidate is timed on; with several, a tier keeps the candidate whose worst ratio to "
                             "each routing's best is smallest (in the table's fingerprint)")
    parser.add_argument("--packaged", metavar="PATH", default=None,
                        help="triton, for maintainers: also merge the tuned tiers into this packaged table "
                             "(the running Triton's section; other tiers, entries and sections stay)")


def run(args: argparse.Namespace) -> int:
    import random

    import torch

    from kimi_k3_moe.bench.shapes import require_gpu, shape_and_activation
    from kimi_k3_moe.bench.timing import GraphTimer
    from kimi_k3_moe.configs import user_tables
    shape, activation = shape_and_activation(args.model, args.shape, args.tp)
    tiers = count_list(args.tiers, "--tiers") if args.tiers else None
    require_gpu("tuning times kernels on the GPU it tunes for")
    hip = bool(getattr(torch.version, "hip", None))
    backend = args.backend or ("flydsl" if hip else "triton")
    if args.packaged and backend != "triton":
        raise ValueError(f"--packaged: only the triton backend ships tables per device, not {backend}")
    identity = user_tables.device_identity()
    seed = random.SystemRandom().randrange(2**31)
    experts = random_layer(shape, seed)
    try:
        target = make_target(backend, shape, experts, activation, identity, args, tiers)
    except CANNOT_RUN_HERE as exc:  # a backend's own checks saying no; a bug (TypeError, ...) stays internal
        raise ValueError(f"the {backend} backend cannot be tuned here: {exc}") from exc
    state = user_tables.table_path(backend, identity["key"]).with_suffix(f".{shape.name}.state.json")
    if args.restart:
        state.unlink(missing_ok=True)
    result = run_with_progress(target, activation, GraphTimer(reps=args.reps), args.budget_min * 60, state, seed,
                               routing=args.routing)
    print_summary(result)
    if args.packaged:
        merge_packaged(args.packaged, result, identity, activation)
    return 0


def merge_packaged(path: str, result: dict, identity: dict, activation) -> None:
    """The tuned entry, as just written to the user table, into a packaged table's running-Triton section."""
    from kimi_k3_moe.bench.env import run_info
    from kimi_k3_moe.configs import user_tables
    from kimi_k3_moe.kernels.triton import table as tt
    user, _ = user_tables.load(tt.USER_TABLE, identity)
    entry = user["entries"][result["key"]]
    tt.merge_into_table(path, identity["triton"], result["key"], entry, tuned_with=run_info(),
                        header={"device": identity["name"], "device_key": identity["key"],
                                "activation_tuned": str(activation)})
    print(f"merged {result['key']} into {path} (Triton {identity['triton']} section)")


def random_layer(shape, seed: int):
    """The random MXFP4 experts every candidate runs on, on the GPU."""
    import torch

    from kimi_k3_moe.bench.data import random_experts
    return random_experts(shape.held_experts, shape.hidden, shape.inter, "cuda",
                          torch.Generator(device="cuda").manual_seed(seed))


def make_target(backend, shape, experts, activation, identity, args, tiers):
    if backend == "triton":
        from kimi_k3_moe.tune.triton_target import TritonTarget
        return TritonTarget(shape, experts, activation, identity=identity, weight_format=args.weight_format,
                            tiers=tiers, quick=args.quick)
    from kimi_k3_moe.configs import user_tables
    from kimi_k3_moe.kernels.flydsl.toolchain import rocm_root
    from kimi_k3_moe.tune.flydsl_target import FlyDSLTarget
    rocm = rocm_root()
    if rocm is None:
        raise RuntimeError("no ROCm ld.lld found (set ROCM_PATH or KIMI_K3_MOE_FLYDSL_ROCM)")
    out = user_tables.table_dir() / "flydsl_build"
    return FlyDSLTarget(shape, experts, activation, arch=identity["arch"], identity=identity, out_dir=out,
                        rocm=rocm, tiers=tiers)


def run_with_progress(target, activation, timer, budget_s, state, seed, device="cuda", clock=time.monotonic,
                      routing=None, stream=None):
    """The loop with a progress bar on a terminal; elsewhere (a log, a remote job) one flushed line per
    candidate, because a live display prints nothing until it ends and a killed run would leave no trace."""
    from kimi_k3_moe.tune.loop import tune
    stream = stream or sys.stdout
    start = clock()

    def run(progress):
        return tune(target, activation, timer, budget_s=budget_s, state_path=state, device=device, seed=seed,
                    clock=clock, progress=progress, **({"routing": routing} if routing is not None else {}))
    if not stream.isatty():
        return run(lambda cand: print(f"tune {target.backend} [{clock() - start:6.0f} s of {budget_s:.0f}] "
                                      f"{cand.label}", file=stream, flush=True))
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
    with Progress(TextColumn("[bold]tune {task.fields[backend]}"), BarColumn(), TextColumn("{task.description}"),
                  TimeElapsedColumn()) as bar:
        task = bar.add_task("starting", total=budget_s, backend=target.backend)
        result = run(lambda cand: bar.update(task, completed=min(budget_s, clock() - start), description=cand.label))
        bar.update(task, completed=budget_s, description="done")
    return result


def _note(info: dict) -> str:
    if "worst_x_best" in info:
        times = ", ".join(f"{r} {us:.1f}" for r, us in info["us_by_routing"].items())
        return f"{times} us; worst {info['worst_x_best']:.3f}x best ({info['worst_routing']})"
    return info.get("note", "")


def print_summary(result: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    from kimi_k3_moe.tune.loop import TIMED, is_packaged
    console = Console() if sys.stdout.isatty() else Console(width=160)
    table = Table(title=f"tuned {result['key']} -> {result['path']}")
    for c in ("tier", "tuned", "us", "packaged us", "x packaged", "candidates timed", "note"):
        table.add_column(c)
    for tier, info in result["tiers"].items():
        packaged = [o.get("us") for o in result["outcomes"].get(str(tier), {}).values()
                    if is_packaged(o["label"]) and o["status"] == TIMED]
        p_us = packaged[0] if packaged else None
        table.add_row(str(tier), "partial" if info.get("partial") else str(info["tuned"]),
                      f"{info['us']:.1f}" if "us" in info else "-", f"{p_us:.1f}" if p_us else "-",
                      f"{info['us'] / p_us:.3f}" if p_us and "us" in info else "-",
                      f"{info.get('timed', 0)}/{info.get('candidates', 0)}", _note(info))
    console.print(table)
    if result["resumed"]:
        console.print(f"resumed {result['resumed']} earlier outcomes")
    if result["out_of_time"]:
        console.print("the budget ran out: run the same command again to continue where it stopped")
