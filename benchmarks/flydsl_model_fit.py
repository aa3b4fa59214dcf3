"""Fitting for benchmarks/flydsl_model.py: the model's constants from aiter's published stage timings,
each stage modelled with aiter's kernel at the tile its row names; the held-out check, the second
and joint fits; the constant sets behind every ratio's sensitivity band.
"""
from __future__ import annotations

import sys
from dataclasses import asdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import flydsl_model_data as aiter_rows  # noqa: E402
from flydsl_model import OLD_CONSTANTS, SWING, peer_launches, peer_pair  # noqa: E402

from k3lab.flydsl import isa_model  # noqa: E402
from k3lab.flydsl.isa_model import Launch, Params  # noqa: E402


def observations(rows, peer: dict) -> list[tuple[Launch, object, float, str]]:
    """(launch, device, aiter's measured us, label) of every stage of `rows` whose kernel compiled."""
    obs = []
    for tokens, tile1, us1, tile2, us2 in rows:
        specs = peer_pair(tile1, tile2)
        if all(s.key in peer for s in specs):
            for launch, measured in zip(peer_launches(tokens, specs, peer), (us1, us2), strict=True):
                obs.append((launch, isa_model.MI355X, measured, f"{tokens} tokens {launch.label}"))
    return obs


def rms(obs, params: Params) -> float:
    return isa_model.rms_log_error([isa_model.launch_time(x, d, params).us for x, d, _, _ in obs],
                                   [m for _, _, m, _ in obs])


def fit(obs, hold: str | None = None, value: float | None = None) -> tuple[Params, float]:
    """Grid fit of (T0, L, eta) on `obs`; `hold` ("latency_ns" or "eta") pins that one at `value`."""
    ranges = {}
    if hold == "latency_ns":
        ranges["latency"] = (value, value, 25.0)
    elif hold == "eta":
        ranges["eta"] = (value, value, 0.01)
    return isa_model.fit([(x, d, m) for x, d, m, _ in obs], **ranges)


def fit_report(peer: dict) -> dict:
    """The fit on all 16 pre-retune rows, its error on the 5 rows quoted before, the earlier constants'
    error at the same tiles, the PR 5118 rows held out, a second fit on them and one on both."""
    pre, held = observations(aiter_rows.PRE_RETUNE, peer), observations(aiter_rows.RETUNE_5118, peer)
    if len(pre) < 8:
        raise RuntimeError(f"only {len(pre)} of aiter's pre-retune stage timings have a compiled kernel")
    five = [o for o in pre if int(o[3].split()[0]) in (1, 16, 128, 1024, 16384)]
    params, err = fit(pre)
    report = {"params": asdict(params), "stages_fitted": len(pre), "rms_pre_retune": err,
              "rms_pre_retune_5_rows": rms(five, params),
              "old_constants": asdict(OLD_CONSTANTS), "rms_old_constants": rms(pre, OLD_CONSTANTS),
              "rms_old_constants_5_rows": rms(five, OLD_CONSTANTS),
              "fit_detail": [(label, m, round(isa_model.launch_time(x, d, params).us, 1)) for x, d, m, label in pre]}
    if held:
        retune_params, retune_err = fit(held)
        joint_params, joint_err = fit(pre + held)
        report.update({"stages_held_out": len(held), "rms_held_out": rms(held, params),
                       "retune_params": asdict(retune_params), "rms_retune_fit": retune_err,
                       "rms_pre_retune_with_retune_fit": rms(pre, retune_params),
                       "joint_params": asdict(joint_params), "rms_joint_fit": joint_err,
                       "held_out_detail": [(label, m, round(isa_model.launch_time(x, d, params).us, 1))
                                           for x, d, m, label in held]})
    return report


def sensitivity_params(params: Params, peer_obs) -> dict[str, Params]:
    """The central constants and, for L and eta each moved by -+SWING, the constants with the other
    two refitted on the pre-retune rows (held instead where aiter's kernels are absent)."""
    sets = {"central": params}
    for name in ("latency_ns", "eta"):
        for sign, tag in ((-1, "-"), (1, "+")):
            value = round(getattr(params, name) * (1 + sign * SWING), 4)
            key = f"{'L' if name == 'latency_ns' else 'eta'} {tag}{SWING:.0%}"
            if peer_obs:
                sets[key] = fit(peer_obs, hold=name, value=value)[0]
            else:
                sets[key] = Params(**{**asdict(params), name: value})
    return sets


def print_fit(report: dict | None, params: Params, sets: dict) -> None:
    if report is None:
        print(f"model constants: T0 {params.t0_us} us, L {params.latency_ns} ns, eta {params.eta} "
              "(the last fit; aiter's kernels absent, nothing fitted now)")
    else:
        print(f"model constants: T0 {params.t0_us} us, L {params.latency_ns} ns, eta {params.eta}, fitted on "
              f"{report['stages_fitted']} stage timings of aiter's pre-retune a16w4 rows at the tiles they name "
              f"({aiter_rows.SOURCES['pre_retune']})")
        print(f"  fit error (RMS log): {report['rms_pre_retune']:.1%} on all 16 rows, "
              f"{report['rms_pre_retune_5_rows']:.1%} on the 1/16/128/1024/16384-token rows")
        o = report["old_constants"]
        print(f"  the earlier constants (T0 {o['t0_us']}, L {o['latency_ns']}, eta {o['eta']}) at these tiles: "
              f"{report['rms_old_constants']:.1%} (16 rows), {report['rms_old_constants_5_rows']:.1%} (5 rows)")
        for label, m, mod in report["fit_detail"]:
            print(f"    fit: {label}: aiter measured {m:.1f} us, model {mod} us")
        if "rms_held_out" in report:
            r, j = report["retune_params"], report["joint_params"]
            print(f"  held out, aiter PR 5118's retune ({report['stages_held_out']} stage timings, "
                  f"{aiter_rows.SOURCES['retune_5118']}): {report['rms_held_out']:.1%}")
            print(f"  second fit on the retune alone: T0 {r['t0_us']}, L {r['latency_ns']}, eta {r['eta']}: "
                  f"{report['rms_retune_fit']:.1%} there, {report['rms_pre_retune_with_retune_fit']:.1%} on the "
                  f"pre-retune rows; one fit on both: T0 {j['t0_us']}, L {j['latency_ns']}, eta {j['eta']}: "
                  f"{report['rms_joint_fit']:.1%}")
            for label, m, mod in report["held_out_detail"]:
                print(f"    held out: {label}: aiter measured {m:.1f} us, model {mod} us")
    how = "the other two refitted on the pre-retune rows" if report else "the others held"
    print(f"bands: every ratio's low-high over L and eta each moved -+{SWING:.0%} ({how}):")
    for key, p in sets.items():
        print(f"  {key}: T0 {p.t0_us} us, L {p.latency_ns} ns, eta {p.eta}")
