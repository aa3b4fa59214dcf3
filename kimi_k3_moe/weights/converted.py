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
- the fingerprint (weights/source.py), checked at every start-up: any write to
  a shard changes its mtime, so an edit outside the samples is noticed too
  (copying the model without keeping mtimes, e.g. `cp` without `-p`, makes the
  conversion stale: convert again, or copy with `cp -p`/`rsync -a`);
- per file, the SHA-256 of the exact MXFP4 bytes it was converted from,
  computed while converting; `kimi-k3-moe convert --verify` re-reads the
  source and checks every one of them.
The record also holds the source model's identity (weights/source.py), so that
`convert` never replaces another model's conversion without `--force`.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from kimi_k3_moe import __version__, io_errors, settings
from kimi_k3_moe.experts import Int4Experts
from kimi_k3_moe.formats import int4
from kimi_k3_moe.platform import INT4_ARCHS
from kimi_k3_moe.weights import manifest, source
from kimi_k3_moe.weights.checkpoint import CheckpointError, open_shard
from kimi_k3_moe.weights.source import FINGERPRINT_RULE, source_fingerprint

FORMAT = "kimi-k3-moe-int4"
FORMAT_VERSION = 2  # 2: every file's SHA-256 and sampled digest in the record (weights/manifest.py)
RECORD_FILE = "kimi_k3_moe_int4.json"
PARTIAL_FILE = "kimi_k3_moe_int4.partial.json"  # progress of an unfinished conversion
CONVERTED_DIRNAME = "kimi_k3_moe_int4"
ENV_CONVERTED = settings.CONVERTED
TARGETS = INT4_ARCHS  # archs whose kernels read int4
LAYOUT = ("int4 v1 (docs/FORMATS.md): w13 [E, 2I/tp, H/2] gate rows first, w2 [E, H, I/tp/2]; "
          "rank r holds intermediate rows [r*I/tp, (r+1)*I/tp) of w1 and w3 and those columns of w2")


class ConvertedCheckpointError(ValueError):
    """A converted checkpoint that does not fit this model or server; the message says why."""


def layer_file(layer: int, tp_rank: int, tp_size: int) -> str:
    return f"layer{layer:03d}-tp{tp_rank}of{tp_size}.safetensors"


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
            handle = open_shard(path)
        except CheckpointError as exc:
            raise ConvertedCheckpointError(str(exc)) from None
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
            with io_errors.mapped(ConvertedCheckpointError, path):
                size = path.stat().st_size
            if size != entry["size"]:
                raise ConvertedCheckpointError(f"{path} is {size} bytes, {RECORD_FILE} says "
                                               f"{entry['size']}: truncated or replaced since conversion")

    def check_files(self) -> list[str]:
        """The full check: every file's bytes against its SHA-256, and no file missing or extra."""
        return manifest.check_full(self.path, self.record["files"], {RECORD_FILE})

    def check_source(self, model_dir: str | Path) -> None:
        """Refuse when the model's weight files changed since conversion (cheap fingerprint)."""
        now = source_fingerprint(model_dir)
        then = self.record["source"]["fingerprint"]
        if now != then:
            recorded = self.record["source"].get("identity")
            identity = source.source_identity(model_dir)
            if source.same_model(recorded, identity) is False:
                raise ConvertedCheckpointError(
                    f"converted checkpoint {self.path} holds a conversion of another model: "
                    f"{self.record['source'].get('path')} ({source.summary(recorded)}), not {model_dir} "
                    f"({source.summary(identity)}); convert this model into a folder of its own")
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
    record = io_errors.read_json(record_path, ConvertedCheckpointError)
    if not isinstance(record, dict):
        raise ConvertedCheckpointError(f"{record_path} is not a kimi-k3-moe conversion record (not a JSON object)")
    if record.get("format") != FORMAT:
        raise ConvertedCheckpointError(f"{record_path}: format {record.get('format')!r} is not {FORMAT!r}")
    if record.get("format_version") != FORMAT_VERSION:
        raise ConvertedCheckpointError(
            f"{record_path}: format version {record.get('format_version')!r}, this kimi-k3-moe "
            f"({__version__}) reads version {FORMAT_VERSION}; convert again with this version")
    for key, kind in (("method", str), ("target", str), ("tp_size", int), ("model", dict), ("source", dict),
                      ("files", dict)):
        if not isinstance(record.get(key), kind):
            raise ConvertedCheckpointError(f"{record_path} has no {key!r} field of type {kind.__name__}")
    for name, entry in record["files"].items():
        fields = {"layer": int, "tp_rank": int, "size": int, "sha256": str, "sampled_digest": str, "source_digest": str}
        if not isinstance(entry, dict) or not all(isinstance(entry.get(k), t) for k, t in fields.items()):
            raise ConvertedCheckpointError(f"{record_path}: the entry of file {name!r} is malformed (it needs "
                                           + ", ".join(f"{k} ({t.__name__})" for k, t in fields.items()) + ")")
    if not isinstance(record["source"].get("fingerprint"), str):
        raise ConvertedCheckpointError(f"{record_path}: source has no fingerprint")
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

