"""Turn whatever a user hands us as "the HF config" into plain dicts.

Kept free of other package imports so that `activation` and `configs.model`
can both use it without a cycle.
"""
from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

ConfigSource = Any  # dict, str/PathLike to config.json or its folder, transformers config


class ConfigError(ValueError):
    """A Hugging Face config is missing a field or holds an unusable value."""


def load_config_dict(source: ConfigSource) -> dict[str, Any]:
    """The top-level config as a dict (nested configs stay nested)."""
    if isinstance(source, Mapping):
        return dict(source)
    if isinstance(source, (str, os.PathLike)):
        path = Path(source)
        if path.is_dir():
            path = path / "config.json"
        if not path.is_file():
            raise ConfigError(f"no config.json at {path}")
        try:
            loaded = json.loads(path.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ConfigError(f"{path} is not valid JSON: {exc}") from None
        if not isinstance(loaded, dict):
            raise ConfigError(f"{path} holds a JSON {type(loaded).__name__}, not an object")
        return loaded
    to_dict = getattr(source, "to_dict", None)
    if callable(to_dict):
        return to_dict()
    raise ConfigError(
        f"cannot read a Hugging Face config from {type(source).__name__}; "
        "pass a dict, a path to config.json or its folder, or a transformers config"
    )


def text_config(cfg: Mapping[str, Any]) -> dict[str, Any]:
    """The language model's fields: `text_config` when the config nests them."""
    inner = cfg.get("text_config")
    if inner is None:
        return dict(cfg)
    if not isinstance(inner, Mapping):
        inner = load_config_dict(inner)
    return dict(inner)


def lookup(cfg: Mapping[str, Any], key: str, *fallbacks: Mapping[str, Any]) -> Any:
    """`key` from `cfg`, else from the first fallback holding it, else None."""
    for source in (cfg, *fallbacks):
        if key in source:
            return source[key]
    return None
