"""User tables (`kimi-k3-moe tune`): one serves only where it was measured; anything else is refused
with a one-line message and the packaged table serves."""
from __future__ import annotations

import json
import random

import pytest

from kimi_k3_moe import __version__
from kimi_k3_moe.activation import ActivationSpec
from kimi_k3_moe.configs import user_tables
from kimi_k3_moe.kernels.flydsl import tiles
from kimi_k3_moe.kernels.triton import table as tt

H, I, E = 256, 64, 8
TIERS = [1, 4]


def triton_entries(block_m=32):
    cfg = tt.heuristic_config(H, I, 64, is_cuda=False)
    cfg = tt.MoEConfig.from_json({**cfg.to_json(), "block_m": block_m})
    return {tt.shape_key("mxfp4", E, 2 * I, H): {"tiers": {str(t): {**cfg.to_json(), "tuned": True} for t in TIERS}}}


def lookup(t=3):
    return tt.lookup("interpreter", "mxfp4", E, H, I, t, is_cuda=False)


def test_default_folder_is_under_the_xdg_cache():
    assert user_tables.table_dir({"XDG_CACHE_HOME": "/c"}) == user_tables.Path("/c/kimi-k3-moe/tables")
    assert user_tables.table_dir({"KIMI_K3_MOE_TABLES": "/t", "XDG_CACHE_HOME": "/c"}) == user_tables.Path("/t")


def test_a_valid_table_serves_its_exact_shape_only(tables):
    path = user_tables.write(tt.USER_TABLE, user_tables.device_identity(), TIERS, triton_entries(block_m=32))
    found = lookup()
    assert found.source == f"user table {path} mxfp4/E{E}_N{2 * I}_K{H} tier 4" and found.config.block_m == 32
    other = tt.lookup("interpreter", "mxfp4", E + 8, H, I, 3, is_cuda=False)  # another expert count
    assert not other.source.startswith("user table")
    # the tuner's baseline: what the package serves without the user's table
    assert tt.lookup("interpreter", "mxfp4", E, H, I, 3, is_cuda=False, user_table=False).source == "heuristic"
    assert user_tables.describe(tt.USER_TABLE).startswith(f"user table {path}")


def rewrite(path, **changes):
    table = json.loads(path.read_text())
    for key, value in changes.items():
        if key == "device_name":
            table["device"]["name"] = value
        elif key == "triton":
            table["device"]["triton"] = value
        elif key == "drop_tier":
            for entry in table["entries"].values():
                del entry["tiers"][value]
        else:
            table[key] = value
    path.write_text(json.dumps(table))


@pytest.mark.parametrize("damage, message", [
    ("corrupt", "not valid JSON"),
    ("device", "tuned on 'NVIDIA H100'"),
    ("triton", "tuned under Triton 3.1, this is Triton"),
    ("version", "written by kimi-k3-moe '0.0.1'"),
    ("tiers", "lacks token tiers [4]"),
    ("schema", "not a kimi-k3-moe user table"),
    ("config", "invalid config"),
    ("tier_name", "invalid token tier"),  # these two raised ValueError/AttributeError out of the lookup
    ("device_not_object", "device 'NVIDIA H200' is not a JSON object"),
    # these three raised UnicodeDecodeError, AttributeError and OverflowError out of the lookup
    ("random_bytes", "is not UTF-8 text"),
    ("mangled_entry", "invalid config"),
    ("huge_number", "invalid config"),
])
def test_damaged_or_foreign_tables_are_refused_with_a_message(tables, caplog, seed, damage, message):
    path = user_tables.write(tt.USER_TABLE, user_tables.device_identity(), TIERS, triton_entries())
    if damage == "corrupt":
        path.write_text(path.read_text()[:-40])
    elif damage == "device":
        rewrite(path, device_name="NVIDIA H100")
    elif damage == "triton":
        rewrite(path, triton="3.1")
    elif damage == "version":
        rewrite(path, package_version="0.0.1")
    elif damage == "tiers":
        rewrite(path, drop_tier="4")
    elif damage == "schema":
        rewrite(path, schema="something-else")
    elif damage == "tier_name":
        table = json.loads(path.read_text())
        tiers = next(iter(table["entries"].values()))["tiers"]
        tiers["four"] = tiers.pop("4")
        path.write_text(json.dumps(table))
    elif damage == "device_not_object":
        rewrite(path, device="NVIDIA H200")
    elif damage == "random_bytes":
        path.write_bytes(bytes(random.Random(seed).randrange(128, 256) for _ in range(512)))
    elif damage == "mangled_entry":  # a valid header; a tier's config is a list, not an object
        table = json.loads(path.read_text())
        next(iter(table["entries"].values()))["tiers"]["1"] = [1, 2, 3]
        path.write_text(json.dumps(table))
    elif damage == "huge_number":  # JSON's 1e999 reads as float inf
        text = path.read_text()
        path.write_text(text.replace('"block_m": 32', '"block_m": 1e999', 1))
        assert "1e999" in path.read_text()
    else:
        table = json.loads(path.read_text())
        next(iter(table["entries"].values()))["tiers"]["1"]["stage1"]["block_k"] = 96
        path.write_text(json.dumps(table))
    user_tables.clear_cache()
    with caplog.at_level("WARNING", logger="kimi_k3_moe"):
        found = lookup()
    assert not found.source.startswith("user table")  # the packaged rule serves
    assert message in caplog.text and str(path) in caplog.text and "the packaged table serves" in caplog.text
    assert len([r for r in caplog.records if "user table" in r.getMessage()]) == 1  # once, not per lookup
    assert user_tables.describe(tt.USER_TABLE).startswith("packaged table (")
    assert message in user_tables.describe(tt.USER_TABLE)
    assert __version__


