"""`kimi-k3-moe convert`'s writer: a converted int4 folder (weights/converted.py describes it).

Resumable (a partial record lists what is done), idempotent (a finished,
intact conversion of the same job is left alone), and careful with what is
there: another model's conversion is refused, naming both, unless forced;
every write failure names the file and its cause.
"""
from __future__ import annotations

import hashlib
import json
import os
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from tqdm.auto import tqdm

from kimi_k3_moe import __version__, io_errors
from kimi_k3_moe.experts import Int4Experts
from kimi_k3_moe.formats import int4
from kimi_k3_moe.weights import manifest, source
from kimi_k3_moe.weights.checkpoint import CheckpointReader, read_layer_experts
from kimi_k3_moe.weights.converted import (
    CONVERTED_DIRNAME,
    FORMAT,
    FORMAT_VERSION,
    LAYOUT,
    PARTIAL_FILE,
    RECORD_FILE,
    TARGETS,
    ConvertedCheckpoint,
    ConvertedCheckpointError,
    layer_file,
    open_converted,
)
from kimi_k3_moe.weights.requant import requantize_experts
from kimi_k3_moe.weights.source import FINGERPRINT_RULE, source_fingerprint


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
    with io_errors.mapped(ConvertedCheckpointError, path, "cannot write"):
        try:
            save_file(_flatten(experts), tmp, metadata=meta)
            umask = os.umask(0)
            os.umask(umask)
            os.chmod(tmp, 0o666 & ~umask)  # readable by the server's user, as a plain file would be
            entry = manifest.describe(tmp)
            os.replace(tmp, path)
        except BaseException:
            _discard(tmp)
            raise
    return entry


def write_record(out_dir: Path, record: Mapping[str, Any]) -> Path:
    path = out_dir / RECORD_FILE
    write_record_as(path, record)
    return path


def new_record(*, model_dir: Path, fingerprint: str, identity: dict[str, Any], method: str, target: str,
               tp_size: int, layers: Sequence[int], num_experts: int, hidden_size: int, intermediate_size: int
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
                   "fingerprint_rule": FINGERPRINT_RULE, "identity": identity},
        "files": {},
    }


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
    force: bool = False,
) -> ConvertedCheckpoint:
    """Convert every MoE layer (or `layers`) of `model_dir` for all `tp_size` ranks into `out_dir`.

    Resumes an interrupted run with the same settings and source; returns at
    once when `out_dir` already holds this exact conversion. A conversion of
    another model there is refused, naming both, unless `force`.
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
    if not layers:
        raise ConvertedCheckpointError(f"--layers selects no layer of {model_dir} (MoE layers: "
                                       f"{all_layers[0]}..{all_layers[-1]})")
    outside = [layer for layer in layers if layer not in all_layers]
    if outside:
        raise ConvertedCheckpointError(f"layers {outside} are not MoE layers of {model_dir} "
                                       f"(MoE layers: {all_layers[0]}..{all_layers[-1]})")
    fingerprint = source_fingerprint(model_dir)
    record = new_record(model_dir=model_dir.resolve(), fingerprint=fingerprint,
                        identity=source.source_identity(model_dir), method=method,
                        target=target, tp_size=tp_size, layers=layers, num_experts=cfg.num_experts,
                        hidden_size=cfg.routed_expert_hidden_size,
                        intermediate_size=cfg.moe_intermediate_size)
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConvertedCheckpointError(f"--out {out_dir} cannot be created: {io_errors.cause(exc)}") from None
    partial_path = out_dir / PARTIAL_FILE
    if _claim(out_dir, record, force, log):
        return open_converted(out_dir)
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
    _discard(partial_path)
    return open_converted(out_dir)


def _claim(out_dir: Path, record: dict[str, Any], force: bool, log: Callable[[str], None]) -> bool:
    """Make `out_dir` ready for `record`'s conversion: True when it already holds it intact; else drop
    a finished record of another conversion, and keep the files of an interrupted run of this one
    (into `record`). Another model's conversion, finished or not, is refused unless `force`."""
    done_path, partial_path = out_dir / RECORD_FILE, out_dir / PARTIAL_FILE
    for path in (done_path, partial_path):
        if path.is_file() and not force:
            _refuse_another_model(out_dir, _read_json(path), record)
    if done_path.is_file():
        previous = _read_json(done_path, force)
        same = previous is not None and _same_job(previous, record)
        damaged = _first_damaged(out_dir, previous) if same else None
        if same and damaged is None:
            log(f"{out_dir} already holds this conversion ({record['method']}, {record['target']}, "
                f"TP {record['tp_size']}); nothing to do")
            return True
        ours = previous is not None and not _another_model(previous, record)
        stale = previous is not None and previous["source"].get("fingerprint") != record["source"]["fingerprint"]
        log(f"{out_dir} holds " + (f"this conversion, but {damaged}" if damaged else
                                   "a conversion of another model (--force)" if not ours and force else
                                   "a conversion of an older state of the source" if stale else
                                   "a conversion with other settings") + ": converting again")
        _discard(done_path)  # about to replace its files: never leave a record describing them
    if partial_path.is_file():
        previous = _read_json(partial_path, force)
        if previous is not None and _same_job(previous, record):
            # a file written before the interruption is kept only if its bytes are what was listed
            record["files"] = {name: entry for name, entry in previous["files"].items()
                               if _intact(out_dir / name, entry)}
            if record["files"]:
                log(f"resuming: {len(record['files'])} file(s) already converted")
    return False


