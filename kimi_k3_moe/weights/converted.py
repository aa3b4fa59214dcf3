"""Pre-converted int4 checkpoints: written once by `kimi-k3-moe convert`, loaded at start-up.

Converting a Kimi-K3 rank's 92 MoE layers from MXFP4 to int4 at every
server start costs time; a converted folder skips it. Layout of the folder:

  kimi_k3_moe_int4.json                 the record and manifest (written last: its
                                        presence means the conversion completed):
                                        method, target, TP, source fingerprint, and
                                        each file's size, SHA-256 and sampled digest
                                        (weights/manifest.py: checked quickly at each
                                        load, in full by `convert --verify` and
                                        `doctor --model`)
  layer{L:03d}-tp{r}of{N}.safetensors   one layer's experts for TP rank r:
                                        w13.packed/scales[/offsets], w2.*,
                                        with the file's own identity in its
                                        safetensors metadata

How a plugin finds one: `find_converted(model_dir, tp_size=..., tp_rank=...,
target="gfx942")` looks at $KIMI_K3_MOE_CONVERTED, then at
`<model_dir>/kimi_k3_moe_int4/`; it returns None when there is none and
raises `ConvertedCheckpointError`, saying why, when one is there but does
not fit: another format version, target, method, TP size, model shape, or a
source that changed since conversion.

Source checksum, two levels:
- the fingerprint, checked at every start-up (FINGERPRINT_RULE): SHA-256 over
  the index file's bytes, then each weight shard's name, size, mtime, the
  SHA-256 of its safetensors header, and 16 blocks of 64 KiB sampled at fixed
  offsets of its data; it reads ~1 MiB per shard. Any write to a shard
  changes its mtime, so an edit outside the samples is noticed too (copying
  the model without keeping mtimes, e.g. `cp` without `-p`, makes the
  conversion stale: convert again, or copy with `cp -p`/`rsync -a`);
- per file, the SHA-256 of the exact MXFP4 bytes it was converted from,
  computed while converting; `kimi-k3-moe convert --verify` re-reads the
  source and checks every one of them.
"""
from __future__ import annotations

import hashlib
import json
import os
import struct
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from tqdm.auto import tqdm

from kimi_k3_moe import __version__, settings
from kimi_k3_moe.experts import Int4Experts
from kimi_k3_moe.formats import int4
from kimi_k3_moe.platform import INT4_ARCHS
from kimi_k3_moe.weights import manifest
from kimi_k3_moe.weights.checkpoint import INDEX_FILE, CheckpointError, CheckpointReader, read_layer_experts
from kimi_k3_moe.weights.requant import requantize_experts

FORMAT = "kimi-k3-moe-int4"
FORMAT_VERSION = 2  # 2: every file's SHA-256 and sampled digest in the record (weights/manifest.py)
RECORD_FILE = "kimi_k3_moe_int4.json"
PARTIAL_FILE = "kimi_k3_moe_int4.partial.json"  # progress of an unfinished conversion
CONVERTED_DIRNAME = "kimi_k3_moe_int4"
ENV_CONVERTED = settings.CONVERTED
TARGETS = INT4_ARCHS  # archs whose kernels read int4
LAYOUT = ("int4 v1 (docs/FORMATS.md): w13 [E, 2I/tp, H/2] gate rows first, w2 [E, H, I/tp/2]; "
          "rank r holds intermediate rows [r*I/tp, (r+1)*I/tp) of w1 and w3 and those columns of w2")
_SAMPLE_BLOCKS, _SAMPLE_BYTES = manifest.SAMPLE_BLOCKS, manifest.SAMPLE_BYTES


class ConvertedCheckpointError(ValueError):
    """A converted checkpoint that does not fit this model or server; the message says why."""


def layer_file(layer: int, tp_rank: int, tp_size: int) -> str:
    return f"layer{layer:03d}-tp{tp_rank}of{tp_size}.safetensors"


FINGERPRINT_RULE = (f"sha256 over {INDEX_FILE} when present, then per *.safetensors shard (sorted by name): name, "
                    f"size, mtime (ns), sha256 of its safetensors header, and {_SAMPLE_BLOCKS} x "
                    f"{_SAMPLE_BYTES // 1024} KiB of data sampled at fixed offsets")