def test_flydsl_user_table_is_read_by_the_tile_lookup_for_its_arch_and_shape(tables):
    rows = [{"max_tokens": 4, "BM": 32, "stage1": {"waves": 2, "n_rep": 1, "kb_unroll": 1, "a_lds": False},
             "stage2": {"waves": 2, "n_rep": 2, "kb_unroll": 1, "a_lds": False}, "tuned_at_tokens": 4},
            {"max_tokens": None, "BM": 64, "stage1": {"waves": 4, "n_rep": 1, "kb_unroll": 1, "a_lds": False},
             "stage2": {"waves": 4, "n_rep": 2, "kb_unroll": 1, "a_lds": False}, "tuned_at_tokens": 16}]
    key = tiles.shape_key("int4", H, 128, 4)
    user_tables.write(tiles.USER_TABLE, user_tables.device_identity(), [4, 16], {key: {"tiers": rows}},
                      extra={"target_arch": "gfx942"})
    situ = ActivationSpec.situv2(4.0, 25.0)
    s1, s2 = tiles.stage_configs("gfx942", "int4", hidden=H, inter=128, top_k=4, num_tokens=3, activation=situ)
    assert s1.BM == 32 and s1.tile.waves == 2
    s1, _ = tiles.stage_configs("gfx942", "int4", hidden=H, inter=128, top_k=4, num_tokens=100, activation=situ)
    assert s1.BM == 64
    # another arch or shape: the packaged tiles
    p1, _ = tiles.stage_configs("gfx950", "mxfp4", hidden=H, inter=128, top_k=4, num_tokens=3, activation=situ)
    assert p1.BM == tiles.tier_for("gfx950", 3).BM
    p1, _ = tiles.stage_configs("gfx942", "int4", hidden=H, inter=256, top_k=4, num_tokens=3, activation=situ)
    assert p1.BM == tiles.tier_for("gfx942", 3).BM


