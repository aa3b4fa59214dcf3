"""Expert ids that no router produces, through the Triton backend's public interface: what
`check_gpu.py --sanitize` runs, meant to be run under `compute-sanitizer --tool memcheck`.

Per case (weight format x path x token count x kind of bad id x expert map or not): fresh random
weights, routing and activations; a quarter of the (token, slot) pairs get the bad id; the output
must be finite and equal, bit for bit, to the output with those pairs set to -1 (a pair of another
rank: it reads nothing and adds nothing). One summary line per case; memcheck reports any invalid
access itself. Kinds: E (one past the last expert), -1, 10**6, and int64 ids (2**32 + 1, which
narrowed to int32 would be expert 1, and 10**12).
"""
from __future__ import annotations

from dataclasses import replace

import torch

from kimi_k3_moe.activation import ActivationSpec
from kimi_k3_moe.bench.data import expert_map_for, random_experts, random_hidden, random_routing
from kimi_k3_moe.kernels import get_backend
from kimi_k3_moe.kernels.triton.table import heuristic_config
from kimi_k3_moe.weights.requant import requantize_experts

SITU = ActivationSpec.situv2(4.0, 25.0)
TOKENS = (1, 3, 64, 300)  # gemv and direct paths, one-launch alignment, two-launch alignment


def bad_kinds(num_ids: int) -> list[tuple[str, int, torch.dtype]]:
    return [("E", num_ids, torch.int32), ("-1", -1, torch.int32), ("1e6", 10**6, torch.int32),
            ("int64 2^32+1", 2**32 + 1, torch.int64), ("int64 1e12", 10**12, torch.int64)]


def paths(h: int, i: int, tokens: int, is_cuda: bool) -> list[tuple[str, object]]:
    """(label, pinned config or None for the table's choice) worth running at `tokens`."""
    out = [("table", None)]
    if tokens <= 3:
        out.append(("gemv", heuristic_config(h, i, 1, is_cuda=is_cuda)))
        out.append(("direct", replace(heuristic_config(h, i, 64, is_cuda=is_cuda), path="direct", block_m=16)))
    else:
        out.append(("aligned", heuristic_config(h, i, tokens, is_cuda=is_cuda)))
    return out


def run_cases(dev: str, gen: torch.Generator, e: int, h: int, i: int, topk: int, tokens=TOKENS,
              say=print) -> int:
    """Every case; the number that failed (non-finite, or not equal to the -1 run, or an exception)."""
    experts = random_experts(e, h, i, dev, gen)
    forms = {"mxfp4": experts, "int4": requantize_experts(experts, progress=False)}
    held = max(1, e // 8)  # with a map: this rank holds [0, E/8) of E global ids, as at EP8
    failed = 0
    for weight_format, weights_in in forms.items():
        for t in tokens:
            for label, config in paths(h, i, t, dev == "cuda"):
                backend = get_backend("triton", weight_format=weight_format, config=config)
                for with_map in (False, True):
                    prepared = backend.prepare(weights_in.select(list(range(held))) if with_map else weights_in)
                    emap = expert_map_for(e, held, dev) if with_map else None
                    for kind, value, dtype in bad_kinds(e):
                        ok, detail = _one_case(backend, prepared, emap, gen, dev, t, e, h, topk, value, dtype)
                        failed += not ok
                        say(f"sanitize {weight_format:5} {label:7} tokens={t:<4} map={'EP8' if with_map else 'none':4} "
                            f"bad={kind:13} {'PASS' if ok else 'FAIL'} {detail}")
    return failed


def _one_case(backend, prepared, emap, gen, dev, t, e, h, topk, value, dtype) -> tuple[bool, str]:
    try:
        weights, ids = random_routing(t, e, topk, dev, gen)
        hidden = random_hidden(t, h, dev, gen)
        pick = torch.rand(ids.shape, device=dev, generator=gen) < 0.25
        pick[0, 0] = True  # at least one bad pair
        wild = torch.where(pick, torch.full_like(ids, 0, dtype=torch.int64) + value, ids.long()).to(dtype)
        dropped = torch.where(pick, torch.full_like(ids, -1), ids).to(dtype if value < 2**31 else torch.int64)
        got = backend.forward(prepared, hidden, weights, wild, SITU, emap)
        want = backend.forward(prepared, hidden, weights, dropped, SITU, emap)
        if dev == "cuda":
            torch.cuda.synchronize()  # a fault surfaces here, inside this case
        finite = bool(torch.isfinite(got).all())
        same = bool(torch.equal(got, want))
        return finite and same, f"finite={finite} equal_to_minus_1_run={same} bad_pairs={int(pick.sum())}"
    except Exception as exc:  # one line per case, the run goes on (a sticky CUDA error fails the rest)
        return False, f"{type(exc).__name__}: {' '.join(str(exc).split())[:200]}"
