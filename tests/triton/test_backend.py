"""The whole Triton backend under the interpreter, against the float64 reference.

The reference runs on the weights the prepared form encodes (`dequantize_prepared`):
MXFP4 is the checkpoint itself, int4 the converted weights. Bounds: bf16
activations, intermediate and output land near 3e-3 (5e-3 for int4, whose
decoded weights are rounded to bf16); a wrong layout or activation lands
far above 1e-2.
"""

from dataclasses import replace

import pytest
import torch
import triton_problems as P
from moe_helpers import SITU

from kimi_k3_moe.activation import ActivationSpec
from kimi_k3_moe.experts import Int4Experts
from kimi_k3_moe.formats import int4
from kimi_k3_moe.kernels import get_backend
from kimi_k3_moe.kernels.triton.backend import TritonBackend
from kimi_k3_moe.kernels.triton.table import KernelConfig, KOrder, MoEConfig
from kimi_k3_moe.reference import relative_l2
from kimi_k3_moe.weights.requant import requantize_experts

SILU = ActivationSpec.silu()
TOL = 1e-2

GEMV, ALIGNED, ALIGNED_NOSWAP = P.GEMV, P.ALIGNED, P.ALIGNED_NOSWAP
ALIGNED_WORDDOTS = MoEConfig("aligned", 16, KernelConfig(64, 128, 4, 2, swap=True, order=KOrder.WORDS),
                             KernelConfig(64, 64, 4, 2, swap=False), "bits")
ALIGNED_PAIRS = MoEConfig("aligned", 16, KernelConfig(64, 64, 4, 2, swap=True, order=KOrder.PAIRS),
                          KernelConfig(64, 64, 4, 2, swap=True, order=KOrder.PAIRS), "bits")
ALIGNED_PAIRS_NOSWAP = replace(ALIGNED_PAIRS, block_m=32, stage1=replace(ALIGNED_PAIRS.stage1, swap=False),
                               stage2=replace(ALIGNED_PAIRS.stage2, swap=False, block_k=32))
# a pair-order stage beside an interleaving one (stage 1 writes what stage 2 reads)
ALIGNED_PAIRS_MIXED = replace(ALIGNED_PAIRS, stage2=ALIGNED.stage2)
ALIGNED_MIXED_PAIRS = replace(ALIGNED_PAIRS, stage1=ALIGNED_WORDDOTS.stage1)
# gate and up rows stacked in one tile (one dot per K step)
ALIGNED_STACKED = replace(ALIGNED_PAIRS, block_m=32, stage1=replace(ALIGNED_PAIRS.stage1, block_n=32, num_warps=8,
                                                                    order=KOrder.STACKED))
ALIGNED_STACKED_NOSWAP = replace(ALIGNED_PAIRS_NOSWAP,
                                 stage1=replace(ALIGNED_PAIRS_NOSWAP.stage1, order=KOrder.STACKED))
# stage 2 taking several N tiles per program (K unrolled): 3 tiles of 32 over H = 128, so the second
# program's last two tiles lie past H; two K steps of 32 over I = 64
ALIGNED_S2_TILES = replace(ALIGNED_PAIRS, stage2=replace(ALIGNED_PAIRS.stage2, block_n=32, block_k=32, n_tiles=3))
# the same reading inter in plain order (stage 1 stores it so) and swapping it into pair order in registers
ALIGNED_S2_TILES_PLAIN = replace(ALIGNED_S2_TILES, stage2=replace(ALIGNED_S2_TILES.stage2, order=KOrder.PLAIN_INTER))
ALIGNED_NOSWAP_S2_TILES = replace(ALIGNED_NOSWAP, stage2=replace(ALIGNED_NOSWAP.stage2, block_n=32, block_k=32,
                                                                  n_tiles=3))
ALIGNED_PAIRS_NOSWAP_S2_TILES = replace(ALIGNED_PAIRS_NOSWAP, stage2=replace(ALIGNED_PAIRS_NOSWAP.stage2, block_n=32,
                                                                              n_tiles=3))
# a 16-wide stage-1 tile cannot swap whole 32-groups in registers: it scatters in pair order
ALIGNED_PAIRS_N16 = replace(ALIGNED_PAIRS, stage1=replace(ALIGNED_PAIRS.stage1, block_n=16))
# every pair a block of its own (no alignment launches), stacked gate/up and N tiles as on the H200;
# pdl=True is turned off off NVIDIA sm_90+ (here: the interpreter)
DIRECT = MoEConfig("direct", 16, KernelConfig(32, 64, 4, 2, order=KOrder.STACKED),
                   KernelConfig(32, 32, 4, 2, order=KOrder.PAIRS, n_tiles=2), "bits", pdl=True)
