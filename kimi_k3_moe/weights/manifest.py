"""What a converted folder's record says about each of its files, and the checks against it.

Every layer file is listed with its size, the SHA-256 of all its bytes, and
a sampled digest (SHA-256 over the SHA-256 of its safetensors header and
SAMPLE_BLOCKS blocks of SAMPLE_BYTES at fixed offsets of its data, the
sampling the source fingerprint uses). Two depths of check:

- quick, at every load of a file: size and sampled digest; reads ~1 MiB, so
  a changed header, a truncation or a change inside a sampled block is
  refused before the file is read, naming it;
- full (`convert --verify`, `doctor --model`): every byte against its
  SHA-256, and the folder against the list: missing, extra and changed files.
"""
from __future__ import annotations

import hashlib
import struct
from collections.abc import Mapping
from pathlib import Path
from typing import Any, BinaryIO

from kimi_k3_moe import io_errors

SAMPLE_BLOCKS, SAMPLE_BYTES = 16, 64 << 10
_READ_CHUNK = 8 << 20


class ManifestMismatch(ValueError):
    """A file differs from what the record lists; the message names it."""


def header_and_samples(f: BinaryIO, size: int, where: Path, digest, *, blocks: int = SAMPLE_BLOCKS,
                       block_bytes: int = SAMPLE_BYTES) -> None:
    """Feed `digest` the SHA-256 of f's safetensors header, then `blocks` data blocks at fixed offsets.

    ValueError naming `where` when the header length does not fit the file
    (truncated, or a flipped length byte)."""
    f.seek(0)
    prefix = f.read(8)
    header_len = struct.unpack("<Q", prefix)[0] if len(prefix) == 8 else -1
    if not 0 <= header_len <= size - 8:
        raise ValueError(f"{where} is not a readable safetensors file (truncated or corrupt header)")
    digest.update(hashlib.sha256(f.read(header_len)).digest())
    data_start, data_len = 8 + header_len, size - 8 - header_len
    for k in range(blocks):
        f.seek(data_start + data_len * k // blocks)
        digest.update(f.read(min(block_bytes, data_len)))


def sampled_digest(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        header_and_samples(f, path.stat().st_size, path, digest, blocks=SAMPLE_BLOCKS, block_bytes=SAMPLE_BYTES)
    return "sha256:" + digest.hexdigest()


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()  # hashlib.file_digest is 3.11+; the package runs on 3.10
    with open(path, "rb") as f:
        while chunk := f.read(_READ_CHUNK):
            digest.update(chunk)
    return "sha256:" + digest.hexdigest()


def describe(path: Path) -> dict[str, Any]:
    """The record's entry for one written file."""
    return {"size": path.stat().st_size, "sha256": file_sha256(path), "sampled_digest": sampled_digest(path)}


def check_quick(path: Path, entry: Mapping[str, Any], listed_in: str) -> None:
    """Size and sampled digest of one file against its entry, or ManifestMismatch naming it."""
    if not path.is_file():
        raise ManifestMismatch(f"{path} is listed in {listed_in} but missing")
    with io_errors.mapped(ManifestMismatch, path):
        size = path.stat().st_size
        if size != entry["size"]:
            raise ManifestMismatch(f"{path} is {size} bytes, {listed_in} says {entry['size']}: "
                                   "truncated or replaced since conversion")
        try:
            now = sampled_digest(path)
        except ManifestMismatch:
            raise
        except ValueError as exc:
            raise ManifestMismatch(str(exc)) from None
    if now != entry["sampled_digest"]:
        raise ManifestMismatch(f"{path} changed since conversion (its header or sampled data differ from "
                               f"{listed_in}); convert again")


def check_full(folder: Path, files: Mapping[str, Mapping[str, Any]], own: set[str]) -> list[str]:
    """One line per file that is missing, extra, or whose bytes differ from its SHA-256.

    `own` names the folder's bookkeeping files (the record itself), which are not extra."""
    problems = []
    present = {p.name for p in folder.iterdir()} if folder.is_dir() else set()
    for name in sorted(files):
        path, entry = folder / name, files[name]
        try:
            if name not in present or not path.is_file():
                problems.append(f"missing: {path} is listed but not there")
            elif path.stat().st_size != entry["size"]:
                problems.append(f"changed: {path} is {path.stat().st_size} bytes, listed as {entry['size']}")
            elif file_sha256(path) != entry["sha256"]:
                problems.append(f"changed: {path} has other bytes than the SHA-256 listed for it")
        except OSError as exc:
            problems.append(f"unreadable: {io_errors.describe(exc, path)}")
    for name in sorted(present - set(files) - own):
        problems.append(f"extra: {folder / name} is not listed (left by another run, or added since)")
    return problems