def test_doctor_and_the_plugin_log_line_name_the_serving_table(tables):
    from kimi_k3_moe import doctor
    from kimi_k3_moe.plugin_entrypoints import common
    assert common._table_line("triton[mxfp4]").startswith("packaged table (none for interpreter: the heuristic "
                                                          "serves; no user table at ")
    h200 = {"name": "NVIDIA H200", "key": "nvidia_h200"}
    assert tt.describe_packaged({**h200, "triton": "3.8"}) == \
        "nvidia_h200: Triton 3.8's entries serve (sections 3.6, 3.8)"
    assert tt.describe_packaged({**h200, "triton": "3.9"}) == ("nvidia_h200: no entries for Triton 3.9; Triton "
                                                               "3.8's serve where they compile without spills "
                                                               "under 3.9, else the heuristic")
    h100 = {"name": "NVIDIA H100 80GB HBM3", "key": "nvidia_h100_80gb_hbm3", "arch": "sm_90", "triton": "3.8"}
    assert tt.describe_packaged(h100) == ("nvidia_h200 (the sm_90 table; none for NVIDIA H100 80GB HBM3): "
                                          "Triton 3.8's entries serve (sections 3.6, 3.8)")
    assert tt.describe_packaged({**h100, "arch": "sm_100"}) == "none for NVIDIA H100 80GB HBM3: the heuristic serves"
    path = user_tables.write(tt.USER_TABLE, user_tables.device_identity(), TIERS, triton_entries())
    assert common._table_line("triton[mxfp4]").startswith(f"user table {path}")
    assert doctor._tables_line("triton").startswith(f"tiles: user table {path}")
    assert common._table_line("torch[mxfp4]") is None  # its log line stays as it was


def test_a_tables_setting_that_names_a_file_is_refused_and_doctor_lists_it(tmp_path):
    from kimi_k3_moe import settings
    a_file = tmp_path / "a-file"
    a_file.write_text("")
    env = {"KIMI_K3_MOE_TABLES": str(a_file)}
    with pytest.raises(settings.SettingError, match=f"KIMI_K3_MOE_TABLES={a_file} exists and is not a folder"):
        user_tables.table_dir(env)
    assert settings.check_all(env) == [f"KIMI_K3_MOE_TABLES={a_file} exists and is not a folder"]
    assert user_tables.table_dir({"KIMI_K3_MOE_TABLES": str(tmp_path / "new")}) == tmp_path / "new"  # tune creates it


def test_each_tabled_backend_declares_its_table_kind_and_others_none(tables):
    """user_tables knows no backend: a backend's spec names the TableKind beside its own tables."""
    from kimi_k3_moe import dispatch
    from kimi_k3_moe.kernels import SPECS
    kinds = {s.name: s.table_kind() for s in SPECS if s.user_table}
    assert kinds == {"triton": tt.USER_TABLE, "flydsl": tiles.USER_TABLE}
    assert all(k.backend == name for name, k in kinds.items())
    for spec in SPECS:
        line = dispatch.serving_table(f"{spec.name}[mxfp4]")
        assert (line is None) == (spec.user_table is None)
        if spec.user_table is None:
            with pytest.raises(ValueError, match=f"the {spec.name} backend reads no tile table"):
                spec.table_kind()


def test_a_damaged_table_is_refused_in_the_backends_own_lookup(tables, caplog, seed):
    """The lookup the load-time self-check's first forward makes (TritonBackend.lookup, as `plan` calls
    it): a user table of random bytes is said once with its path, and the packaged rule serves."""
    import torch

    from kimi_k3_moe.experts import Mxfp4Experts
    from kimi_k3_moe.kernels import get_backend
    from kimi_k3_moe.kernels.triton import backend as triton_backend

    path = user_tables.write(tt.USER_TABLE, user_tables.device_identity(), TIERS, triton_entries())
    path.write_bytes(bytes(random.Random(seed).randrange(128, 256) for _ in range(256)))
    user_tables.clear_cache()
    triton_backend._cached_lookup_inner.cache_clear()
    g = torch.Generator().manual_seed(seed)
    experts = Mxfp4Experts(torch.randint(0, 256, (E, 2 * I, H // 2), dtype=torch.uint8, generator=g),
                           torch.randint(118, 130, (E, 2 * I, H // 32), dtype=torch.uint8, generator=g),
                           torch.randint(0, 256, (E, H, I // 2), dtype=torch.uint8, generator=g),
                           torch.randint(118, 130, (E, H, I // 32), dtype=torch.uint8, generator=g))
    backend = get_backend("triton")
    with caplog.at_level("WARNING", logger="kimi_k3_moe"):
        found = backend.lookup(backend.prepare(experts), 3)
    assert not found.source.startswith("user table")
    lines = [r.getMessage() for r in caplog.records if "user table" in r.getMessage()]
    assert len(lines) == 1 and str(path) in lines[0] and "not UTF-8 text" in lines[0], lines
