"""Every KIMI_K3_MOE_* setting is named in settings.py and in README's table of environment variables."""
import re
from pathlib import Path

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
    names = {v for k, v in vars(settings).items() if k.isupper() and isinstance(v, str) and v.startswith("KIMI_K3_MOE_")}
    assert read <= names, f"read outside settings.py: {sorted(read - names)}"
