"""benchmarks/flydsl_isa_snapshot.py's diff: byte-identical snapshots pass, any difference is named."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import flydsl_isa_snapshot as snapshot  # noqa: E402


def test_the_diff_names_every_kernel_that_changed_or_is_missing(tmp_path, capsys):
    before, after = tmp_path / "before", tmp_path / "after"
    for d in (before, after):
        d.mkdir()
        (d / "k3moe_a.s").write_text(" v_mfma_f32_16x16x32_bf16 v[0:3], v[4:7], v[8:11], v[0:3]\n")
    assert snapshot.diff(before, after) == 0 and "every ISA byte-identical" in capsys.readouterr().out
    (after / "k3moe_a.s").write_text(" v_mfma_f32_16x16x32_bf16 v[0:3], v[4:7], v[8:11], v[0:3] \n")
    (before / "k3moe_b.s").write_text("")
    assert snapshot.diff(before, after) == 1
    assert capsys.readouterr().out.split("\n")[:2] == [f"only in {before}: k3moe_b", "differs: k3moe_a"]
