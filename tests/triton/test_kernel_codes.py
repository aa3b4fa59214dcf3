"""The stage kernels' combined constexprs: WEIGHTS (weight_codes.py), stage 1's OUT_ORDER (korder.py),
PATH and BLOCK_ROWS (stage1.row_tile_args), as the launches carry them."""
import inspect
from itertools import product

import pytest
import triton.language as tl

from kimi_k3_moe.activation import ActivationSpec
from kimi_k3_moe.experts import INT4, MXFP4
from kimi_k3_moe.kernels.triton import table as tt
from kimi_k3_moe.kernels.triton._details import constants as C
from kimi_k3_moe.kernels.triton._details.gemv_kernels import stage1_gemv_kernel, stage2_gemv_kernel
from kimi_k3_moe.kernels.triton._details.matmul_kernels import stage1_aligned_kernel, stage2_aligned_kernel
from kimi_k3_moe.kernels.triton.aot import meta_experts, plan_for_shape
from kimi_k3_moe.kernels.triton.table import KernelConfig, KOrder, MoEConfig
from kimi_k3_moe.kernels.triton.weight_codes import decode_code, weights_code, weights_of

DECODERS = (C.DECODE_BITS, C.DECODE_PTX, C.DECODE_PTX_WIDE)
SITU = ActivationSpec("situv2", 4.0, 25.0)


def test_every_weights_code_round_trips():
    assert [weights_code(*weights_of(code)) for code in range(len(C.WEIGHTS))] == list(range(len(C.WEIGHTS)))
    assert weights_of(C.W_MXFP4_PTX_WIDE) == (MXFP4, C.DECODE_PTX_WIDE, False)
    assert weights_of(C.W_INT4_OFFSETS_BITS) == (INT4, C.DECODE_BITS, True)


def test_an_impossible_weights_combination_is_refused_in_one_line():
    """Seven of the twelve (format, decoder, offsets) combinations have a code: the wide PTX decoder
    is MXFP4's (a scale above 2), offsets int4's; the rest are refused, naming the values."""
    valid = {weights_of(code) for code in range(len(C.WEIGHTS))}
    refused = [c for c in product((MXFP4, INT4), DECODERS, (False, True)) if c not in valid]
    assert len(valid) == 7 and len(refused) == 5
    for weight_format, decode, offsets in refused:
        with pytest.raises(ValueError) as err:
            weights_code(weight_format, decode, offsets)
        msg = str(err.value)
        assert "\n" not in msg and repr(weight_format) in msg and f"offsets={offsets}" in msg, msg
    with pytest.raises(ValueError, match="'int4' weights with decoder 'ptx-wide' and offsets=False"):
        weights_code(INT4, decode_code("ptx", True), False)
    with pytest.raises(ValueError, match="'fp8'"):
        weights_code("fp8", C.DECODE_BITS, False)


def _stage_args(cfg: MoEConfig, weight_format=MXFP4, offsets=False, expert_map=False, wide=False) -> dict:
    experts = meta_experts(weight_format, 8, 256, 128, offsets=offsets)
    experts.wide_scales = wide
    plan = plan_for_shape(experts, 4, 2, SITU, cfg.validate(256, 128), expert_map=expert_map)
    return {launch.label: launch.args for launch in plan if launch.label.split(".")[-1] in ("aligned", "gemv")}


ALIGNED = MoEConfig("aligned", 96, KernelConfig(32, 64, order=KOrder.STACKED),
                    KernelConfig(64, 128, order=KOrder.WORDS), "ptx")
DIRECT = MoEConfig("direct", 16, KernelConfig(32, 64, order=KOrder.STACKED),
                   KernelConfig(64, 64, order=KOrder.PAIRS), "bits")
GEMV = tt.heuristic_config(256, 128, 1, is_cuda=True)


@pytest.mark.parametrize("cfg", [ALIGNED, DIRECT, GEMV], ids=["aligned", "direct", "gemv"])
@pytest.mark.parametrize("weight_format, offsets, wide", [(MXFP4, False, False), (MXFP4, False, True),
                                                           (INT4, False, False), (INT4, True, False)])
def test_every_stage_launch_carries_the_weights_code(cfg, weight_format, offsets, wide):
    args = _stage_args(cfg, weight_format, offsets, wide=wide)
    assert len(args) == 2
    for a in args.values():
        assert weights_of(a["WEIGHTS"]) == (weight_format, decode_code(cfg.decode, wide), offsets)
        assert not {"FMT", "DECODE", "HAS_OFFSETS"} & set(a)


def test_row_blocks_and_inter_order_are_one_constexpr_each():
    """BLOCK_ROWS is the config's block_m (the kernels split off the tail tile); PATH says whether a
    block is one pair and its expert is read through the map; OUT_ORDER names pair or plain order by
    its code and the word order by its block_k."""
    aligned = _stage_args(ALIGNED, expert_map=True)
    assert aligned["stage1.aligned"]["BLOCK_ROWS"] == 96 and aligned["stage1.aligned"]["PATH"] == C.PATH_ALIGNED
    assert aligned["stage1.aligned"]["OUT_ORDER"] == 128  # stage 2 reads words of 128-wide tiles
    assert _stage_args(DIRECT)["stage1.aligned"]["PATH"] == C.PATH_DIRECT
    direct = _stage_args(DIRECT, expert_map=True)
    assert {a["PATH"] for a in direct.values()} == {C.PATH_DIRECT_MAP}
    assert direct["stage1.aligned"]["OUT_ORDER"] == C.ORDER_PAIRS
    plain = MoEConfig("direct", 16, DIRECT.stage1, KernelConfig(64, 64, order=KOrder.INTERLEAVE), "bits")
    assert _stage_args(plain)["stage1.aligned"]["OUT_ORDER"] == C.ORDER_INTERLEAVE


@pytest.mark.parametrize("kernel", [stage1_aligned_kernel, stage2_aligned_kernel, stage1_gemv_kernel,
                                    stage2_gemv_kernel])
def test_stage_kernels_take_at_most_twelve_constexprs(kernel):
    params = inspect.signature(kernel.fn).parameters.values()  # the interpreter's wrapper has no .params
    assert sum(p.annotation is tl.constexpr for p in params) <= 12
