"""Expert ids outside the range (E, 10**6, negative other than -1, int64 past 2**31) on every Triton
path, under the interpreter: such a pair reads nothing and adds nothing, exactly as if its id were
-1, with no host synchronisation; KIMI_K3_MOE_CHECK_EXPERT_IDS=on names the id instead."""
import pytest
import torch
import triton_problems as P
from moe_helpers import SITU

from kimi_k3_moe import settings
from kimi_k3_moe.kernels import get_backend
from kimi_k3_moe.kernels.common import alignment
from kimi_k3_moe.kernels.triton.table import KernelConfig, KOrder, MoEConfig
from kimi_k3_moe.weights.requant import requantize_experts

DIRECT = MoEConfig("direct", 16, KernelConfig(32, 64, 4, 2, order=KOrder.STACKED),
                   KernelConfig(32, 32, 4, 2, order=KOrder.PAIRS, n_tiles=2), "bits")
PATHS = {"gemv": P.GEMV, "direct": DIRECT, "aligned": P.ALIGNED, "aligned-2-launches": P.ALIGNED}
BAD = (P.E, 10**6, -5, 2**32 + 1)  # 2**32 + 1 narrowed to int32 would be 1, a real expert


@pytest.fixture(scope="module")
def problem(module_gen):
    ex = P.experts(module_gen)
    return ex, requantize_experts(ex, progress=False), module_gen


def _backend_and_experts(problem, weight_format, path):
    ex, conv, _ = problem
    backend = get_backend("triton", weight_format=weight_format, config=PATHS[path])
    return backend, backend.prepare(ex if weight_format == "mxfp4" else conv)


def _bad_ids(ids, gen, num_ids):
    """int64 ids with one slot per token set to a bad value (each of BAD at least once), and the same
    ids with -1 in those slots."""
    wild, dropped = ids.clone().long(), ids.clone().long()
    slots = torch.randint(0, ids.shape[1], (ids.shape[0],), generator=gen)
    for t, s in enumerate(slots.tolist()):
        bad = BAD[t % len(BAD)]
        wild[t, s] = num_ids if bad == P.E else bad
        dropped[t, s] = -1
    return wild, dropped


@pytest.mark.parametrize("weight_format", ["mxfp4", "int4"])
@pytest.mark.parametrize("path", sorted(PATHS))
def test_a_bad_id_is_a_pair_of_another_rank(weight_format, path, problem, monkeypatch):
    monkeypatch.delenv(settings.CHECK_EXPERT_IDS, raising=False)
    if path == "aligned-2-launches":
        monkeypatch.setattr(alignment, "SMALL_PAIRS", 0)
    backend, prepared = _backend_and_experts(problem, weight_format, path)
    gen = problem[2]
    hidden = P.hidden(gen, 5)
    weights, ids = P.routing(gen, 5)
    wild, dropped = _bad_ids(ids, gen, P.E)
    want = P.run(backend, prepared, hidden, weights, dropped, SITU)
    assert torch.equal(P.run(backend, prepared, hidden, weights, wild, SITU), want)


@pytest.mark.parametrize("path", sorted(PATHS))
def test_through_an_expert_map_ids_past_it_are_of_another_rank(path, problem, monkeypatch):
    monkeypatch.delenv(settings.CHECK_EXPERT_IDS, raising=False)
    if path == "aligned-2-launches":
        monkeypatch.setattr(alignment, "SMALL_PAIRS", 0)
    ex, _, gen = problem
    backend = get_backend("triton", config=PATHS[path])
    prepared = backend.prepare(ex.select([1, 4, 5]))
    emap = torch.full((9,), -1, dtype=torch.int32)
    emap[torch.tensor([2, 3, 7])] = torch.arange(3, dtype=torch.int32)
    hidden = P.hidden(gen, 5)
    weights, ids = P.routing(gen, 5, e=9)
    wild, dropped = _bad_ids(ids, gen, 9)
    want = P.run(backend, prepared, hidden, weights, dropped, SITU, emap)
    assert torch.equal(P.run(backend, prepared, hidden, weights, wild, SITU, emap), want)


@pytest.mark.parametrize("small", [True, False])
def test_alignment_counts_no_bad_id(small, gen, monkeypatch):
    if not small:
        monkeypatch.setattr(alignment, "SMALL_PAIRS", 0)
    ids = torch.tensor([[0, 6, 2], [-1, 10**6, 5], [-5, 2**32 + 1, 2**40]], dtype=torch.int64)
    (pairs,), launches = alignment.align_launches(ids, None, 6, (16,))
    for launch in launches:
        launch()
    assert pairs.local.tolist() == [0, -1, 2, -1, -1, 5, -1, -1, -1]
    rows = pairs.sorted_pairs[:int(pairs.num_rows)].tolist()
    assert sorted(r for r in rows if r < 9) == [0, 2, 5]


def test_the_setting_names_the_id_on_the_triton_backend(problem, monkeypatch):
    backend, prepared = _backend_and_experts(problem, "mxfp4", "gemv")
    gen = problem[2]
    hidden = P.hidden(gen, 3)
    weights, ids = P.routing(gen, 3)
    ids = ids.long()
    ids[1, 2] = P.E
    monkeypatch.setenv(settings.CHECK_EXPERT_IDS, "on")
    with pytest.raises(ValueError, match=rf"topk_ids holds {P.E} at \[token 1, slot 2\]; an expert id must be in "
                                         rf"\[0, {P.E}\) or -1"):
        backend.forward(prepared, hidden, weights, ids, SITU)
