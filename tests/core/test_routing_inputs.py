"""Routing inputs checked once for every backend (reference.check_routing), each error naming the
argument; expert ids outside the range read nothing and add nothing unless
KIMI_K3_MOE_CHECK_EXPERT_IDS=on, which names the bad id instead."""
import pytest
import torch
from moe_helpers import SITU

from kimi_k3_moe import settings
from kimi_k3_moe.experts import Mxfp4Experts
from kimi_k3_moe.formats import mxfp4
from kimi_k3_moe.kernels import get_backend
from kimi_k3_moe.reference import check_expert_ids, local_slots

E, H, I, T, K = 6, 64, 32, 5, 3


@pytest.fixture
def problem(gen):
    def linear(rows, cols):
        return mxfp4.quantize(torch.randn(E, rows, cols, generator=gen) * 0.5)
    w13_p, w13_s = linear(2 * I, H)
    w2_p, w2_s = linear(H, I)
    experts = Mxfp4Experts(w13_p, w13_s, w2_p, w2_s)
    hidden = torch.randn(T, H, generator=gen).to(torch.bfloat16)
    ids = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(T)]).to(torch.int32)
    weights = torch.rand(T, K, generator=gen)
    return experts, hidden, ids, weights


@pytest.fixture
def torch_backend():
    return get_backend("torch")


def run(backend, experts, hidden, weights, ids, emap=None):
    return backend.forward(backend.prepare(experts), hidden, weights, ids, SITU, emap)


@pytest.mark.parametrize("bad", [E, 10**6, -5, 2**32 + 1])
def test_an_id_outside_the_range_adds_nothing_and_reads_nothing(problem, torch_backend, bad, monkeypatch):
    monkeypatch.delenv(settings.CHECK_EXPERT_IDS, raising=False)
    experts, hidden, ids, weights = problem
    dropped = ids.clone().long()
    dropped[2, 1] = -1
    wild = dropped.clone()
    wild[2, 1] = bad
    want = run(torch_backend, experts, hidden, weights, dropped)
    got = run(torch_backend, experts, hidden, weights, wild)
    assert torch.equal(got, want) and torch.isfinite(got.float()).all()


def test_through_an_expert_map_ids_past_it_and_entries_past_the_experts_add_nothing(problem, torch_backend):
    experts, hidden, ids, weights = problem
    emap = torch.full((2 * E,), -1, dtype=torch.int32)
    emap[E:] = torch.arange(E, dtype=torch.int32)  # this rank holds global experts E..2E-1
    glob = ids.long() + E
    want = run(torch_backend, experts, hidden, weights, glob, emap)
    glob[0, 0], glob[1, 2] = 2 * E, 10**7  # past the map
    target = int(glob[3, 1])
    emap_bad = emap.clone()
    emap_bad[target] = E + 3  # a map entry past the experts: every slot routed to it drops out
    dropped = glob.clone()
    dropped[0, 0] = dropped[1, 2] = -1
    dropped[glob == target] = -1
    assert torch.equal(run(torch_backend, experts, hidden, weights, glob, emap_bad),
                       run(torch_backend, experts, hidden, weights, dropped, emap))
    assert not torch.equal(want, run(torch_backend, experts, hidden, weights, dropped, emap))


def test_local_slots_is_the_one_rule(gen):
    ids = torch.tensor([[0, 5, 6, -1, -7, 2**40]], dtype=torch.int64)
    assert local_slots(ids, None, 6).tolist() == [[0, 5, -1, -1, -1, -1]]
    emap = torch.tensor([3, -1, 9, 0, 1, 2, 4], dtype=torch.int32)
    assert local_slots(ids, emap, 6).tolist() == [[3, 2, 4, -1, -1, -1]]
    assert local_slots(torch.tensor([[2]]), emap, 6).tolist() == [[-1]]  # map entry 9 is past the experts


@pytest.mark.parametrize("bad,message", [
    (6, r"topk_ids holds 6 at \[token 2, slot 1\]; an expert id must be in \[0, 6\) or -1"),
    (-2, r"topk_ids holds -2 at \[token 2, slot 1\]"),
    (10**6, r"topk_ids holds 1000000 at \[token 2, slot 1\]"),
])
def test_the_setting_turns_on_a_check_that_names_the_id(problem, torch_backend, monkeypatch, bad, message):
    experts, hidden, ids, weights = problem
    ids = ids.long()
    ids[2, 1] = bad
    monkeypatch.setenv(settings.CHECK_EXPERT_IDS, "on")
    with pytest.raises(ValueError, match=message):
        run(torch_backend, experts, hidden, weights, ids)
    ids[2, 1] = -1  # -1 is "elsewhere", never an error
    run(torch_backend, experts, hidden, weights, ids)
    monkeypatch.setenv(settings.CHECK_EXPERT_IDS, "yes")
    with pytest.raises(settings.SettingError, match="KIMI_K3_MOE_CHECK_EXPERT_IDS='yes' is not accepted"):
        run(torch_backend, experts, hidden, weights, ids)


def test_the_shared_check_covers_the_map():
    emap = torch.tensor([0, -1, 6], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"expert_map holds 6 at \[2\]; a local expert id must be in \[0, 6\)"):
        check_expert_ids(torch.tensor([[0, 2]]), 6, emap)
    with pytest.raises(ValueError, match=r"topk_ids holds 3 at \[token 0, slot 1\]; .*\[0, 3\) .*expert map of 3"):
        check_expert_ids(torch.tensor([[0, 3]]), 6, emap)


@pytest.mark.parametrize("change,message", [
    (lambda h, w, i: (h[:, :-1], w, i), r"hidden has 63 columns; the experts take hidden size 64"),
    (lambda h, w, i: (torch.cat([h, h[:, :32]], 1), w, i), r"hidden has 96 columns"),
    (lambda h, w, i: (h.to(torch.int32), w, i),
     r"hidden must be bfloat16, float16, float32 or float64, got torch.int32"),
    (lambda h, w, i: (h[0], w, i), r"hidden must be \[tokens, hidden\], got shape \(64,\)"),
    (lambda h, w, i: (h, w, i.float()), r"topk_ids must be int32 or int64, got torch.float32"),
    (lambda h, w, i: (h, w, i[:-1]), r"topk_ids must be \[tokens, top_k\] with 5 tokens"),
    (lambda h, w, i: (h, w[:, :-1], i), r"topk_weights shape \(5, 2\) != topk_ids shape \(5, 3\)"),
    (lambda h, w, i: (h, w.to(torch.int32), i), r"topk_weights must be floating point"),
])
def test_malformed_inputs_are_named(problem, torch_backend, change, message):
    experts, hidden, ids, weights = problem
    h, w, i = change(hidden, weights, ids)
    with pytest.raises((ValueError, TypeError), match=message):
        run(torch_backend, experts, h, w, i)
