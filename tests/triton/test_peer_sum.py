"""The peers' top-k sum (bench/peers/weighted_sum.py) under the interpreter: with an expert map,
other ranks' slots add nothing and their rows of y, which no GEMM wrote, are never read."""
import torch

from kimi_k3_moe.bench.peers.weighted_sum import weighted_topk_sum


def test_the_sum_skips_other_ranks_slots_and_never_reads_their_rows(gen):
    t, k, h = 5, 4, 40
    y = torch.randn(t, k, h, generator=gen).bfloat16()
    w = torch.rand(t, k, generator=gen)
    local = torch.randint(-1, 3, (t, k), generator=gen, dtype=torch.int32)
    local[0] = torch.tensor([-1, 0, -1, 2])  # at least one skipped and one kept slot
    written = y.clone()
    y[local < 0] = float("nan")  # unwritten rows: reading one would poison the sum
    out = weighted_topk_sum(y, w, torch.empty(t, h, dtype=torch.bfloat16), local)
    keep = (local >= 0).unsqueeze(-1)
    want = (torch.where(keep, y.float(), 0.0) * w.unsqueeze(-1)).sum(1)
    assert torch.isfinite(out.float()).all()
    assert torch.allclose(out.float(), want, rtol=1e-2, atol=1e-2)
    full = weighted_topk_sum(written, w, torch.empty(t, h, dtype=torch.bfloat16))
    assert not torch.allclose(full.float(), out.float())  # without the map every slot counts