DIRECT_INTERLEAVE = replace(ALIGNED, path="direct")
PATHS = {"gemv": GEMV, "direct": DIRECT, "direct-interleave": DIRECT_INTERLEAVE,
         "aligned": ALIGNED, "aligned-noswap": ALIGNED_NOSWAP, "aligned-worddots": ALIGNED_WORDDOTS,
         "aligned-pairs": ALIGNED_PAIRS, "aligned-pairs-noswap": ALIGNED_PAIRS_NOSWAP,
         "aligned-pairs-then-interleave": ALIGNED_PAIRS_MIXED, "aligned-worddots-then-pairs": ALIGNED_MIXED_PAIRS,
         "aligned-stacked": ALIGNED_STACKED, "aligned-stacked-noswap": ALIGNED_STACKED_NOSWAP,
         "aligned-s2-tiles": ALIGNED_S2_TILES, "aligned-noswap-s2-tiles": ALIGNED_NOSWAP_S2_TILES,
         "aligned-pairs-noswap-s2-tiles": ALIGNED_PAIRS_NOSWAP_S2_TILES, "aligned-pairs-n16": ALIGNED_PAIRS_N16,
         "aligned-s2-tiles-plain-inter": ALIGNED_S2_TILES_PLAIN}


run = P.run


def assert_follows_the_activation(backend, prepared, hidden, weights, ids, what):
    """SiTUv2 and SiLU each match the reference within TOL, and the two results differ."""
    outs = {}
    for act in (SITU, SILU):
        outs[act.name] = run(backend, prepared, hidden, weights, ids, act)
        err = relative_l2(outs[act.name], P.reference(backend, prepared, hidden, weights, ids, act))
        assert err < TOL, f"{what} {act}: relative L2 {err:.3g}"
    assert relative_l2(outs["silu"], outs["situv2"].float()) > 0.05


@pytest.fixture(scope="module")
def problem(module_gen):
    gen = module_gen
    ex = P.experts(gen)
    return ex, requantize_experts(ex, progress=False), gen


@pytest.mark.parametrize("weight_format", ["mxfp4", "int4"])
@pytest.mark.parametrize("path", sorted(PATHS))
def test_matches_reference_and_honours_the_activation(weight_format, path, problem):
    """Every path and format computes SiTUv2 (and SiLU) to the reference; the two results differ."""
    ex, conv, gen = problem
    backend = get_backend("triton", weight_format=weight_format, config=PATHS[path])
    prepared = backend.prepare(ex if weight_format == "mxfp4" else conv)
    hidden = P.hidden(gen, 4)
    weights, ids = P.routing(gen, 4)
    assert_follows_the_activation(backend, prepared, hidden, weights, ids, f"{weight_format} {path}")


@pytest.mark.parametrize("n_tiles", [1, 3])
def test_stage2_word_dots(n_tiles, gen):
    """Stage 2 with eight word-strided dots needs I >= 128: its own, slightly larger problem; with
    3 N tiles of 64 per program over H = 128 the first program's last tile lies past H."""
    ex = P.experts(gen, i=128)
    cfg = MoEConfig("aligned", 32, KernelConfig(64, 128, 4, 2, swap=False, order=KOrder.WORDS),
                    KernelConfig(64, 128, 4, 2, swap=True, order=KOrder.WORDS, n_tiles=n_tiles), "bits")
    backend = get_backend("triton", config=cfg)
    prepared = backend.prepare(ex)
    hidden = P.hidden(gen, 3)
    weights, ids = P.routing(gen, 3)
    out = run(backend, prepared, hidden, weights, ids, SITU)
    assert relative_l2(out, P.reference(backend, prepared, hidden, weights, ids, SITU)) < TOL


def test_betas_are_honoured(problem):
    ex, _, gen = problem
    backend = get_backend("triton", config=ALIGNED)
    prepared = backend.prepare(ex)
    hidden = P.hidden(gen, 4)
    weights, ids = P.routing(gen, 4)
    outs = []
    for act in (SITU, ActivationSpec.situv2(2.0, 1.5),
                ActivationSpec.situv2(4.0, None)):
        out = run(backend, prepared, hidden, weights, ids, act)
        assert relative_l2(out, P.reference(backend, prepared, hidden, weights, ids, act)) < TOL, act
        outs.append(out)
    assert relative_l2(outs[0], outs[1].float()) > 0.05
    assert relative_l2(outs[0], outs[2].float()) > 1e-3


@pytest.mark.parametrize("path", ["gemv", "direct", "aligned", "aligned-pairs", "aligned-stacked",
                                  "aligned-s2-tiles"])
