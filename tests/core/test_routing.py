import pytest
import torch

from kimi_k3_moe.routing import select_experts


def brute_force(logits, bias, top_k, groups=1, topk_group=1, renormalize=True, scale=1.0):
    t, e = logits.shape
    ids, weights = [], []
    for row in range(t):
        scores = [1 / (1 + float(torch.exp(-logits[row, j].double()))) for j in range(e)]
        biased = [scores[j] + (float(bias[j]) if bias is not None else 0.0) for j in range(e)]
        per = e // groups
        allowed = set(range(e))
        if groups > 1:
            gscore = []
            for g in range(groups):
                best = sorted(biased[g * per:(g + 1) * per], reverse=True)[:2]
                gscore.append((-sum(best), g))
            keep = [g for _, g in sorted(gscore)[:topk_group]]
            allowed = {j for g in keep for j in range(g * per, (g + 1) * per)}
        order = sorted(allowed, key=lambda j: (-biased[j], j))[:top_k]
        w = [scores[j] for j in order]
        if renormalize:
            w = [x / sum(w) for x in w]
        ids.append(order)
        weights.append([x * scale for x in w])
    return torch.tensor(weights, dtype=torch.float64), torch.tensor(ids)


@pytest.mark.parametrize("groups,topk_group", [(1, 1), (4, 2), (8, 3)])
@pytest.mark.parametrize("renormalize", [True, False])
def test_matches_brute_force(gen, groups, topk_group, renormalize):
    logits = torch.randn(23, 64, generator=gen) * 2
    bias = torch.randn(64, generator=gen) * 0.3
    w, ids = select_experts(logits, bias, 6, num_expert_group=groups, topk_group=topk_group,
                            renormalize=renormalize, routed_scaling_factor=2.5)
    ew, eids = brute_force(logits, bias, 6, groups, topk_group, renormalize, 2.5)
    assert w.dtype == torch.float32 and ids.dtype == torch.int32
    assert torch.equal(ids.long(), eids)
    assert torch.allclose(w.double(), ew, rtol=1e-6, atol=0)


def test_bias_selects_but_does_not_weight():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    bias = torch.tensor([0.0, 0.0, 0.0, 10.0])
    w, ids = select_experts(logits, bias, 2, renormalize=False)
    assert ids.tolist() == [[3, 0]]
    assert torch.allclose(w, torch.sigmoid(torch.tensor([[-1.0, 2.0]])))


def test_ties_go_to_the_lower_expert_id():
    logits = torch.zeros(3, 16)  # every score is exactly 0.5
    bias = torch.zeros(16)
    bias[[5, 9, 12]] = 0.25
    _, ids = select_experts(logits, bias, 5)
    assert ids.tolist() == [[5, 9, 12, 0, 1]] * 3
    ew, eids = brute_force(logits, bias, 5)
    assert torch.equal(ids.long(), eids)


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="top_k"):
        select_experts(torch.zeros(2, 4), None, 5)
    with pytest.raises(ValueError, match="e_score_correction_bias"):
        select_experts(torch.zeros(2, 4), torch.zeros(3), 2)
    with pytest.raises(ValueError, match="num_expert_group"):
        select_experts(torch.zeros(2, 6), None, 2, num_expert_group=4)
