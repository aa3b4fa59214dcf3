"""Config tables: one lookup rule for every token count (K3_FACTS defect class 6).

Plain Python, no kernels: every tuned table shipped in the package and a
synthetic one are probed at every tier edge, edge + 1 and far beyond.
"""
import json
import re
from importlib import resources
from pathlib import Path

import pytest

from kimi_k3_moe.kernels.triton import table as tt
from kimi_k3_moe.kernels.triton.table import KernelConfig, KOrder, MoEConfig

K3 = [(896, 3584, 384), (896, 3584, 192)]  # (E, H, I) per rank at TP8 and TP16
FAR = [16384, 16385, 32768, 32769, 131072]


def shipped_tables():
    folder = Path(str(resources.files("kimi_k3_moe.configs").joinpath("tables")))
    return sorted(folder.glob("triton_*.json"))


def synthetic_table(version="3.8"):
    tiers = {str(t): MoEConfig("gemv" if t <= 8 else "aligned", 16 if t <= 64 else 64).to_json()
             for t in (1, 4, 8, 64, 1024, 16384)}
    return {"format_version": 2, "tritons": {version: {"entries": {
        tt.shape_key("mxfp4", 896, 768, 3584): {"tiers": tiers}}}}}


def probe_tokens(tiers):
    return sorted({1, *tiers, *(t + 1 for t in tiers), *(max(1, t - 1) for t in tiers), *FAR})


def check_entry(table, dev, weight_format, e, h, i, version="3.8"):
    _, entry = tt.find_entry(table["tritons"][version]["entries"], weight_format, e, 2 * i, h)
    tiers = tt.tiers_of(entry)
    for t in probe_tokens(tiers):
        for is_cuda in (True, False):
            found = tt.lookup(dev, weight_format, e, h, i, t, is_cuda=is_cuda, table=table, triton=version)
            expected = next((x for x in tiers if t <= x), tiers[-1])
            assert found.source.endswith(f"tier {expected}"), (t, found.source)
            assert found.source != "heuristic"
            found.config.validate(h, i)
            if not is_cuda:
                assert found.config.decode == "bits"


def test_synthetic_table_edges():
    check_entry(synthetic_table(), "x", "mxfp4", 896, 3584, 384)
    # the same (N, K) with another expert count (an EP slice) uses the tuned entry
    found = tt.lookup("x", "mxfp4", 112, 3584, 384, 5, is_cuda=True, table=synthetic_table(), triton="3.8")
    assert found.source.endswith("tier 8") and found.config.path == "gemv"


def test_the_running_tritons_entries_serve_else_the_nearest_versions_after_the_check():
    """Tables know their Triton (register allocation moves between releases): the running version's
    section serves as it is; another version's entry serves only once the caller's check (the backend
    compiles it under the running Triton and refuses spills) passed, else the heuristic; the source
    says which."""
    table = synthetic_table("3.6")
    table["tritons"]["3.9"] = synthetic_table("3.9")["tritons"]["3.9"]
    calls = []

    def ok(cfg, weight_format, e, h, i, tier):
        calls.append(tier)
        return None

    mine = tt.lookup("x", "mxfp4", 896, 3584, 384, 64, is_cuda=True, table=table, triton="3.6", verify=ok)
    assert mine.source == "table x triton 3.6 mxfp4/E896_N768_K3584 tier 64" and calls == []
    assert tt.versions_nearest_first(table, "3.8") == ["3.9", "3.6"]       # one minor away each: the newer
    assert tt.versions_nearest_first(table, "3.7") == ["3.6", "3.9"]
    near = tt.lookup("x", "mxfp4", 896, 3584, 384, 64, is_cuda=True, table=table, triton="3.8", verify=ok)
    assert near.source == ("table x triton 3.9 mxfp4/E896_N768_K3584 tier 64 (tuned under Triton 3.9; "
                           "compiled without spills under Triton 3.8)") and calls == [64]
    refused = tt.lookup("x", "mxfp4", 896, 3584, 384, 64, is_cuda=True, table=table, triton="3.8",
                        verify=lambda *a: "stage2.aligned spills 8 bytes")
    assert refused.source.startswith("heuristic (table x triton 3.9 mxfp4/E896_N768_K3584 tier 64, tuned under "
                                     "Triton 3.9: stage2.aligned spills 8 bytes under Triton 3.8)")
    assert refused.config == tt.heuristic_config(3584, 384, 64, is_cuda=True)
    unchecked = tt.lookup("x", "mxfp4", 896, 3584, 384, 64, is_cuda=True, table=table, triton="3.8")
    assert unchecked.source.endswith("(tuned under Triton 3.9; not checked under Triton 3.8)")
    with pytest.raises(ValueError, match="format_version"):
        tt.check_table({"format_version": 1, "entries": {}}, "old")
    with pytest.raises(ValueError, match="major.minor"):
        tt.check_table({"format_version": 2, "tritons": {"3.8.0": {"entries": {}}}}, "t")


