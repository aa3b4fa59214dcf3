"""How much each MXFP4 -> int4 conversion loses, on K3-shaped experts.

Experts are drawn the way trained weights look (Gaussian, Gaussian with a
few outliers per row, Student-t with 4 degrees of freedom), quantised to
MXFP4 as a checkpoint would hold them, then converted with each int4
method. Per method it reports:

- weight rel. L2: ||int4 - mxfp4|| / ||mxfp4|| over all experts (float64);
- exact groups: the fraction of groups of 32 the conversion reproduces exactly;
- MoE out rel. L2: the routed-expert MoE (SiTUv2, beta 4, linear beta 25)
  on int4 weights against the same MoE on the MXFP4 weights, both float64;
- bytes per weight, and CPU seconds to convert.

Context rows: MXFP4 against the float weights it was made from, and an
exhaustive search over every bf16 scale (the ceiling of any symmetric
per-group scale choice; a reference, not a method).

Default: 8 experts at the TP8 per-rank shape (H 3584, I 384), 64 tokens,
top-4: about two minutes on 2 cores. --full: 32 experts at the unsplit
K3 shape (H 3584, I 3072), 256 tokens, top-8.

  python benchmarks/requant_fidelity.py [--full] [--json out.json] [--markdown]
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kimi_k3_moe.activation import ActivationSpec  # noqa: E402
from kimi_k3_moe.formats import int4, int4_fit, mxfp4  # noqa: E402
from kimi_k3_moe.reference import dense_moe, relative_l2  # noqa: E402

DISTRIBUTIONS = ("gaussian", "gaussian+outliers", "student-t4")
SITU = ActivationSpec.situv2(4.0, 25.0)
STAGE1_GAIN = 3.0  # stage-1 outputs reach the range where SiTUv2 bends away from SiLU


def draw(kind: str, rows: int, cols: int, gen: torch.Generator) -> torch.Tensor:
    """[rows, cols] with unit-variance entries of the given shape, row scales varying as trained ones do."""
    if kind == "gaussian":
        w = torch.randn(rows, cols, generator=gen)
    elif kind == "gaussian+outliers":
        w = torch.randn(rows, cols, generator=gen)
        idx = torch.randint(0, cols, (rows, 4), generator=gen)  # four outliers per row, 5-10 sigma
        size = (5 + 5 * torch.rand(rows, 4, generator=gen)) * torch.sign(torch.randn(rows, 4, generator=gen))
        w.scatter_(1, idx, size)
    elif kind == "student-t4":
        # t = z / sqrt(chi2_4 / 4), chi2_4 = -2 log(u1 u2); variance 2, scaled to 1.
        z = torch.randn(rows, cols, generator=gen)
        u = torch.rand(2, rows, cols, generator=gen).clamp_min(1e-12)
        w = z / torch.sqrt(-2 * torch.log(u[0] * u[1]) / 4) / 2 ** 0.5
    else:
        raise ValueError(f"unknown distribution {kind!r}")
    row_scale = torch.exp(0.25 * torch.randn(rows, 1, generator=gen))
    return w * row_scale


def make_experts(kind: str, e: int, h: int, i: int, gen: torch.Generator):
    """MXFP4 (w13 [E, 2I, H], w2 [E, H, I]) and the float weights they came from."""
    w13 = torch.stack([draw(kind, 2 * i, h, gen) * (STAGE1_GAIN / h ** 0.5) for _ in range(e)])
    w2 = torch.stack([draw(kind, h, i, gen) / i ** 0.5 for _ in range(e)])
    return {"w13": (w13, *mxfp4.quantize(w13)), "w2": (w2, *mxfp4.quantize(w2))}


def exhaustive_symmetric_error(packed: torch.Tensor, scales: torch.Tensor) -> tuple[float, float]:
    """(sum of squared errors, exact fraction) of the best bf16 scale of every group, in float64."""
    rows = []
    for m in mxfp4.E2M1_MAGNITUDES:
        if m == 0:
            rows.append([(0.0, 0.0, 0, 0)])
            continue
        cands = int4_fit._symmetric_rows(m)[:1]  # the amax/7 row first, as in the real tables
        t = torch.tensor(m / 16, dtype=torch.float32).to(torch.bfloat16)
        while float(t) <= m / 4:
            cands += [(float(t), 0.0, -8, 7), (-float(t), 0.0, -8, 7)]
            t = (t.view(torch.int16) + 1).view(torch.bfloat16)
        rows.append(cands)
    tables = int4_fit._build(rows)
    groups, exps = packed.reshape(-1, 16), scales.reshape(-1).double()
    total, exact = 0.0, 0
    for start in range(0, groups.shape[0], 1 << 18):
        counts = int4_fit.histograms(groups[start:start + (1 << 18)])
        lo, hi = int4_fit.extreme_bins(counts)
        err, _ = int4_fit.best_by_class(counts, int4_fit._magnitude_class(lo, hi), tables.se)
        total += float((err * torch.exp2(2 * (exps[start:start + (1 << 18)] - 127))).sum())
        exact += int((err == 0).sum())
    return total, exact / groups.shape[0]


def routing(tokens: int, experts: int, top_k: int, gen: torch.Generator):
    scores = torch.rand(tokens, experts, generator=gen)
    ids = scores.topk(top_k, dim=1).indices.to(torch.int32)
    weights = torch.sigmoid(torch.randn(tokens, top_k, generator=gen))
    return weights / weights.sum(1, keepdim=True), ids


def moe(hidden, w13_of, w2_of, weights, ids):
    return dense_moe(hidden, w13_of, w2_of, weights, ids, SITU, compute_dtype=torch.float64)


def bytes_per_weight(method: str) -> float:
    return 0.5 + 2 / 32 + (2 / 32 if method in int4.OFFSET_METHODS else 0)


def run_distribution(kind: str, args, gen: torch.Generator) -> list[dict]:
    data = make_experts(kind, args.experts, args.hidden, args.inter, gen)
    ref = {name: mxfp4.dequantize(p, s).double() for name, (_, p, s) in data.items()}
    ref_norm2 = sum(float(r.pow(2).sum()) for r in ref.values())
    hidden = torch.randn(args.tokens, args.hidden, generator=gen).to(torch.bfloat16)
    weights, ids = routing(args.tokens, args.experts, args.top_k, gen)
    out_ref = moe(hidden, lambda e: ref["w13"][e], lambda e: ref["w2"][e], weights, ids)
    rows = []
    src_err2 = sum(float((ref[n] - w.double()).pow(2).sum()) for n, (w, _, _) in data.items())
    src_norm2 = sum(float(w.double().pow(2).sum()) for w, _, _ in data.values())
    rows.append({"distribution": kind, "method": "mxfp4 vs float source (context)",
                 "weight_rel_l2": (src_err2 / src_norm2) ** 0.5, "bytes_per_weight": 0.5 + 1 / 32})
    for method in int4.METHODS:
        start = time.perf_counter()
        conv = {n: int4.requantize(p, s, method=method) for n, (_, p, s) in data.items()}
        seconds = time.perf_counter() - start
        deq = {n: c.dequantize().double() for n, c in conv.items()}
        err2 = sum(float((deq[n] - ref[n]).pow(2).sum()) for n in ref)
        group_err = torch.cat([(deq[n] - ref[n]).pow(2).unflatten(-1, (-1, 32)).sum(-1).flatten()
                               for n in ref])
        out = moe(hidden, lambda e: deq["w13"][e], lambda e: deq["w2"][e], weights, ids)
        rows.append({"distribution": kind, "method": method, "weight_rel_l2": (err2 / ref_norm2) ** 0.5,
                     "exact_groups": float((group_err == 0).double().mean()),
                     "moe_out_rel_l2": relative_l2(out, out_ref),
                     "bytes_per_weight": bytes_per_weight(method), "convert_seconds": seconds})
        del conv
    ex_err2, ex_exact = 0.0, 0.0
    n_groups = 0
    for _, p, s in data.values():
        e2, frac = exhaustive_symmetric_error(p, s)
        ex_err2 += e2
        ex_exact += frac * s.numel()
        n_groups += s.numel()
    rows.append({"distribution": kind, "method": "exhaustive bf16 scale (symmetric ceiling)",
                 "weight_rel_l2": (ex_err2 / ref_norm2) ** 0.5, "exact_groups": ex_exact / n_groups})
    amax = next(r for r in rows if r["method"] == "amax")
    for r in rows:
        for key in ("weight_rel_l2", "moe_out_rel_l2"):
            if key in r and r["method"] in int4.METHODS + ("exhaustive bf16 scale (symmetric ceiling)",):
                r[key.replace("rel_l2", "vs_amax")] = r[key] / amax[key] - 1
    return rows


COLUMNS = (("weight rel. L2", "weight_rel_l2", "{:.4f}"), ("vs amax/7", "weight_vs_amax", "{:+.1%}"),
           ("exact groups", "exact_groups", "{:.1%}"), ("MoE out rel. L2", "moe_out_rel_l2", "{:.4f}"),
           ("vs amax/7", "moe_out_vs_amax", "{:+.1%}"), ("bytes/weight", "bytes_per_weight", "{:.4f}"),
           ("convert s", "convert_seconds", "{:.1f}"))


def cells(row: dict) -> list[str]:
    return [fmt.format(row[key]) if key in row else "" for _, key, fmt in COLUMNS]


def markdown(rows: list[dict]) -> str:
    lines = ["| weights | method | " + " | ".join(title for title, _, _ in COLUMNS) + " |",
             "|---|---|" + "---|" * len(COLUMNS)]
    lines += [f"| {r['distribution']} | {r['method']} | " + " | ".join(cells(r)) + " |" for r in rows]
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--full", action="store_true", help="32 experts at the unsplit K3 shape, 256 tokens")
    parser.add_argument("--experts", type=int)
    parser.add_argument("--hidden", type=int, default=3584)
    parser.add_argument("--inter", type=int, help="intermediate size per rank (default 384, --full 3072)")
    parser.add_argument("--tokens", type=int)
    parser.add_argument("--top-k", type=int)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--distributions", nargs="+", default=list(DISTRIBUTIONS), choices=DISTRIBUTIONS)
    parser.add_argument("--json", help="write the rows here")
    parser.add_argument("--markdown", action="store_true", help="print the table as markdown too")
    args = parser.parse_args(argv)
    full = dict(experts=32, inter=3072, tokens=256, top_k=8)
    small = dict(experts=8, inter=384, tokens=64, top_k=4)
    for key, value in (full if args.full else small).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    gen = torch.Generator().manual_seed(args.seed)
    shape = (f"{args.experts} experts, H {args.hidden}, I {args.inter}, {args.tokens} tokens top-{args.top_k}, "
             f"SiTUv2(4, 25), seed {args.seed}, torch {torch.__version__}, {torch.get_num_threads()} threads")
    print(f"requant fidelity: {shape}")
    rows = []
    print(f"{'weights':18s} {'method':42s} " + " ".join(f"{title:>15s}" for title, _, _ in COLUMNS))
    for kind in args.distributions:
        new = run_distribution(kind, args, gen)
        for r in new:
            print(f"{kind:18s} {r['method']:42s} " + " ".join(f"{c:>15s}" for c in cells(r)), flush=True)
        rows += new
    if args.markdown:
        print(markdown(rows))
    if args.json:
        Path(args.json).write_text(json.dumps({"setup": shape, "rows": rows}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