def source_fingerprint(model_dir: str | Path) -> str:
    """Cheap SHA-256 identity of a checkpoint's weight files (FINGERPRINT_RULE; module docstring)."""
    model_dir = Path(model_dir)
    shards = sorted(model_dir.glob("*.safetensors"))
    if not shards:
        raise ConvertedCheckpointError(f"no *.safetensors files in {model_dir} to fingerprint")
    digest = hashlib.sha256()
    index = model_dir / INDEX_FILE
    if index.is_file():
        digest.update(b"index\0" + hashlib.sha256(index.read_bytes()).digest())
    for shard in shards:
        stat = shard.stat()
        digest.update(f"{shard.name}\0{stat.st_size}\0{stat.st_mtime_ns}\0".encode())
        with open(shard, "rb") as f:
            try:
                manifest.header_and_samples(f, stat.st_size, shard, digest, blocks=_SAMPLE_BLOCKS,
                                            block_bytes=_SAMPLE_BYTES)
            except ValueError as exc:
                raise CheckpointError(str(exc)) from None
    return "sha256:" + digest.hexdigest()


def tensor_digest(tensors: Sequence[torch.Tensor]) -> str:
    digest = hashlib.sha256()
    for t in tensors:
        t = t.detach().contiguous().cpu()
        digest.update(f"{t.dtype}{tuple(t.shape)}".encode())
        digest.update(memoryview(t.view(torch.uint8).numpy()) if t.numel() else b"")
    return "sha256:" + digest.hexdigest()


def _flatten(experts: Int4Experts) -> dict[str, torch.Tensor]:
    out = {}
    for name, w in (("w13", experts.w13), ("w2", experts.w2)):
        out[f"{name}.packed"] = w.packed.contiguous().cpu()
        out[f"{name}.scales"] = w.scales.contiguous().cpu()
        if w.offsets is not None:
            out[f"{name}.offsets"] = w.offsets.contiguous().cpu()
    return out


def write_layer(path: Path, experts: Int4Experts, *, layer: int, tp_rank: int, tp_size: int,
                source_digest: str, fingerprint: str) -> dict[str, Any]:
    """One (layer, rank) file, written to a temporary name and renamed; returns its manifest entry
    (size, SHA-256, sampled digest), taken from the temporary file so that what is listed is what
    was written."""
    meta = {"format": FORMAT, "format_version": str(FORMAT_VERSION), "method": experts.method,
            "layer": str(layer), "tp_rank": str(tp_rank), "tp_size": str(tp_size),
            "source_digest": source_digest, "source_fingerprint": fingerprint}
    tmp = path.with_suffix(".tmp")
    save_file(_flatten(experts), tmp, metadata=meta)
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o666 & ~umask)  # readable by the server's user, as a plain file would be
    entry = manifest.describe(tmp)
    os.replace(tmp, path)
    return entry


def write_record(out_dir: Path, record: Mapping[str, Any]) -> Path:
    path = out_dir / RECORD_FILE
    write_record_as(path, record)
    return path


def new_record(*, model_dir: Path, fingerprint: str, method: str, target: str, tp_size: int,
               layers: Sequence[int], num_experts: int, hidden_size: int, intermediate_size: int
               ) -> dict[str, Any]:
    return {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "written_by": f"kimi-k3-moe {__version__}",
        "method": method,
        "target": target,
        "tp_size": tp_size,
        "tp_ranks": list(range(tp_size)),
        "layout": LAYOUT,
        "model": {"num_experts": num_experts, "hidden_size": hidden_size,
                  "intermediate_size": intermediate_size, "moe_layers": list(layers)},
        "source": {"path": str(model_dir), "fingerprint": fingerprint,
                   "fingerprint_rule": FINGERPRINT_RULE},
        "files": {},
    }