@pytest.mark.parametrize("path", shipped_tables(), ids=lambda p: p.name)
def test_shipped_tables(path):
    table = json.loads(path.read_text())
    tt.check_table(table, path.name)
    dev = path.stem[len("triton_"):]
    assert table["device_key"] == dev
    for version, section in table["tritons"].items():
        assert section["tuned_with"]["triton"].startswith(version + ".")
        for key in section["entries"]:
            weight_format, e, n, k = tt.parse_shape_key(key)
            check_entry(table, dev, weight_format, e, k, n // 2, version)


def test_h200_table_covers_k3():
    path = next((p for p in shipped_tables() if p.name == "triton_nvidia_h200.json"), None)
    if path is None:
        pytest.skip("no H200 table shipped yet")
    table = json.loads(path.read_text())
    for weight_format in ("mxfp4", "int4"):
        for e, h, i in K3:
            for running in ("3.6", "3.8"):   # the H200 image's Triton and the engines' users'
                assert tt.lookup("nvidia_h200", weight_format, e, h, i, 64, is_cuda=True, table=table,
                                 triton=running).source.startswith("table "), (weight_format, i, running)


def test_an_sm90_gpu_without_a_table_of_its_own_is_served_the_h200_entries():
    """An H100 (the H200's die) took the heuristic, which ran 1.6-3.9x slower there than the H200's
    entries; a GPU of another arch without a table still gets the heuristic."""
    for t in (1, 64, 4096, 16384):
        h200 = tt.lookup("nvidia_h200", "mxfp4", 896, 3584, 384, t, is_cuda=True, triton="3.8")
        h100 = tt.lookup("nvidia_h100_80gb_hbm3", "mxfp4", 896, 3584, 384, t, is_cuda=True, triton="3.8",
                         arch="sm_90")
        assert h100.config == h200.config
        assert h100.source == h200.source.replace(
            "triton 3.8 ", "triton 3.8 (the sm_90 table; none for nvidia_h100_80gb_hbm3) ")
        other = tt.lookup("nvidia_b200", "mxfp4", 896, 3584, 384, t, is_cuda=True, triton="3.8", arch="sm_100")
        assert other.source == "heuristic"
    assert tt.packaged_key("nvidia_h200", "sm_90") == "nvidia_h200"
    assert tt.packaged_key("amd_instinct_mi300x", "gfx942") is None


@pytest.mark.parametrize("e,h,i", K3 + [(6, 128, 64), (4, 96, 32)])
def test_heuristic_is_valid_for_every_token_count(e, h, i):
    for t in probe_tokens([1, 8, 9, 64, 65, 512, 513, 2048, 2049]):
        for is_cuda in (True, False):
            found = tt.lookup("no_such_device", "int4", e, h, i, t, is_cuda=is_cuda)
            assert found.source == "heuristic"
            found.config.validate(h, i)


def test_config_json_roundtrip_and_validation():
    cfg = MoEConfig("aligned", 32, KernelConfig(64, 256, 4, 3, True, KOrder.WORDS), KernelConfig(128, 128, 8, 3), "ptx")
    assert MoEConfig.from_json(json.loads(json.dumps(cfg.to_json()))) == cfg
    assert cfg.for_target(False).decode == "bits" and cfg.for_target(True) == cfg
    with pytest.raises(ValueError, match="block_k = 256 .* K = 384"):
        MoEConfig(stage2=KernelConfig(block_k=256)).validate(3584, 384)
    with pytest.raises(ValueError, match="block_m"):
        MoEConfig(block_m=8).validate(3584, 384)
    with pytest.raises(ValueError, match="block_n = 8 must be >= 16"):
        MoEConfig("aligned", stage1=KernelConfig(block_n=8)).validate(3584, 384)
    MoEConfig("gemv", stage1=KernelConfig(block_n=8)).validate(3584, 384)
    with pytest.raises(ValueError, match="n_tiles: only the aligned stage 2"):
        MoEConfig(stage1=KernelConfig(n_tiles=2)).validate(3584, 384)
    with pytest.raises(ValueError, match="n_tiles: only the aligned stage 2"):
        MoEConfig("gemv", stage2=KernelConfig(n_tiles=2)).validate(3584, 384)
    with pytest.raises(ValueError, match="stage2.n_tiles = 0 must be >= 1"):
        MoEConfig(stage2=KernelConfig(n_tiles=0)).validate(3584, 384)
    MoEConfig(stage2=KernelConfig(n_tiles=14)).validate(3584, 384)
    assert tt.row_tiles(96) == (64, 32) and tt.row_tiles(160) == (128, 32) and tt.row_tiles(64) == (64, 0)
    MoEConfig(block_m=96).validate(3584, 384)
    with pytest.raises(ValueError, match="stage2_block_m 96 .* needs that stage's swap"):
        MoEConfig(block_m=96, stage2=KernelConfig(swap=False)).validate(3584, 384)
    with pytest.raises(ValueError, match="^block_m 96 .* needs that stage's swap"):
        MoEConfig(block_m=96, stage1=KernelConfig(swap=False), stage2_block_m=128).validate(3584, 384)
    MoEConfig(block_m=96, stage2=KernelConfig(swap=False), stage2_block_m=128).validate(3584, 384)
    MoEConfig(block_m=160, stage2=KernelConfig(n_tiles=4)).validate(3584, 384)  # each tile runs both dots
    with pytest.raises(ValueError, match="stage2_block_m 80"):
        MoEConfig(stage2_block_m=80).validate(3584, 384)
    split = MoEConfig(block_m=96, stage2_block_m=128)
    assert MoEConfig.from_json(json.loads(json.dumps(split.to_json()))) == split
    assert "stage2_block_m" not in MoEConfig().to_json()
    with pytest.raises(ValueError, match="block_m"):
        MoEConfig(block_m=80).validate(3584, 384)
    assert MoEConfig(block_m=96, stage2_block_m=96) == MoEConfig(block_m=96)  # one config, one JSON form
    with pytest.raises(ValueError, match="stage2_block_m: the gemv path has no row blocks"):
        MoEConfig("gemv", stage2_block_m=128).validate(3584, 384)
    assert tt.device_key("NVIDIA H200") == "nvidia_h200"



def test_configs_of_the_warp_specialised_stages_are_refused_with_a_message():
    """Those kernels were removed; a user table that chose them is refused (its tiles were timed on
    kernels that no longer exist) and says so, for both forms earlier releases wrote."""
    s1 = {**KernelConfig(128, 32, 8, 4, True, KOrder.PAIRS).to_json(), "ws": True}
    cfg = MoEConfig("aligned", 160, stage2=KernelConfig(64, 128, 4, 3, True, KOrder.PLAIN_INTER, 28)).to_json()
    for bad, where in (({**cfg, "stage1": s1}, "stage1.ws"),
                       ({**cfg, "stage2": {**cfg["stage2"], "ws": True}}, "stage2.ws"),
                       ({**cfg, "path": "ws"}, "path 'ws'")):
        with pytest.raises(ValueError, match=f"^{re.escape(where)}: the warp-specialised kernels were removed"):
            MoEConfig.from_json(bad)
    assert MoEConfig.from_json({**cfg, "stage1": {**s1, "ws": False}}).stage1 == \
        KernelConfig(128, 32, 8, 4, True, KOrder.PAIRS)
    assert "ws" not in KernelConfig().to_json()


def test_k_order_rules():
    """One field says the K order; validate keeps each order's needs: word dots a K step of 128+,
    plain-inter several N tiles (stage 2 only, so), stacked gate/up rows stage 1 only."""
    assert KernelConfig().order == KOrder.INTERLEAVE
    assert KernelConfig(order="pairs") == KernelConfig(order=KOrder.PAIRS)  # a string is the same config
    assert [o.pairs for o in KOrder] == [False, False, True, True, True]
    MoEConfig(stage1=KernelConfig(block_k=128, order=KOrder.WORDS)).validate(3584, 384)
    with pytest.raises(ValueError, match="stage1: order 'words' needs block_k >= 128"):
        MoEConfig(stage1=KernelConfig(block_k=64, order=KOrder.WORDS)).validate(3584, 384)
    MoEConfig(stage1=KernelConfig(block_k=64, order=KOrder.PAIRS)).validate(3584, 384)
    MoEConfig(stage2=KernelConfig(n_tiles=4, order=KOrder.PLAIN_INTER)).validate(3584, 384)
    with pytest.raises(ValueError, match="stage2: order 'plain-inter' needs n_tiles > 1"):
        MoEConfig(stage2=KernelConfig(order=KOrder.PLAIN_INTER)).validate(3584, 384)
    with pytest.raises(ValueError, match="stage1: order 'plain-inter' needs n_tiles > 1"):
        MoEConfig(stage1=KernelConfig(order=KOrder.PLAIN_INTER)).validate(3584, 384)
    MoEConfig(stage1=KernelConfig(order=KOrder.STACKED)).validate(3584, 384)
    with pytest.raises(ValueError, match="stage2: order 'stacked' is stage 1's"):
        MoEConfig(stage2=KernelConfig(order=KOrder.STACKED)).validate(3584, 384)
    for order in KOrder:
        cfg = MoEConfig(stage2=KernelConfig(order=order, n_tiles=4))
        d = cfg.to_json()
        assert d["stage2"]["order"] == order.value and not set(tt.LEGACY_ORDER_FLAGS) & set(d["stage2"])
        assert MoEConfig.from_json(json.loads(json.dumps(d))) == cfg


LEGACY = [({}, KOrder.INTERLEAVE), ({"interleave": True}, KOrder.INTERLEAVE),
          ({"interleave": False}, KOrder.WORDS),
          ({"interleave": True, "pairs": False, "stack_gate_up": False}, KOrder.INTERLEAVE),
          ({"interleave": True, "pairs": True, "stack_gate_up": False}, KOrder.PAIRS),
          ({"interleave": False, "pairs": True}, KOrder.PAIRS),  # pairs won over interleave
          ({"interleave": True, "pairs": True, "stack_gate_up": True}, KOrder.STACKED),
          ({"interleave": True, "pairs": True, "stack_gate_up": False, "plain_inter": True}, KOrder.PLAIN_INTER)]


@pytest.mark.parametrize("flags,order", LEGACY)
def test_a_table_entry_of_the_previous_release_reads_as_its_order(flags, order):
    """User tables written before `order` hold four booleans instead; each entry means one order."""
    stage = {"block_n": 64, "block_k": 128, "num_warps": 4, "num_stages": 3, "swap": True, **flags, "n_tiles": 4}
    assert tt.order_from_flags(**flags) == order
    assert KernelConfig.from_json(stage) == KernelConfig(order=order, n_tiles=4)
    legacy = {"path": "aligned", "block_m": 16, "stage1": {"block_n": 64, **flags}, "stage2": stage}
    cfg = MoEConfig.from_json(legacy)
    assert cfg.stage2.order == order and cfg.stage1 == KernelConfig(order=order)
    assert MoEConfig.from_json(cfg.to_json()) == cfg


@pytest.mark.parametrize("flags", [{"stack_gate_up": True}, {"interleave": True, "plain_inter": True},
                                   {"pairs": True, "stack_gate_up": True, "plain_inter": True}])
def test_a_previous_release_entry_that_meant_no_order_is_refused(flags):
    with pytest.raises(ValueError, match="^stage1: stack_gate_up and plain_inter each refine pairs"):
        MoEConfig.from_json({"path": "aligned", "stage1": flags, "stage2": {}})


def test_an_unknown_or_doubled_order_is_a_one_line_error():
    with pytest.raises(ValueError) as exc:
        MoEConfig.from_json({"path": "aligned", "stage1": {}, "stage2": {"order": "zigzag"}})
    assert str(exc.value).startswith("stage2.order 'zigzag' not in ('words', 'interleave', 'pairs', 'stacked', ")
    assert "\n" not in str(exc.value)
    with pytest.raises(ValueError, match="^order 'zigzag' not in"):
        KernelConfig(order="zigzag")
    with pytest.raises(ValueError, match="^stage1: both order and pairs"):
        MoEConfig.from_json({"path": "aligned", "stage1": {"order": "pairs", "pairs": True}, "stage2": {}})
    bad = synthetic_table()
    next(iter(bad["tritons"]["3.8"]["entries"].values()))["tiers"]["64"]["stage1"]["order"] = "zigzag"
    with pytest.raises(ValueError, match="^stage1.order 'zigzag' not in"):
        tt.lookup("x", "mxfp4", 896, 3584, 384, 64, is_cuda=True, table=bad, triton="3.8")


def test_shipped_tables_say_order_not_the_booleans():
    for path in shipped_tables():
        for section in json.loads(path.read_text())["tritons"].values():
            for entry in section["entries"].values():
                for cfg in entry["tiers"].values():
                    for stage in ("stage1", "stage2"):
                        assert "order" in cfg[stage] and not set(tt.LEGACY_ORDER_FLAGS) & set(cfg[stage]), path


def test_small_batch_options_are_validated_and_round_trip():
    """The direct path (one pair per 16-row block) and pdl (every path; kept on CUDA targets with
    programmatic dependent launch only) survive JSON and are refused where meaningless."""
    gemv = MoEConfig("gemv", 16, KernelConfig(16, 512), KernelConfig(8, 128), "ptx", pdl=True)
    direct = MoEConfig("direct", 16, KernelConfig(32, 256, order=KOrder.STACKED),
                       KernelConfig(64, 128, order=KOrder.PAIRS, n_tiles=2), "ptx", pdl=True)
    for cfg in (gemv, direct):
        cfg.validate(3584, 384)
        assert MoEConfig.from_json(json.loads(json.dumps(cfg.to_json()))) == cfg
        assert cfg.for_target(True) == cfg
        assert not cfg.for_target(True, has_pdl=False).pdl and not cfg.for_target(False).pdl
        assert cfg.for_target(False).decode == "bits"
    assert "pdl" not in MoEConfig().to_json() and not MoEConfig.from_json(MoEConfig().to_json()).pdl
    with pytest.raises(ValueError, match="block_m 32: the direct path's blocks are one pair in 16 rows"):
        MoEConfig("direct", 32).validate(3584, 384)
    with pytest.raises(ValueError, match="stage2_block_m: the direct path"):
        MoEConfig("direct", 16, stage2_block_m=32).validate(3584, 384)
    with pytest.raises(ValueError, match="block_n = 8 must be >= 16"):
        MoEConfig("direct", stage1=KernelConfig(block_n=8)).validate(3584, 384)
    assert tt.device_key("AMD Instinct MI300X") == "amd_instinct_mi300x"


def test_tuning_space_tries_tail_blocks_and_split_stage2_at_4096_plus():
    """At 4096+ tokens the tuner's space holds stage 1 on tail blocks (swapped) with stage 2 on its
    own 128-row blocks and on the tail blocks; below 4096 it holds no tail block."""
    from kimi_k3_moe.kernels.triton import tuning_space as ts
    for tier, tails in ts.TAIL_BLOCKS.items():
        space = ts.candidates(tier, 3584, 384)
        for bm in tails:
            s1, s2, base = space[("aligned", bm)]
            assert base.block_m == bm and all(c.stage1.swap for c in s1)
            assert {c.stage2_block_m for c in s2} == {None, ts.SPLIT_STAGE2_BLOCK_M}
            for c in s1 + s2:
                c.validate(3584, 384)
    assert all(tt.row_tiles(bm)[1] == 0 for tier in (16, 256, 1024)
               for path, bm in ts.candidates(tier, 3584, 384) if path == "aligned")


def test_tuning_space_tries_the_direct_path_with_pdl_at_the_small_tiers():
    """Up to GEMV_MAX_TOKENS the tuner's space holds the direct path (pdl on; stage-2 K steps fitted
    to I, TP16's 192 included) beside the GEMV and aligned ones; above, none."""
    from kimi_k3_moe.kernels.triton import tuning_space as ts
    for inter in (384, 192, 3072):
        for tier in ts.TIERS:
            space = ts.candidates(tier, 3584, inter)
            if tier > ts.GEMV_MAX_TOKENS:
                assert ("direct", tt.DIRECT_BLOCK_M) not in space
                continue
            s1, s2, base = space[("direct", tt.DIRECT_BLOCK_M)]
            assert s1 and s2
            for c in (base, *s1, *s2):
                assert c.path == "direct" and c.pdl and c.validate(3584, inter) is c


def test_a_quick_tune_tries_the_tail_block_winners():
    """The quick tuning space (int4, TP16: the first QUICK tiles of each list) holds the tiles that won
    on tail blocks at 4096+ on the H200, stage 2 on its own 128-row blocks included."""
    from kimi_k3_moe.kernels.triton import tuning_space as ts
    for tier, tails in ts.TAIL_BLOCKS.items():
        for bm in tails:
            s1, s2, _ = ts.candidates(tier, 3584, 384, quick=True)[("aligned", bm)]
            assert {ts.kc(t) for t in ts.TAIL_S1_WINNERS} <= {c.stage1 for c in s1}
            assert {(ts.kc(t, swap=False), ts.SPLIT_STAGE2_BLOCK_M) for t in ts.TAIL_S2_WINNERS} <= \
                {(c.stage2, c.stage2_block_m) for c in s2}


def test_a_full_tune_tries_the_many_tile_stage_2_at_4096_plus():
    """Every TAIL_S2_TILES tile is in the full space at 4096+, swapped, on stage 2's own 128-row
    blocks and on the tail blocks whose activations fit in TILES_X_BYTES (not 192 rows x 384: 144 KB)
    (tests/compile checks that an SM runs two of them)."""
    from kimi_k3_moe.kernels.triton import tuning_space as ts
    for tier, tails in ts.TAIL_BLOCKS.items():
        for bm in tails:
            _, s2, _ = ts.candidates(tier, 3584, 384)[("aligned", bm)]
            got = {(c.stage2, c.stage2_block_m) for c in s2}
            for t in ts.TAIL_S2_TILES:
                assert (ts.kc(t), ts.SPLIT_STAGE2_BLOCK_M) in got, t
                assert ((ts.kc(t), None) in got) == (bm * 384 * 2 <= ts.TILES_X_BYTES), (bm, t)
    assert {ts.kc(t).order for t in ts.TAIL_S2_TILES} == {KOrder.PAIRS, KOrder.PLAIN_INTER}


def test_the_packaged_writer_merges_tiers_into_the_running_tritons_section_only(tmp_path):
    """`kimi-k3-moe tune --packaged`: tuned tiers replace the same tiers of the entry; its other tiers,
    other entries and other Tritons' sections stay, so no count falls to a neighbour tier's config."""
    import json
    path = tmp_path / "triton_dev.json"
    key = tt.shape_key("mxfp4", 56, 6144, 3584)
    cfg = lambda bm: {**tt.heuristic_config(3584, 3072, 64, is_cuda=True).to_json(), "block_m": bm}  # noqa: E731
    header = {"device": "dev", "device_key": "dev", "activation_tuned": "situv2"}
    tt.merge_into_table(path, "3.6", key, {"tiers": {"1": cfg(16), "64": cfg(16), "4096": cfg(64)}},
                        tuned_with={"triton": "3.6.0"}, header=header)
    tt.merge_into_table(path, "3.8", key, {"tiers": {"1": cfg(16), "64": cfg(16), "4096": cfg(64)}},
                        tuned_with={"triton": "3.8.0"}, header=header)
    # a run whose budget ran out before tier 4096: its untuned 4096 (the fallback it would serve)
    # leaves the section's 4096 as it was, and fills a tier the section lacked
    tt.merge_into_table(path, "3.8", key, {"tiers": {"64": {**cfg(32), "us": 1.0}, "4096": {**cfg(32), "tuned": False},
                                                     "16384": {**cfg(32), "tuned": False}}},
                        tuned_with={"triton": "3.8.0", "run": 2}, header=header)
    table = json.loads(path.read_text())
    tt.check_table(table, str(path))
    s38 = table["tritons"]["3.8"]
    assert list(s38["entries"][key]["tiers"]) == ["1", "64", "4096", "16384"] and s38["tiers"] == [1, 64, 4096, 16384]
    assert s38["entries"][key]["tiers"]["64"]["block_m"] == 32 and s38["tuned_with"]["run"] == 2
    assert s38["entries"][key]["tiers"]["4096"]["block_m"] == 64
    assert s38["entries"][key]["tiers"]["16384"]["block_m"] == 32
    assert table["tritons"]["3.6"]["entries"][key]["tiers"]["64"]["block_m"] == 16
    bad = {"tiers": {"16": {**cfg(16), "stage1": {**cfg(16)["stage1"], "order": "zigzag"}}}}
    with pytest.raises(ValueError):
        tt.merge_into_table(path, "3.8", key, bad, tuned_with={}, header=header)
    assert json.loads(path.read_text()) == table  # a refused merge leaves the file as it was