def test_expert_map_skips_experts_of_other_ranks(path, problem):
    ex, _, gen = problem
    backend = get_backend("triton", config=PATHS[path])
    local = [1, 4, 5]  # global ids held here; global space of 9 experts
    prepared = backend.prepare(ex.select(local))
    emap = torch.full((9,), -1, dtype=torch.int32)
    emap[torch.tensor([2, 3, 7])] = torch.arange(3, dtype=torch.int32)
    hidden = P.hidden(gen, 5)
    weights, ids = P.routing(gen, 5, e=9)
    out = run(backend, prepared, hidden, weights, ids, SITU, emap)
    assert relative_l2(out, P.reference(backend, prepared, hidden, weights, ids, SITU, emap)) < TOL


@pytest.mark.parametrize("path", ["aligned", "aligned-pairs"])
def test_int4_offsets_and_preconverted_experts(path, problem):
    ex, conv, gen = problem
    off = Int4Experts(*(int4.Int4Weights(w.packed, w.scales, "asym",
                                         (torch.randn(w.scales.shape, generator=gen) * 0.02).bfloat16())
                        for w in (conv.w13, conv.w2)))
    backend = get_backend("triton", weight_format="int4", int4_method="asym", config=PATHS[path])
    prepared = backend.prepare(off)
    assert prepared.has_offsets
    hidden = P.hidden(gen, 4)
    weights, ids = P.routing(gen, 4)
    out = run(backend, prepared, hidden, weights, ids, SITU)
    assert relative_l2(out, P.reference(backend, prepared, hidden, weights, ids, SITU)) < TOL
    symmetric = get_backend("triton", weight_format="int4", config=ALIGNED)
    plain = run(symmetric, symmetric.prepare(conv), hidden, weights, ids, SITU)
    assert relative_l2(out, plain.float()) > 1e-3  # the offsets were applied
    with pytest.raises(ValueError, match="int4 method 'search'.*configured for 'asym'"):
        backend.prepare(conv)  # methods are never mixed silently
    with pytest.raises(ValueError, match="weight_format"):
        get_backend("triton").prepare(conv)


def test_repeatable_chunked_and_input_dtypes(problem):
    ex, _, gen = problem
    backend = get_backend("triton", config=ALIGNED)
    prepared = backend.prepare(ex)
    hidden = P.hidden(gen, 5)
    weights, ids = P.routing(gen, 5)
    first = run(backend, prepared, hidden, weights, ids, SITU)
    assert torch.equal(first, run(backend, prepared, hidden, weights, ids, SITU))
    chunked = TritonBackend(config=ALIGNED, chunk_tokens=2)
    assert torch.equal(first, run(chunked, prepared, hidden, weights, ids, SITU))
    for dtype in (torch.float16, torch.float32):
        out = run(backend, prepared, hidden.to(dtype), weights, ids.long(), SITU)
        assert out.dtype == dtype and relative_l2(out, first.float()) < 5e-3
    empty = backend.forward(prepared, hidden[:0], weights[:0], ids[:0], SITU)
    assert empty.shape == (0, P.H)


def test_default_config_lookup_runs(problem):
    """No pinned config: the heuristic (no table for the interpreter) picks gemv or aligned by size."""
    ex, _, gen = problem
    backend = get_backend("triton")
    prepared = backend.prepare(ex)
    assert backend.lookup(prepared, 1).config.path == "gemv"
    assert backend.lookup(prepared, 100).config.path == "aligned"
    assert backend.lookup(prepared, 1).config.decode == "bits"  # no PTX off NVIDIA
    hidden = P.hidden(gen, 2)
    weights, ids = P.routing(gen, 2)
    out = run(backend, prepared, hidden, weights, ids, SITU)
    assert relative_l2(out, P.reference(backend, prepared, hidden, weights, ids, SITU)) < TOL


def test_bad_inputs_are_named(problem):
    ex, _, gen = problem
    backend = get_backend("triton", config=ALIGNED)
    prepared = backend.prepare(ex)
    hidden = P.hidden(gen, 3)
    weights, ids = P.routing(gen, 3)
    with pytest.raises(ValueError, match="hidden has 64 columns; the experts take hidden size 128"):
        backend.forward(prepared, hidden[:, :64], weights, ids, SITU)
    with pytest.raises(TypeError, match="ActivationSpec"):
        backend.forward(prepared, hidden, weights, ids, "situ")
    with pytest.raises(TypeError, match="topk_weights"):
        backend.forward(prepared, hidden, ids, ids, SITU)
    with pytest.raises(ValueError, match="out must be"):
        backend.forward(prepared, hidden, weights, ids, SITU, out=torch.empty(3, 7))
    with pytest.raises(ValueError, match="weight_format"):
        get_backend("triton", weight_format="fp8")
    with pytest.raises(TypeError, match="Mxfp4Experts"):
        backend.prepare(object())


