"""Every KIMI_K3_MOE_* setting is named in settings.py and in README's table of environment variables."""
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from kimi_k3_moe import settings

README = Path(__file__).resolve().parents[2] / "README.md"


def test_every_setting_is_in_the_readme_table():
    names = {v for k, v in vars(settings).items() if k.isupper() and isinstance(v, str)
             and v.startswith("KIMI_K3_MOE_")}
    table = set(re.findall(r"^\| `(KIMI_K3_MOE_[A-Z0-9_]+)` \|", README.read_text(), re.M))
    assert settings.GSM8K_DIR in names and settings.TABLES in names  # GSM8K_DIR was read outside settings
    assert names == table


def test_every_setting_the_package_reads_is_named_in_settings():
    package = Path(settings.__file__).parent
    read = set()
    for path in package.rglob("*.py"):
        read |= set(re.findall(r"KIMI_K3_MOE_[A-Z0-9_]+", path.read_text()))
    read.discard("KIMI_K3_MOE_DEMO")  # the marker file demo leaves in its --out folder, not a setting
    names = {v for k, v in vars(settings).items()
             if k.isupper() and isinstance(v, str) and v.startswith("KIMI_K3_MOE_")}
    assert read <= names, f"read outside settings.py: {sorted(read - names)}"


def readme_settings() -> list[str]:
    return re.findall(r"^\| `(KIMI_K3_MOE_[A-Z0-9_]+)` \|", README.read_text(), re.M)


def test_every_readme_setting_with_a_wrong_value_is_reported_by_check_all(tmp_path):
    """Walks README's table: a value no setting accepts (a path to a plain file: not a choice, not a
    folder, no linker under it) is named by settings.check_all, which doctor prints, for every row."""
    a_file = tmp_path / "not-a-folder"
    a_file.write_text("x")
    for name in readme_settings():
        problems = settings.check_all({name: str(a_file)})
        assert len(problems) == 1 and problems[0].startswith(f"{name}=") and str(a_file) in problems[0], \
            (name, problems)


def test_path_settings_that_point_nowhere_are_named(tmp_path):
    nowhere = tmp_path / "nowhere"
    for name in (settings.CONVERTED, settings.GSM8K_DIR, settings.FLYDSL_ROCM):
        assert settings.check_all({name: str(nowhere)}) == [f"{name}={nowhere} does not exist"]
    # a root without the linker is refused, not replaced by $ROCM_PATH's (it was, silently)
    from kimi_k3_moe.kernels.flydsl.toolchain import rocm_root
    good = tmp_path / "rocm"
    (good / "llvm" / "bin").mkdir(parents=True)
    (good / "llvm" / "bin" / "ld.lld").write_text("#!/bin/sh\n")
    (good / "llvm" / "bin" / "ld.lld").chmod(0o755)
    assert rocm_root({"ROCM_PATH": str(good)}) == good
    with pytest.raises(settings.SettingError, match=f"KIMI_K3_MOE_FLYDSL_ROCM={tmp_path} holds no executable"):
        rocm_root({settings.FLYDSL_ROCM: str(tmp_path), "ROCM_PATH": str(good)})


def test_doctor_lists_every_invalid_setting(tmp_path):
    a_file = tmp_path / "not-a-folder"
    a_file.write_text("x")
    env = {**os.environ, "PYTHONPATH": str(README.parent), **{name: str(a_file) for name in readme_settings()}}
    out = subprocess.run([sys.executable, "-m", "kimi_k3_moe", "doctor"], capture_output=True, text=True,
                         env=env, timeout=300)
    assert out.returncode == 1, out.stdout + out.stderr
    cannot = [line for line in out.stdout.splitlines() if line.startswith("CANNOT SERVE: KIMI_K3_MOE_")]
    assert {line.split("=")[0].split()[-1] for line in cannot} == set(readme_settings()), out.stdout
