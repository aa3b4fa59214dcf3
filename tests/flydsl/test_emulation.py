"""The kernels' address logic played on the CPU, through the backend's own forward pass.

This stands in for running the FlyDSL kernels (no AMD GPU here): `emulator.launch`
evaluates the index and decode functions the kernels call at trace time, gathers
the bytes each lane would load from the packed weights, computes the tiles in
torch and stores them where the kernel would. It checks addressing, layout,
decode formulas and the surrounding pipeline, not FlyDSL's code generation or the
hardware's instruction semantics (the load-time self-check covers those).

Bounds: against the float reference on the same (prepared) weights, relative L2 <
1.5e-2 (bf16 activations, bf16 weights on gfx942's int4 path, bf16 intermediate
and slot outputs; measured 2e-3..4e-3). Against a reference rounding at exactly
the kernels' points, < 1e-3 (measured 1e-5..1.5e-4: summation order flips a few
bf16 roundings). A single mis-addressed scale group, row or lane moves the second
figure by far more than that (test_wrong_indices_are_caught).
"""
from __future__ import annotations

import json
from dataclasses import replace
from importlib import resources

import pytest
import torch

from fly_helpers import SILU, SITU, random_layer, random_routing, with_offsets
from kimi_k3_moe.activation import ActivationSpec
from kimi_k3_moe.kernels.flydsl import emulator, layout, pipeline, tiles
from kimi_k3_moe.kernels.flydsl.backend import FlyDSLBackend
from kimi_k3_moe.reference import dense_moe, relative_l2
from kimi_k3_moe.weights.requant import requantize_experts

REF_BOUND = 1.5e-2
FAITHFUL_BOUND = 1e-3
E, H, I, T, K = 6, 256, 128, 40, 4


def raw_tiers(arch):
    data = json.loads(resources.files("kimi_k3_moe.configs").joinpath("tables", tiles.TABLE).read_text())
    return data[arch]


def only_tier(arch, index):
    """A table whose single tier is the real table's tier `index`: reaches its tiles at any token count."""
    return tiles.load_table({arch: [{**raw_tiers(arch)[index], "max_tokens": None}]})


def prepared_layer(gen, arch, *, offsets=False, inter=I, experts=E):
    layer = random_layer(gen, experts=experts, hidden=H, inter=inter)
    backend = FlyDSLBackend(arch=arch)
    if arch == "gfx942":
        int4 = requantize_experts(layer, progress=False)
        return backend.prepare(with_offsets(gen, int4) if offsets else int4)
    return backend.prepare(layer)


def float_reference(prep, x, tw, ids, act, expert_map=None):
    w = {}

    def weights(e):
        if e not in w:
            w[e] = prep.dequantize(e)
        return w[e]
    return dense_moe(x, lambda e: weights(e)[0], lambda e: weights(e)[1], tw, ids, act, expert_map)


def faithful_reference(prep, x, tw, ids, act, reduce):
    """Rounds where the kernels round: bf16 weights, bf16 intermediate, bf16 slot outputs."""
    out = torch.zeros(x.shape[0], prep.hidden_size)
    for e in range(prep.num_experts):
        t, s = torch.nonzero(ids == e, as_tuple=True)
        w13, w2 = (w.to(torch.bfloat16).float() for w in prep.dequantize(e))
        inter = act.apply(x[t].float() @ w13.T).to(torch.bfloat16).float()
        y = (inter @ w2.T) * tw[t, s, None]
        out.index_add_(0, t, y.to(torch.bfloat16).float() if reduce == "slots" else y)
    return out


def emulate(prep, arch, x, tw, ids, act, **kw):
    return pipeline.moe_forward(prep, x, tw, ids, act, kw.pop("expert_map", None), arch=arch,
                                launch=emulator.launch, **kw)


def check(prep, arch, x, tw, ids, act, reduce="slots", **kw):
    out = emulate(prep, arch, x, tw, ids, act, reduce=reduce, **kw)
    err = relative_l2(out, float_reference(prep, x, tw, ids, act))
    err_faithful = relative_l2(out, faithful_reference(prep, x, tw, ids, act, reduce))
    print(f"{arch} {act} reduce={reduce}: rel L2 vs float reference {err:.2e}, vs kernel-rounding reference "
          f"{err_faithful:.2e}")
    assert err < REF_BOUND and err_faithful < FAITHFUL_BOUND
    return out


# ------------------------------------------------------------------ every tile of the table
@pytest.mark.parametrize("tier", [0, 1, 2, 3])
@pytest.mark.parametrize("arch", ["gfx942", "gfx950"])
def test_every_table_tile_matches_the_reference(gen, arch, tier):
    prep = prepared_layer(gen, arch)
    x, tw, ids = random_routing(gen, T, E, K, H)
    check(prep, arch, x, tw, ids, SITU, table=only_tier(arch, tier))
    if raw_tiers(arch)[tier].get("direct"):   # int64 ids take the aligned layout with the same tiles
        check(prep, arch, x, tw, ids.long(), SITU, table=only_tier(arch, tier))


def direct_table(arch):
    return only_tier(arch, next(i for i, t in enumerate(raw_tiers(arch)) if t.get("direct")))


# the forward's own PyTorch calls may allocate and view, nothing else: no fill, copy, sort or arithmetic
ALLOCATE_OR_VIEW = {"aten::empty", "aten::empty_like", "aten::empty_strided", "aten::view", "aten::reshape",
                    "aten::_reshape_alias", "aten::slice", "aten::select", "aten::as_strided", "aten::to",
                    "aten::contiguous", "aten::alias", "aten::unsqueeze", "aten::expand", "aten::detach"}


