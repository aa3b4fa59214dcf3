"""What a converted folder remembers of the checkpoint it came from: its state and its identity.

- the fingerprint (FINGERPRINT_RULE), checked at every start-up: has the source
  changed since conversion? SHA-256 over the index file's bytes, then each weight
  shard's name, size, mtime, the SHA-256 of its safetensors header and 16 blocks
  of 64 KiB sampled at fixed offsets of its data; ~1 MiB read per shard;
- the identity (IDENTITY_RULE), checked before `convert` replaces a folder: is
  this the same model at all? The SHA-256 of config.json and the shards' names
  and sizes: a re-export or an edited shard of the same model keeps it only when
  the sizes stay, another model never has it.

Both read exactly the files the loaders read (checkpoint.weight_files: with an
index, the shards it lists; a stray *.safetensors beside them is neither read
nor fingerprinted).
"""
from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

from kimi_k3_moe import io_errors
from kimi_k3_moe.weights import manifest
from kimi_k3_moe.weights.checkpoint import INDEX_FILE, CheckpointError, weight_files

_SAMPLE_BLOCKS, _SAMPLE_BYTES = manifest.SAMPLE_BLOCKS, manifest.SAMPLE_BYTES
CONFIG_FILE = "config.json"

FINGERPRINT_RULE = (f"sha256 over {INDEX_FILE} when present, then per weight shard (those {INDEX_FILE} lists, "
                    f"else every *.safetensors; sorted by name): name, size, mtime (ns), sha256 of its "
                    f"safetensors header, and {_SAMPLE_BLOCKS} x {_SAMPLE_BYTES // 1024} KiB of data sampled "
                    f"at fixed offsets")
IDENTITY_RULE = f"sha256 of {CONFIG_FILE}; the weight shards' names and sizes"


def _shards(model_dir: Path) -> list[Path]:
    shards, _ = weight_files(model_dir)
    if not shards:
        raise CheckpointError(f"no *.safetensors files in {model_dir} to fingerprint")
    return shards


def source_fingerprint(model_dir: str | Path) -> str:
    """Cheap SHA-256 of the state of a checkpoint's weight files (FINGERPRINT_RULE)."""
    model_dir = Path(model_dir)
    digest = hashlib.sha256()
    shards = _shards(model_dir)  # first: it names a folder this user may not read
    index = model_dir / INDEX_FILE
    if index.is_file():
        with io_errors.mapped(CheckpointError, index):
            digest.update(b"index\0" + hashlib.sha256(index.read_bytes()).digest())
    for shard in shards:
        with io_errors.mapped(CheckpointError, shard, "cannot read shard"):
            stat = shard.stat()
            digest.update(f"{shard.name}\0{stat.st_size}\0{stat.st_mtime_ns}\0".encode())
            with open(shard, "rb") as f:
                try:
                    manifest.header_and_samples(f, stat.st_size, shard, digest, blocks=_SAMPLE_BLOCKS,
                                                block_bytes=_SAMPLE_BYTES)
                except ValueError as exc:
                    raise CheckpointError(str(exc)) from None
    return "sha256:" + digest.hexdigest()


def source_identity(model_dir: str | Path) -> dict[str, Any]:
    """Which model a folder holds (IDENTITY_RULE), for telling another model's conversion from a stale one."""
    model_dir = Path(model_dir)
    config = model_dir / CONFIG_FILE
    with io_errors.mapped(CheckpointError, config):
        config_sha = "sha256:" + hashlib.sha256(config.read_bytes()).hexdigest()
    shards = {}
    for shard in _shards(model_dir):
        with io_errors.mapped(CheckpointError, shard, "cannot read shard"):
            shards[shard.name] = shard.stat().st_size
    return {"config_sha256": config_sha, "shards": shards, "rule": IDENTITY_RULE}


def same_model(a: dict[str, Any] | None, b: dict[str, Any]) -> bool | None:
    """Whether identities `a` (from a record; None when the record predates identities) and `b` name
    the same model; None when `a` cannot tell."""
    if not isinstance(a, dict) or a.get("rule") != b["rule"]:
        return None
    return a.get("config_sha256") == b["config_sha256"] and a.get("shards") == b["shards"]


def summary(identity: dict[str, Any] | None) -> str:
    """'config sha256:1a2b3c4d..., 3 shard(s), 1.25 GiB' for a message naming a model."""
    if not isinstance(identity, dict) or not isinstance(identity.get("shards"), dict):
        return "identity not recorded"
    sizes = [v for v in identity["shards"].values() if isinstance(v, int)]
    return (f"config {str(identity.get('config_sha256'))[:15]}..., {len(identity['shards'])} shard(s), "
            f"{sum(sizes) / 2**30:.2f} GiB")
