"""aiter's published Kimi-K3 TP8 MoE timings (H 3584, I 384, 896 experts, top-16), the numbers
benchmarks/flydsl_model.py fits on and compares against. Read from ROCm/aiter's tuned tables
(`aiter/configs/model_configs/kimik3_*_tuned_fmoe.csv`, the rows with inter_dim 384) at the commits
named; each row keeps the tile part of the kernel names the table gives, because the model compiles
aiter's kernel at exactly that tile. Times in us, as aiter's tuner measured them (stage 1, stage 2;
its sorting launch is not in them). Nothing here was measured by this project.
"""
from __future__ import annotations

# (tokens, stage-1 tile, stage-1 us, stage-2 tile, stage-2 us)
# Pre-retune a16w4 (bf16 activations x MXFP4 weights), gfx950, cu_num 256:
# kimik3_fp4_tuned_fmoe.csv @ e4048607a5 (BM 32 at every token count). All 16 rows: the fit.
PRE_RETUNE = (
    (1, "t32x32x256_w4_xcd4_kw2", 15.2982, "t32x128x128_atomic_bnt2_xcd4", 11.4707),
    (2, "t32x32x128_w4_kw4", 20.2195, "t32x128x128_atomic_bnt2", 13.0957),
    (3, "t32x64x256_w3_kw2", 28.3426, "t32x128x128_atomic_bnt2_persist", 16.2238),
    (4, "t32x64x256_w4_xcd4_kw2", 29.0745, "t32x128x128_atomic_xcd4", 19.5449),
    (8, "t32x128x256_w3_xcd1", 40.3791, "t32x128x128_atomic_bnt2_persist", 27.1231),
    (16, "t32x128x128_w4_xcd4", 62.2511, "t32x128x128_atomic_bnt2_persist", 41.0317),
    (32, "t32x128x128_xcd4", 111.7066, "t32x128x128_atomic_bnt2", 64.8977),
    (64, "t32x128x256_w4_xcd4", 165.8161, "t32x128x128_atomic_bnt2_persist", 99.6472),
    (128, "t32x128x256_w4_xcd4", 209.8606, "t32x128x128_atomic_bnt2_persist", 128.4804),
    (256, "t32x128x128_xcd4", 226.7966, "t32x128x128_atomic_bnt2_xcd4_persist", 141.2989),
    (512, "t32x128x128_w3_xcd4", 230.5216, "t32x128x128_atomic_bnt2_persist", 150.8235),
    (1024, "t32x128x128_w2_xcd4", 243.1013, "t32x128x128_atomic_bnt2_persist", 164.3789),
    (2048, "t32x128x128_bnt0_xcd1", 362.3881, "t32x128x128_atomic_persist", 249.0055),
    (4096, "t32x128x128_w3_bnt0_xcd4", 534.9361, "t32x128x128_atomic_persist", 407.1955),
    (8192, "t32x128x128_bnt0_xcd1", 878.3311, "t32x128x128_atomic_persist", 765.2051),
    (16384, "t32x128x128_bnt0_xcd1", 1595.7209, "t32x128x128_atomic_persist", 1500.5861),
)

# aiter PR 5118's retune (kimik3_a16w4_tuned_fmoe.csv @ c1cb9c8a92): BM 16 up to 512 tokens. Its rows
# from 1024 tokens repeat the pre-retune timings (under other kernel names at 2048 and above), so
# only these 11 rows are new measurements: the held-out check and the second fit.
RETUNE_5118 = (
    (1, "t16x32x256_xcd4_kw2", 10.55, "t16x128x128_atomic_bnt2_xcd4", 7.02),
    (2, "t16x32x128_kw4", 13.02, "t16x128x128_atomic_bnt2", 7.2),
    (3, "t16x64x256_kw2", 19.24, "t16x128x128_atomic_bnt2", 8.93),
    (4, "t16x64x256_xcd4_kw2", 21.3, "t16x128x128_atomic_xcd4", 13.26),
    (8, "t16x128x256_xcd1", 32.46, "t16x128x128_atomic_bnt2", 18.53),
    (16, "t16x128x128_xcd4", 56.04, "t16x128x128_atomic_bnt2", 30.62),
    (32, "t16x128x128_xcd4", 98.86, "t16x128x128_atomic_bnt2", 52.39),
    (64, "t16x128x256_xcd4", 147.43, "t16x128x128_atomic_bnt2", 83.72),
    (128, "t16x128x256_xcd4", 193.86, "t16x128x128_atomic_bnt2", 113.87),
    (256, "t16x128x128_xcd4", 218.5, "t16x128x128_atomic_bnt2_xcd4", 127.2),
    (512, "t16x128x128_xcd4", 234.53, "t16x128x128_atomic_bnt2", 139.52),
)

