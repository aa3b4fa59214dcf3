"""formats.bf16.round_once: float64 -> bfloat16 with one rounding."""
import torch

from kimi_k3_moe.formats.bf16 import round_once


def test_round_once_is_correct_where_float32_rounds_twice(gen):
    below_tie = torch.tensor([1 + 2.0 ** -8 - 2.0 ** -30, -(1 + 2.0 ** -8 - 2.0 ** -30)], dtype=torch.float64)
    above_tie = torch.tensor([1 + 2.0 ** -7 + 2.0 ** -8 + 2.0 ** -30], dtype=torch.float64)
    assert round_once(below_tie).tolist() == [1.0, -1.0]
    assert below_tie.bfloat16().tolist() == [1.0, -1.0]  # this one is a tie to even both ways
    assert round_once(above_tie).item() == 1 + 2.0 ** -6
    assert above_tie.bfloat16().item() == 1 + 2.0 ** -6


def test_round_once_matches_the_nearest_bf16_on_random_values(gen):
    """Against a brute-force nearest-even choice between the two bf16 neighbours, values spanning
    many binades, signs, exact bf16 values and exact ties."""
    x = torch.randn(20000, generator=gen, dtype=torch.float64) * torch.exp2(torch.randint(-30, 30, (20000,), generator=gen)).double()
    ties = (torch.randn(2000, generator=gen).bfloat16().double() * (1 + 2.0 ** -8))
    x = torch.cat([x, ties, torch.tensor([0.0, -0.0, 1.0, 2.0 ** -126, 2.0 ** -130])])
    got = round_once(x).double()
    lo = x.float().bfloat16().double()
    # the two bf16 neighbours of x: lo and the next one away from it on x's side
    lo_bits = lo.float().bfloat16().view(torch.int16).to(torch.int32)
    step = torch.where(x.abs() > lo.abs(), 1, -1).to(torch.int32)
    other = (lo_bits + step).to(torch.int16).view(torch.bfloat16).double()
    other = torch.where(x == lo, lo, other)
    d_lo, d_other = (x - lo).abs(), (x - other).abs()
    even_lo = (lo_bits & 1) == 0
    want = torch.where(d_lo < d_other, lo, torch.where(d_other < d_lo, other, torch.where(even_lo, lo, other)))
    assert torch.equal(got, want)