def test_prepare_says_once_when_a_layer_needs_the_two_multiply_decoder(gen, caplog):
    import logging

    from kimi_k3_moe.experts import Mxfp4Experts
    from kimi_k3_moe.kernels.triton import backend as triton_backend
    ex = P.experts(gen, e=2, h=128, i=64)
    scale = ex.w2_scale.clone()
    scale[0, 0, 0] = 200
    wide = Mxfp4Experts(ex.w13_packed, ex.w13_scale, ex.w2_packed, scale)
    triton_backend._log_wide_scales_once.cache_clear()
    backend = get_backend("triton", config=GEMV)
    with caplog.at_level(logging.INFO, logger=triton_backend.__name__):
        assert not backend.prepare(ex).wide_scales
        assert backend.prepare(wide).wide_scales and backend.prepare(wide).wide_scales
    assert sum("scale above 2" in r.getMessage() for r in caplog.records) == 1


def test_gemv_stage2_with_an_expert_map_takes_long_k_steps_and_skips_other_ranks(gen):
    """Under expert parallelism stage 2 of the small-batch path runs one local slot at a time with a
    K step grown up to SLOTS times (here 32 -> 128 = all of I), stage 1 writing inter in that word
    order; against the reference, with tokens whose slots are all on other ranks (output 0)."""
    from kimi_k3_moe.kernels.triton.stage2 import gemv_block_k
    cfg = MoEConfig("gemv", 16, KernelConfig(32, 128, 4, 2), KernelConfig(64, 32, 4, 2), "bits")
    assert gemv_block_k(cfg.stage2, 3, 128, torch.empty(1)) == 128 and gemv_block_k(cfg.stage2, 3, 128, None) == 32
    assert gemv_block_k(KernelConfig(8, 64, 4, 3), 16, 3072, torch.empty(1)) == 1024  # EP16's I
    assert gemv_block_k(KernelConfig(8, 64, 4, 3), 16, 384, torch.empty(1)) == 128    # TP8's I
    ex = P.experts(gen, e=4, h=128, i=128)
    backend = get_backend("triton", config=cfg)
    prepared = backend.prepare(ex)
    emap = torch.full((12,), -1, dtype=torch.int32)
    emap[torch.tensor([0, 5, 6, 11])] = torch.arange(4, dtype=torch.int32)
    weights, ids = P.routing(gen, 4, e=12, topk=3)
    ids[0] = torch.tensor([1, 2, 3], dtype=ids.dtype)  # no slot of token 0 is local
    hidden = P.hidden(gen, 4)
    for act in (SITU, ActivationSpec.silu()):
        out = P.run(backend, prepared, hidden, weights, ids, act, emap)
        assert torch.all(out[0] == 0)
        assert relative_l2(out, P.reference(backend, prepared, hidden, weights, ids, act, emap)) < TOL, act


# row blocks of a main and a tail tile (block_m 48 = 32 + 16): the tail is a second dot on the same
# decoded weights, so every order's K loop and both epilogues run on it
TAIL_PAIRS = replace(ALIGNED_PAIRS, block_m=48)
TAIL_STACKED = replace(ALIGNED_STACKED, block_m=48)
TAIL_INTERLEAVE = replace(ALIGNED, block_m=48)
TAIL_WORDDOTS = replace(ALIGNED_WORDDOTS, block_m=48, stage2=replace(ALIGNED_WORDDOTS.stage2, swap=True))
# each stage its own row blocks (a second alignment): a tail in stage 1 only, then in stage 2 only
SPLIT_S1_TAIL = replace(TAIL_STACKED, stage2=ALIGNED_NOSWAP.stage2, stage2_block_m=32)
SPLIT_S2_TAIL = replace(ALIGNED_PAIRS, block_m=16, stage2_block_m=48)
# stage 2 taking several N tiles per program on tail blocks: the tail's activations are loaded once
# beside the main tile's (pairs) or per step (interleave), and each tile's unrolled K runs both dots
TAIL_S2_TILES = replace(ALIGNED_S2_TILES, block_m=48)
TAIL_S2_TILES_PLAIN = replace(TAIL_S2_TILES, stage2=replace(TAIL_S2_TILES.stage2, order=KOrder.PLAIN_INTER))
TAIL_S2_TILES_INTERLEAVE = replace(TAIL_INTERLEAVE, stage2=replace(TAIL_INTERLEAVE.stage2, block_n=32, block_k=32,
                                                                   n_tiles=3))
