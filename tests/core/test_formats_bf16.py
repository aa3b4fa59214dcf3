"""formats.bf16.round_once: float64 -> bfloat16 with one rounding."""
import torch

from kimi_k3_moe.formats.bf16 import round_once


def _nearest_even(x: torch.Tensor) -> torch.Tensor:
    """Brute force: of the bf16 magnitudes around |x| (its float32 bf16 and the two neighbours),
    the nearest, ties to the even significand; x's sign put back."""
    m = x.abs()
    base = m.float().bfloat16().view(torch.int16).to(torch.int32)
    bits = torch.stack([(base - 1).clamp(min=0), base, base + 1], 1)
    cands = bits.to(torch.int16).view(torch.bfloat16).double()
    dist = (cands - m[:, None]).abs()
    best = dist == dist.min(1, keepdim=True).values
    pick = torch.where(best & ((bits & 1) == 0), 0, torch.where(best, 1, 2)).argmin(1)
    return torch.copysign(cands[torch.arange(len(x)), pick], x)


def _near_ties(gen, n):
    """bf16 ties v + ulp/2 moved by +-2^-28 relative: float32 cannot hold them and rounds onto
    the tie, which a second rounding then sends to even, the wrong side for half of them."""
    v = (torch.randn(n, generator=gen) * torch.exp2(torch.randint(-40, 40, (n,), generator=gen))).bfloat16().double()
    ulp = torch.exp2(torch.floor(torch.log2(v.abs())) - 7)
    tie = v + torch.sign(v) * ulp / 2
    side = torch.where(torch.rand(n, generator=gen) < 0.5, -1.0, 1.0).double()
    return tie * (1 + side * 2.0 ** -28)


def test_round_once_where_float32_rounds_twice(gen):
    x = torch.tensor([259 * 2.0 ** -10 - 2.0 ** -30, -(259 * 2.0 ** -10 - 2.0 ** -30)], dtype=torch.float64)
    assert round_once(x).tolist() == [258 * 2.0 ** -10, -258 * 2.0 ** -10]
    assert x.bfloat16().tolist() == [260 * 2.0 ** -10, -260 * 2.0 ** -10]  # torch: through float32
    near = _near_ties(gen, 4000)
    got = round_once(near).double()
    assert torch.equal(got, _nearest_even(near))
    assert (near.bfloat16().double() != got).sum() > 1000  # the inputs do catch a double rounding


def test_round_once_on_random_values_and_edges(gen):
    x = torch.randn(20000, generator=gen, dtype=torch.float64) * torch.exp2(
        torch.randint(-60, 60, (20000,), generator=gen)).double()
    exact = torch.randn(2000, generator=gen).bfloat16().double()  # already bf16
    ties = exact * (1 + 2.0 ** -8)
    edges = torch.tensor([0.0, -0.0, 1.0, 2.0 ** -126, 2.0 ** -133, -2.0 ** -140, 3.3e38], dtype=torch.float64)
    x = torch.cat([x, exact, ties, edges])
    assert torch.equal(round_once(x).double(), _nearest_even(x))
    assert torch.equal(round_once(exact).double(), exact)
    assert round_once(torch.tensor([-0.0], dtype=torch.float64)).item() == 0.0
    assert torch.signbit(round_once(torch.tensor([-0.0], dtype=torch.float64))).item()
    special = round_once(torch.tensor([float("inf"), -float("inf"), float("nan"), 1e39], dtype=torch.float64))
    assert special[0].item() == float("inf") and special[1].item() == -float("inf")
    assert torch.isnan(special[2]).item() and special[3].item() == float("inf")