@dataclass
class ConvertedCheckpoint:
    """A converted folder whose record fits the model and server it was checked against."""

    path: Path
    record: dict[str, Any]

    @property
    def method(self) -> str:
        return self.record["method"]

    @property
    def tp_size(self) -> int:
        return int(self.record["tp_size"])

    @property
    def layers(self) -> list[int]:
        return list(self.record["model"]["moe_layers"])

    def load_layer(self, layer: int, tp_rank: int, *, experts: Sequence[int] | None = None,
                   device: torch.device | str = "cpu") -> Int4Experts:
        """Layer `layer`'s experts for `tp_rank` (all, or the global ids in `experts`)."""
        name = layer_file(layer, tp_rank, self.tp_size)
        entry = self.record["files"].get(name)
        if entry is None:
            raise ConvertedCheckpointError(
                f"{self.path} has no layer {layer} for TP rank {tp_rank}/{self.tp_size} "
                f"(converted layers: {self.layers[:3]}...{self.layers[-1:]})")
        path = self.path / name
        try:
            manifest.check_quick(path, entry, RECORD_FILE)
        except manifest.ManifestMismatch as exc:
            raise ConvertedCheckpointError(str(exc)) from None
        try:
            handle = safe_open(path, framework="pt")
        except BaseException as exc:  # safetensors' own error types, or a Rust panic
            if isinstance(exc, (KeyboardInterrupt, SystemExit)):
                raise
            raise ConvertedCheckpointError(f"{path} is not a readable safetensors file: {exc}") from None
        with handle as f:
            meta = f.metadata() or {}
            expected = {"format": FORMAT, "format_version": str(FORMAT_VERSION), "method": self.method,
                        "layer": str(layer), "tp_rank": str(tp_rank), "tp_size": str(self.tp_size),
                        "source_fingerprint": self.record["source"]["fingerprint"]}
            for key, want in expected.items():
                if meta.get(key) != want:
                    raise ConvertedCheckpointError(
                        f"{path}: its metadata says {key}={meta.get(key)!r}, expected {want!r} "
                        "(a file from another conversion?)")
            tensors = {k: _read(f, k, experts) for k in f.keys()}
        weights = []
        for proj in ("w13", "w2"):
            try:
                weights.append(int4.Int4Weights(tensors[f"{proj}.packed"], tensors[f"{proj}.scales"],
                                                self.method, tensors.get(f"{proj}.offsets")))
            except (KeyError, TypeError, ValueError) as exc:
                raise ConvertedCheckpointError(f"{path}: tensor {proj} is malformed: {exc}") from exc
        if (weights[0].offsets is None) == (self.method in int4.OFFSET_METHODS):
            raise ConvertedCheckpointError(f"{path}: offsets present/absent contrary to method {self.method!r}")
        loaded = Int4Experts(*weights)
        model = self.record["model"]
        want = (len(experts) if experts is not None else model["num_experts"],
                model["hidden_size"], model["intermediate_size"] // self.tp_size)
        got = (loaded.num_experts, loaded.hidden_size, loaded.intermediate_size)
        if got != want:
            raise ConvertedCheckpointError(f"{path}: experts/hidden/intermediate per rank {got}, "
                                           f"expected {want}")
        return loaded.to(device)

    def check_rank_files(self, tp_rank: int) -> None:
        """Every file of `tp_rank` there with its listed size (a stat each), or the first that is not,
        named: a server refuses the folder at start rather than at the layer that lacks its file."""
        for name, entry in sorted(self.record["files"].items()):
            if entry["tp_rank"] != tp_rank:
                continue
            path = self.path / name
            if not path.is_file():
                raise ConvertedCheckpointError(f"{path} is listed in {RECORD_FILE} but missing")
            if path.stat().st_size != entry["size"]:
                raise ConvertedCheckpointError(f"{path} is {path.stat().st_size} bytes, {RECORD_FILE} says "
                                               f"{entry['size']}: truncated or replaced since conversion")

    def check_files(self) -> list[str]:
        """The full check: every file's bytes against its SHA-256, and no file missing or extra."""
        return manifest.check_full(self.path, self.record["files"], {RECORD_FILE})

    def check_source(self, model_dir: str | Path) -> None:
        """Refuse when the model's weight files changed since conversion (cheap fingerprint)."""
        now = source_fingerprint(model_dir)
        then = self.record["source"]["fingerprint"]
        if now != then:
            if self.record["source"].get("fingerprint_rule") != FINGERPRINT_RULE:
                raise ConvertedCheckpointError(
                    f"converted checkpoint {self.path} was fingerprinted by an older kimi-k3-moe rule, so it "
                    f"cannot be checked against {model_dir}; run `kimi-k3-moe convert --model {model_dir} "
                    f"--out {self.path} --target {self.record['target']} --tp {self.tp_size}` again")
            raise ConvertedCheckpointError(
                f"converted checkpoint {self.path} is stale: the weight files in {model_dir} changed "
                f"since it was converted (fingerprint {now[:19]}... != {then[:19]}...); "
                f"run `kimi-k3-moe convert --model {model_dir} --out {self.path} "
                f"--target {self.record['target']} --tp {self.tp_size}` again")


def _read(f, key: str, experts: Sequence[int] | None) -> torch.Tensor:
    if experts is None:
        return f.get_tensor(key)
    sl = f.get_slice(key)
    parts, run_start, prev = [], None, None
    for e in list(experts) + [None]:  # contiguous runs become one slice each
        if run_start is not None and (e is None or e != prev + 1):
            parts.append(sl[run_start:prev + 1])
            run_start = None
        if e is not None and run_start is None:
            run_start = e
        prev = e
    return torch.cat(parts) if len(parts) > 1 else parts[0]


def open_converted(path: str | Path) -> ConvertedCheckpoint:
    """Read a converted folder's record, refusing formats this package cannot read."""
    path = Path(path)
    record_path = path / RECORD_FILE
    if not record_path.is_file():
        if any(path.glob("layer*-tp*of*.safetensors")):
            raise ConvertedCheckpointError(f"{path} has layer files but no {RECORD_FILE}: the "
                                           "conversion did not finish; run `kimi-k3-moe convert` again")
        raise ConvertedCheckpointError(f"{path} is not a converted checkpoint (no {RECORD_FILE})")
    try:
        record = json.loads(record_path.read_text())
    except json.JSONDecodeError as exc:
        raise ConvertedCheckpointError(f"{record_path} is not valid JSON: {exc}") from exc
    if record.get("format") != FORMAT:
        raise ConvertedCheckpointError(f"{record_path}: format {record.get('format')!r} is not {FORMAT!r}")
    if record.get("format_version") != FORMAT_VERSION:
        raise ConvertedCheckpointError(
            f"{record_path}: format version {record.get('format_version')!r}, this kimi-k3-moe "
            f"({__version__}) reads version {FORMAT_VERSION}; convert again with this version")
    for key in ("method", "target", "tp_size", "model", "source", "files"):
        if key not in record:
            raise ConvertedCheckpointError(f"{record_path} has no {key!r} field")
    if record["method"] not in int4.METHODS:
        raise ConvertedCheckpointError(f"{record_path}: unknown int4 method {record['method']!r}")
    return ConvertedCheckpoint(path, record)


def converted_location(model_dir: str | Path | None, env: Mapping[str, str] | None = None
                       ) -> tuple[Path | None, bool]:
    """(where to look, whether the user named it explicitly)."""
    try:
        explicit = settings.path(ENV_CONVERTED, env)
    except settings.SettingError as exc:
        raise ConvertedCheckpointError(str(exc)) from None
    if explicit:
        return Path(explicit), True
    if model_dir is None:
        return None, False
    return Path(model_dir) / CONVERTED_DIRNAME, False


def find_converted(
    model_dir: str | Path | None,
    *,
    tp_size: int,
    tp_rank: int,
    target: str = "gfx942",
    method: str | None = None,
    num_experts: int | None = None,
    hidden_size: int | None = None,
    intermediate_size: int | None = None,
    check_source: bool = True,
    env: Mapping[str, str] | None = None,
) -> ConvertedCheckpoint | None:
    """The converted checkpoint this rank should load, None if there is none.

    Looks at $KIMI_K3_MOE_CONVERTED, else `<model_dir>/kimi_k3_moe_int4/`.
    A folder that is there but does not fit raises ConvertedCheckpointError
    saying why (a path named in the environment must exist). `method=None`
    accepts the recorded method; the caller then runs with
    `ConvertedCheckpoint.method`. The model fields, when given, must match.
    """
    where, explicit = converted_location(model_dir, env)
    if where is None or not where.exists():
        if explicit:
            raise ConvertedCheckpointError(f"{ENV_CONVERTED}={where} does not exist")
        return None
    found = open_converted(where)
    rec = found.record
    problems = []
    if rec["target"] != target:
        problems.append(f"it was converted for target {rec['target']!r}, this GPU is {target!r}")
    if found.tp_size != tp_size:
        problems.append(f"it was converted for tensor-parallel size {found.tp_size}, this server "
                        f"runs {tp_size}")
    elif not 0 <= tp_rank < tp_size:
        problems.append(f"TP rank {tp_rank} is outside [0, {tp_size})")
    if method is not None and found.method != method:
        problems.append(f"it holds int4 method {found.method!r}, the backend asks for {method!r}")
    for key, value in (("num_experts", num_experts), ("hidden_size", hidden_size),
                       ("intermediate_size", intermediate_size)):
        if value is not None and rec["model"].get(key) != value:
            problems.append(f"its model has {key} {rec['model'].get(key)}, this model {value}")
    if problems:
        raise ConvertedCheckpointError(f"converted checkpoint {where} does not fit: " + "; ".join(problems))
    found.check_rank_files(tp_rank)
    if check_source:
        source = Path(model_dir) if model_dir is not None else Path(rec["source"]["path"])
        found.check_source(source)
    return found


def _model_config(model_dir: Path):
    from kimi_k3_moe.configs import K3MoEConfig

    return K3MoEConfig.from_hf_config(model_dir)


def _same_job(a: Mapping[str, Any], b: Mapping[str, Any]) -> bool:
    keys = ("format", "format_version", "method", "target", "tp_size", "model")
    return all(a.get(k) == b.get(k) for k in keys) and a["source"]["fingerprint"] == b["source"]["fingerprint"]


def convert_checkpoint(
    model_dir: str | Path,
    out_dir: str | Path,
    *,
    target: str,
    tp_size: int = 1,
    method: str = int4.DEFAULT_METHOD,
    layers: Sequence[int] | None = None,
    device: torch.device | str | None = None,
    chunk_bytes: int | None = None,
    progress: bool = True,
    log: Callable[[str], None] = print,
) -> ConvertedCheckpoint:
    """Convert every MoE layer (or `layers`) of `model_dir` for all `tp_size` ranks into `out_dir`.

    Resumes an interrupted run with the same settings and source; returns at
    once when `out_dir` already holds this exact conversion.
    """
    if target not in TARGETS:
        raise ConvertedCheckpointError(
            f"target {target!r}: only {TARGETS} run int4 experts; gfx950 and NVIDIA GPUs read the "
            "MXFP4 checkpoint directly, so there is nothing to convert")
    if method not in int4.METHODS:
        raise ConvertedCheckpointError(f"unknown int4 method {method!r}; choose one of {int4.METHODS}")
    model_dir, out_dir = Path(model_dir), Path(out_dir)
    if out_dir.exists() and not out_dir.is_dir():
        raise ConvertedCheckpointError(f"--out {out_dir} is an existing file, not a folder")
    if out_dir.resolve() == model_dir.resolve():
        raise ConvertedCheckpointError(f"--out {out_dir} is the model folder itself; use a folder of its "
                                       f"own, e.g. {model_dir / CONVERTED_DIRNAME}")
    cfg = _model_config(model_dir)
    cfg.intermediate_per_rank(tp_size)  # refuses a TP size that does not split I into MXFP4 blocks
    all_layers = cfg.require_moe_layers()
    layers = all_layers if layers is None else sorted(set(layers))
    outside = [layer for layer in layers if layer not in all_layers]
    if outside:
        raise ConvertedCheckpointError(f"layers {outside} are not MoE layers of {model_dir} "
                                       f"(MoE layers: {all_layers[0]}..{all_layers[-1]})")
    fingerprint = source_fingerprint(model_dir)
    record = new_record(model_dir=model_dir.resolve(), fingerprint=fingerprint, method=method,
                        target=target, tp_size=tp_size, layers=layers, num_experts=cfg.num_experts,
                        hidden_size=cfg.routed_expert_hidden_size,
                        intermediate_size=cfg.moe_intermediate_size)
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConvertedCheckpointError(f"--out {out_dir} cannot be created: {exc.strerror or exc}") from None
    done_path, partial_path = out_dir / RECORD_FILE, out_dir / PARTIAL_FILE
    if done_path.is_file():
        previous = _read_json(done_path)
        damaged = _first_damaged(out_dir, previous) if _same_job(previous, record) else None
        if _same_job(previous, record) and damaged is None:
            log(f"{out_dir} already holds this conversion ({method}, {target}, TP {tp_size}); nothing to do")
            return open_converted(out_dir)
        stale = previous.get("source", {}).get("fingerprint") != fingerprint
        log(f"{out_dir} holds " + (f"this conversion, but {damaged}" if damaged else
                                   "a conversion of an older state of the source" if stale else
                                   "a conversion with other settings") + ": converting again")
        done_path.unlink()  # about to replace its files: never leave a record describing them
    if partial_path.is_file():
        previous = _read_json(partial_path)
        if _same_job(previous, record):
            # a file written before the interruption is kept only if its bytes are what was listed
            record["files"] = {name: entry for name, entry in previous["files"].items()
                               if (out_dir / name).is_file()
                               and (out_dir / name).stat().st_size == entry["size"]
                               and manifest.file_sha256(out_dir / name) == entry.get("sha256")}
            if record["files"]:
                log(f"resuming: {len(record['files'])} file(s) already converted")
    reader = CheckpointReader(model_dir)
    jobs = [(layer, rank) for layer in layers for rank in range(tp_size)]
    with ThreadPoolExecutor(max_workers=1) as hasher, \
            tqdm(total=len(jobs), desc=f"convert {method} TP{tp_size}", unit="layer-rank",
                 disable=not progress) as bar:
        for layer, rank in jobs:
            name = layer_file(layer, rank, tp_size)
            if name in record["files"]:
                bar.update(1)
                continue
            start = time.perf_counter()
            experts = read_layer_experts(reader, layer, hidden_size=cfg.routed_expert_hidden_size,
                                         intermediate_size=cfg.moe_intermediate_size,
                                         num_experts=cfg.num_experts, tp_rank=rank, tp_size=tp_size)
            digest = hasher.submit(tensor_digest, experts.tensors())  # hashing overlaps conversion
            converted = requantize_experts(experts, method=method, device=device, chunk_bytes=chunk_bytes,
                                           out_device="cpu", progress=progress,
                                           desc=f"layer {layer} rank {rank}")
            written = write_layer(out_dir / name, converted, layer=layer, tp_rank=rank, tp_size=tp_size,
                                  source_digest=digest.result(), fingerprint=fingerprint)
            record["files"][name] = {"layer": layer, "tp_rank": rank, **written,
                                     "source_digest": digest.result(),
                                     "seconds": round(time.perf_counter() - start, 3)}
            write_record_as(partial_path, record)
            del experts, converted
            bar.update(1)
    _remove_other_files(out_dir, record, log)
    write_record(out_dir, record)
    partial_path.unlink(missing_ok=True)
    return open_converted(out_dir)


def _first_damaged(out_dir: Path, record: Mapping[str, Any]) -> str | None:
    """The quick check's complaint about the first listed file that fails it, None if all pass."""
    for name, entry in sorted(record["files"].items()):
        try:
            manifest.check_quick(out_dir / name, entry, RECORD_FILE)
        except (manifest.ManifestMismatch, KeyError) as exc:
            return str(exc)
    return None


def _read_json(path: Path) -> dict[str, Any]:
    try:
        loaded = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ConvertedCheckpointError(f"{path} is not valid JSON: {exc}; delete it to convert afresh") from None
    if not isinstance(loaded, dict) or not isinstance(loaded.get("source"), dict):
        raise ConvertedCheckpointError(f"{path} is not a kimi-k3-moe conversion record; delete it to convert afresh")
    return loaded


def _remove_other_files(out_dir: Path, record: Mapping[str, Any], log: Callable[[str], None]) -> None:
    """Layer files this record does not list (another TP size, layer set or stale run) go, so none is mistaken."""
    others = [p for p in out_dir.glob("layer*-tp*of*.safetensors") if p.name not in record["files"]]
    others += list(out_dir.glob("layer*-tp*of*.tmp"))
    for path in others:
        path.unlink()
    if others:
        log(f"removed {len(others)} file(s) of another conversion from {out_dir} (e.g. {sorted(others)[0].name})")


def write_record_as(path: Path, record: Mapping[str, Any]) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(record, indent=2, sort_keys=True) + "\n")
    os.replace(tmp, path)


def verify_sources(checkpoint: ConvertedCheckpoint, model_dir: str | Path, *, progress: bool = True
                   ) -> list[str]:
    """Re-read the MXFP4 source of every converted file; the names whose source bytes changed."""
    model_dir = Path(model_dir)
    cfg = _model_config(model_dir)
    reader = CheckpointReader(model_dir)
    changed = []
    for name, entry in tqdm(sorted(checkpoint.record["files"].items()), desc="verify sources",
                            unit="layer-rank", disable=not progress):
        experts = read_layer_experts(reader, entry["layer"], hidden_size=cfg.routed_expert_hidden_size,
                                     intermediate_size=cfg.moe_intermediate_size,
                                     num_experts=cfg.num_experts, tp_rank=entry["tp_rank"],
                                     tp_size=checkpoint.tp_size)
        if tensor_digest(experts.tensors()) != entry["source_digest"]:
            changed.append(name)
    return changed