def _another_model(previous: Mapping[str, Any], record: Mapping[str, Any]) -> bool:
    then, now = previous["source"], record["source"]
    same = source.same_model(then.get("identity"), now["identity"])
    if same is None:  # a record from before identities: the source path is all it says
        same = then.get("path") == now["path"]
    return not same


def _refuse_another_model(out_dir: Path, previous: Mapping[str, Any], record: Mapping[str, Any]) -> None:
    then, now = previous["source"], record["source"]
    if _another_model(previous, record):
        raise ConvertedCheckpointError(
            f"--out {out_dir} holds a conversion of another model (its config.json or shard sizes differ): "
            f"{then.get('path')} "
            f"({source.summary(then.get('identity'))}), not {now['path']} ({source.summary(now['identity'])}); "
            "choose another --out, or pass --force to replace it")


def _intact(path: Path, entry: Mapping[str, Any]) -> bool:
    with io_errors.mapped(ConvertedCheckpointError, path):
        return (path.is_file() and path.stat().st_size == entry.get("size")
                and manifest.file_sha256(path) == entry.get("sha256"))


def _discard(path: Path) -> None:
    with io_errors.mapped(ConvertedCheckpointError, path, "cannot remove"):
        path.unlink(missing_ok=True)


def _first_damaged(out_dir: Path, record: Mapping[str, Any]) -> str | None:
    """The quick check's complaint about the first listed file that fails it, None if all pass."""
    for name, entry in sorted(record["files"].items()):
        try:
            manifest.check_quick(out_dir / name, entry, RECORD_FILE)
        except (manifest.ManifestMismatch, KeyError) as exc:
            return str(exc)
    return None


def _read_json(path: Path, force: bool = False) -> dict[str, Any] | None:
    """A conversion record of `out_dir`; one that cannot be read is refused (None with `force`)."""
    try:
        loaded = io_errors.read_json(path, ConvertedCheckpointError)
        if not isinstance(loaded, dict) or not isinstance(loaded.get("source"), dict) \
                or not isinstance(loaded.get("files"), dict):
            raise ConvertedCheckpointError(f"{path} is not a kimi-k3-moe conversion record")
    except ConvertedCheckpointError as exc:
        if force:
            return None
        raise ConvertedCheckpointError(f"{exc}; delete it, or pass --force, to convert afresh") from None
    return loaded


def _remove_other_files(out_dir: Path, record: Mapping[str, Any], log: Callable[[str], None]) -> None:
    """Layer files this record does not list (another TP size, layer set or stale run) go, so none is mistaken."""
    others = [p for p in out_dir.glob("layer*-tp*of*.safetensors") if p.name not in record["files"]]
    others += list(out_dir.glob("layer*-tp*of*.tmp"))
    for path in others:
        _discard(path)
    if others:
        log(f"removed {len(others)} file(s) of another conversion from {out_dir} (e.g. {sorted(others)[0].name})")


def write_record_as(path: Path, record: Mapping[str, Any]) -> None:
    io_errors.write_text(path, json.dumps(record, indent=2, sort_keys=True) + "\n", ConvertedCheckpointError)


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