# aiter's newest gfx950 a16w4 rows (kimik3_a16w4_tuned_fmoe.csv @ 29edaec0ea) at the model's token
# tiers (none stored here at 2048 and 8192 tokens: the pre-retune rows above are the only ones there):
# tokens -> (total us, (stage-1 tile, stage-2 tile) or None where the row names one of aiter's assembly
# one-stage kernels, which the model cannot compile).
NEWEST_A16W4 = {
    1: (18.22, None), 4: (29.83, None), 16: (87.74, None),
    64: (231.15, ("t16x128x256_xcd4", "t16x128x128_atomic_bnt2")),
    128: (307.73, ("t16x128x256_xcd4", "t16x128x128_atomic_bnt2")),
    256: (345.7, ("t16x128x128_xcd4", "t16x128x128_atomic_bnt2_xcd4")),
    1024: (407.4802, ("t32x128x128_xcd4", "t32x128x128_atomic_bnt2")),
    4096: (1046.1613, ("t32x192x128_bnt0_xcd1", "t32x256x128_atomic")),
    16384: (3387.1182, ("t32x192x128_bnt0_xcd1", "t32x256x128_atomic")),
}

# aiter's gfx950 quantized-activation rows (stage 1 + stage 2 us), the newest stored:
# kimik3_a8w4_tuned_fmoe.csv (fp8 activations) and kimik3_a4w4_tuned_fmoe.csv (MXFP4 activations)
# @ e4048607a5. aiter's kernels there are other code (opus / layout stage 2): timings only.
A8W4 = {1: 17.7347, 4: 33.6917, 16: 91.8557, 64: 221.5821, 128: 283.3301, 256: 308.8558, 1024: 339.1744,
        2048: 417.7975, 4096: 764.979, 8192: 1104.406, 16384: 1752.928}
A4W4 = {1: 20.0324, 4: 32.86, 16: 91.2002, 64: 225.8558, 128: 289.334, 256: 325.335, 1024: 349.9001,
        2048: 428.2433, 4096: 653.202, 8192: 1020.2545, 16384: 1716.5066}

# aiter's measured gfx942 a16w4 rows (bf16 activations x MXFP4 weights, cu_num 304 = MI300X;
# kimik3_a16w4_tuned_fmoe.csv @ 29edaec0ea), stage 1 + stage 2 us (none stored at 2048 and 8192 tokens).
GFX942_A16W4 = {1: 25.0083, 4: 70.2858, 16: 247.7965, 64: 631.6847, 128: 831.0787, 256: 930.5091,
                1024: 1301.4822, 4096: 3151.3427, 16384: 10483.9476}

SOURCES = {
    "pre_retune": "kimik3_fp4_tuned_fmoe.csv @ e4048607a5 (gfx950, BM32)",
    "retune_5118": "kimik3_a16w4_tuned_fmoe.csv @ c1cb9c8a92 (aiter PR 5118, gfx950, BM16 <= 512 tokens)",
    "newest_a16w4": "kimik3_a16w4_tuned_fmoe.csv @ 29edaec0ea (gfx950)",
    "a8w4": "kimik3_a8w4_tuned_fmoe.csv @ e4048607a5 (gfx950)",
    "a4w4": "kimik3_a4w4_tuned_fmoe.csv @ e4048607a5 (gfx950)",
    "gfx942": "kimik3_a16w4_tuned_fmoe.csv @ 29edaec0ea (gfx942, cu_num 304, MXFP4 weights)",
}
