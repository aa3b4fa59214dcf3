"""Rung 5 on a real GPU: the load-time self-check accepts correct kernels and refuses a wrong one.

On a K3 TP8-shaped layer (H 3584, I 384, `--experts` random MXFP4 experts) this
goes through `RoutedExperts.load` exactly as the plugins do, for every backend
plan this GPU offers (bf16 and, where declared, fp8 activations; MXFP4 and int4
weights), then puts a deliberately wrong kernel (the real one, fed SiLU) in
front of the plan and checks that it is refused and the next backend serves.

    python benchmarks/self_check_gpu.py --json self_check.json
"""
from __future__ import annotations

import argparse
import json
import logging

import torch

import _common  # noqa: F401  (puts the repository on sys.path, as for the other benchmarks)
from kimi_k3_moe.activation import ActivationSpec
from kimi_k3_moe.dispatch import BackendChoice, plan_backends
from kimi_k3_moe.formats import mxfp4
from kimi_k3_moe.experts import ExpertWeights
from kimi_k3_moe.platform import detect_platform
from kimi_k3_moe.routed_experts import RoutedExperts
from kimi_k3_moe.self_check import SelfCheckFailed, run_self_check

SITU = ActivationSpec.situv2(4.0, 25.0)


def k3_layer(experts: int, seed: int, device: str) -> ExpertWeights:
    gen = torch.Generator().manual_seed(seed)
    h, i = 3584, 384
    w13 = torch.randn(experts, 2 * i, h, generator=gen) * 3 / h ** 0.5
    w2 = torch.randn(experts, h, i, generator=gen) / i ** 0.5
    return ExpertWeights(*mxfp4.quantize(w13), *mxfp4.quantize(w2)).to(device)


class SiluFed(BackendChoice):
    """The plan's own first backend, but handed SiLU whatever it is asked for."""

    def make(self):
        backend = super().make()
        forward = backend.forward
        backend.forward = lambda p, h, w, i, act, em=None: forward(p, h, w, i, ActivationSpec.silu(), em)
        backend.name = f"silu-fed-{backend.name}"
        return backend


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--experts", type=int, default=32)
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--json")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    platform = detect_platform()
    device = "cuda" if platform.is_gpu else "cpu"
    layer = k3_layer(args.experts, args.seed, device)
    rows, ok = [], True
    first = plan_backends(platform, {})[0]
    for act_dtype in first.spec.act_dtypes(platform, platform.weight_format):
        for fmt in ("mxfp4", "int4"):
            plan = [BackendChoice(c.name, {**c.options, "weight_format": fmt}, c.reason)
                    for c in plan_backends(platform, {}, act_dtype=act_dtype)
                    if not (fmt == "int4" and act_dtype != "bf16")]
            if not plan:
                continue
            backend = plan[0].make()
            try:
                err = run_self_check(backend, layer, SITU)
                runner = RoutedExperts(SITU, platform=platform, plan=plan, self_check="strict")
                served = runner.load(layer).describe()
            except (SelfCheckFailed, ValueError) as exc:
                err, served, ok = None, f"REFUSED: {exc}", False
            rows.append({"act_dtype": act_dtype, "weight_format": fmt, "backend": backend.describe(),
                         "self_check_rel_l2": err, "served_by": served})
            print(rows[-1])
    plan = plan_backends(platform, {})
    broken = [SiluFed(plan[0].name, plan[0].options, "deliberately wrong"), *plan]
    runner = RoutedExperts(SITU, platform=platform, plan=broken, self_check="fallback")
    served = runner.load(layer).describe()
    refused = served == plan[0].make().describe()
    ok &= refused
    rows.append({"deliberately_wrong_first": broken[0].name, "served_by": served, "wrong_one_refused": refused})
    print(rows[-1])
    result = {"platform": str(platform), "torch": torch.__version__, "experts": args.experts,
              "rows": rows, "ok": ok}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