TAILS = {"pairs": TAIL_PAIRS, "stacked": TAIL_STACKED, "interleave": TAIL_INTERLEAVE, "worddots": TAIL_WORDDOTS,
         "split-s1-tail": SPLIT_S1_TAIL, "split-s2-tail": SPLIT_S2_TAIL, "s2-tiles": TAIL_S2_TILES,
         "s2-tiles-plain-inter": TAIL_S2_TILES_PLAIN,
         "s2-tiles-interleave": TAIL_S2_TILES_INTERLEAVE}


def skewed_routing(gen, tokens=64):
    """Routing over the 6 experts, 3 slots, that gives expert 0 60 rows (a full block and a second
    with an empty tail), expert 1 40 and expert 2 46 (tails partly full), the others a few; tokens
    and slots in random order."""
    t = torch.arange(tokens)
    ids = torch.stack([torch.where(t < 60, 0, 3), torch.where(t < 40, 1, 4), torch.where(t < 46, 2, 5)], 1)
    ids = ids[torch.randperm(tokens, generator=gen)]
    ids = torch.gather(ids, 1, torch.argsort(torch.rand(tokens, 3, generator=gen), 1))
    weights = torch.rand(tokens, 3, generator=gen) + 0.05
    return weights / weights.sum(-1, keepdim=True), ids.to(torch.int32)


@pytest.mark.parametrize("weight_format", ["mxfp4", "int4"])
@pytest.mark.parametrize("order", sorted(TAILS))
def test_tail_tile_rows_match_the_reference(weight_format, order, problem):
    """A 32 + 16 row block: rows of the tail tile are computed, activated and stored like the main
    tile's (SiTUv2 and SiLU both to the reference, and different)."""
    ex, conv, gen = problem
    backend = get_backend("triton", weight_format=weight_format, config=TAILS[order])
    prepared = backend.prepare(ex if weight_format == "mxfp4" else conv)
    hidden = P.hidden(gen, 64)
    weights, ids = skewed_routing(gen)
    assert_follows_the_activation(backend, prepared, hidden, weights, ids, f"{weight_format} {order}")


@pytest.mark.parametrize("order", ["stacked", "split-s1-tail", "s2-tiles"])
def test_tail_tile_under_an_expert_map(order, problem):
    ex, _, gen = problem
    backend = get_backend("triton", config=TAILS[order])
    prepared = backend.prepare(ex.select([0, 1, 4]))
    emap = torch.full((P.E,), -1, dtype=torch.int32)
    emap[torch.tensor([0, 1, 4])] = torch.arange(3, dtype=torch.int32)
    hidden = P.hidden(gen, 64)
    weights, ids = skewed_routing(gen)
    out = run(backend, prepared, hidden, weights, ids, SITU, emap)
    assert relative_l2(out, P.reference(backend, prepared, hidden, weights, ids, SITU, emap)) < TOL


@pytest.mark.parametrize("emapped", [False, True], ids=["all-local", "expert-map"])
def test_gemv_steps_in_flight_change_no_bit(gen, emapped):
    """The small-batch path keeps num_stages K steps of weights in flight (1-4, the GEMV kernels' AHEAD):
    how far ahead the loads run changes no arithmetic, so every depth gives the same bits, with stage 1
    reading the layer input in plain order (fp32 input, rounded to bf16 as it is read) and K = 2 steps of
    128 (fewer steps than the deepest prefetch: the steps past the last re-read the last tile)."""
    ex = P.experts(gen, e=4, h=256, i=64)
    emap = None
    weights, ids = P.routing(gen, 3, e=4, topk=3)
    if emapped:
        emap = torch.full((8,), -1, dtype=torch.int32)
        emap[torch.tensor([1, 2, 5, 7])] = torch.arange(4, dtype=torch.int32)
        weights, ids = P.routing(gen, 3, e=8, topk=3)
    hidden = P.hidden(gen, 3, h=256).float()
    outs = []
    for ahead in (1, 4):
        cfg = MoEConfig("gemv", 16, KernelConfig(8, 128, 4, ahead), KernelConfig(16, 32, 4, ahead), "bits")
        backend = get_backend("triton", config=cfg)
        prepared = backend.prepare(ex)
        outs.append(P.run(backend, prepared, hidden, weights, ids, SITU, emap))
    assert all(torch.equal(outs[0], o) for o in outs[1:])
    ref = P.reference(backend, prepared, hidden.to(torch.bfloat16), weights, ids, SITU, emap)
    assert relative_l2(outs[0].float(), ref) < TOL