class LaunchRecorder:
    """One forward's launches, recorded and not run: the FlyDSL stages through `launch`, the Triton
    glue through Launch.__call__."""

    def __init__(self, monkeypatch):
        from kimi_k3_moe.kernels.triton import launch as triton_launch
        self.labels = []
        monkeypatch.setattr(triton_launch.Launch, "__call__", lambda launch: self.labels.append(launch.label))

    def flydsl(self, cfg, args):
        self.labels.append(cfg.name)


@pytest.mark.parametrize("arch", ["gfx942", "gfx950"])
@pytest.mark.parametrize("tokens", [1, 3, 16, 40])
def test_a_forward_is_three_launches_direct_four_up_to_16_tokens_and_seven_above(gen, arch, tokens, monkeypatch):
    prep = prepared_layer(gen, arch)
    x, tw, ids = random_routing(gen, tokens, E, K, H)
    x = x.to(torch.bfloat16)
    assert relative_l2(emulate(prep, arch, x, tw, ids, SITU).float(),
                       float_reference(prep, x.float(), tw, ids, SITU)) < REF_BOUND
    rec = LaunchRecorder(monkeypatch)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        pipeline.moe_forward(prep, x, tw, ids, SITU, None, arch=arch, launch=rec.flydsl)
    direct = tokens <= next(t["max_tokens"] for t in raw_tiers(arch) if t.get("direct"))
    want = ([] if direct else ["align.small"] if tokens * K <= 256 else
            ["align.zero", "align.count", "align.offsets", "align.scatter"])
    assert rec.labels[:len(want)] == want and len(rec.labels) == len(want) + 3, rec.labels
    assert rec.labels[-1] == "stage2.reduce"
    ops = {e.name for e in prof.events() if e.name.startswith("aten::")}
    assert ops <= ALLOCATE_OR_VIEW, ops - ALLOCATE_OR_VIEW


@pytest.mark.parametrize("layout_", ["direct", "aligned"])
@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_expert_ids_out_of_range_contribute_nothing_and_read_nothing(gen, layout_, dtype):
    """Ids E, -1, 10^6 (and 2^32 + 1 as int64) are pairs on no rank: no kernel reads an expert for them
    (the emulator's buffers refuse any read past W) and the result is the reference without them."""
    prep = prepared_layer(gen, "gfx950")
    tokens = 3 if layout_ == "direct" else T
    x, tw, ids = random_routing(gen, tokens, E, K, H)
    ids = ids.to(dtype)
    wild = [E, -1, 10**6] + ([2**32 + 1] if dtype == torch.int64 else [])
    bad = torch.zeros(ids.shape, dtype=torch.bool)
    bad[torch.arange(tokens), torch.randint(0, K, (tokens,), generator=gen)] = True
    ids[bad] = torch.tensor(wild, dtype=dtype)[torch.randint(0, len(wild), (tokens,), generator=gen)]
    table = direct_table("gfx950") if layout_ == "direct" else only_tier("gfx950", 1)
    out = emulate(prep, "gfx950", x, tw, ids, SITU, table=table)
    kept_tw = torch.where(bad, torch.zeros_like(tw), tw)
    ref = float_reference(prep, x, kept_tw, torch.where(bad, torch.zeros_like(ids), ids), SITU)
    assert torch.isfinite(out).all() and relative_l2(out, ref) < REF_BOUND


# ------------------------------------------------------------------ the check has teeth
def _shifted_group(row, kb, g, K, _orig=layout.group_index):
    return _orig(row, kb, (g + 1) & 3, K)          # each lane reads its neighbour's scale


def _transposed_d(g, r, e, _orig=layout.d_row_col):
    i, c = _orig(g, r, e)
    return c, i                                     # wrong MFMA output layout


def _swapped_gate_up(n_col, is_up, N, _orig=layout.gate_up_row):
    return _orig(n_col, 1 - is_up, N)


def _token_for_slot_off_by_one(slot, top_k, _orig=layout.slot_token):
    return _orig(slot + 1, top_k)


@pytest.mark.parametrize("name, wrong", [("group_index", _shifted_group), ("d_row_col", _transposed_d),
                                         ("gate_up_row", _swapped_gate_up), ("slot_token", _token_for_slot_off_by_one)])
def test_wrong_indices_are_caught(gen, monkeypatch, name, wrong):
    prep = prepared_layer(gen, "gfx942")
    x, tw, ids = random_routing(gen, T, E, K, H)
    good = emulate(prep, "gfx942", x, tw, ids, SITU)
    monkeypatch.setattr(layout, name, wrong)
    try:
        bad = emulate(prep, "gfx942", x, tw, ids, SITU)
    except emulator.EmulatorError:
        return
    assert relative_l2(bad, good) > 10 * FAITHFUL_BOUND


def test_out_of_bounds_reads_are_reported(gen):
    prep = prepared_layer(gen, "gfx950")
    x, tw, ids = random_routing(gen, 3, E, K, H)
    ids[:, 0] = E - 1                                    # touch the last expert: its last bytes get read

    def one_byte_short(cfg, args):                       # W one byte shorter than the layer
        args = list(args)
        args[1] = args[1][:-1]
        emulator.launch(cfg, tuple(args))

    with pytest.raises(emulator.EmulatorError, match="W: access up to byte"):
        pipeline.moe_forward(prep, x, tw, ids, SITU, None, arch="gfx950", launch=one_byte_short)
