"""Read a layer's routed experts from a compressed-tensors MXFP4 checkpoint.

Tensor names follow Kimi-K3's export, for layer L and expert e:
`{prefix}.{L}.block_sparse_moe.experts.{e}.{w1|w2|w3}.{weight_packed|weight_scale}`
with prefix `language_model.model.layers` (the multimodal export) or
`model.layers` (a text-only one). w1 is the gate, w3 the up half, w2 down.
"""
from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from pathlib import Path

import torch
from safetensors import safe_open

from kimi_k3_moe import io_errors
from kimi_k3_moe.experts import Mxfp4Experts
from kimi_k3_moe.formats import mxfp4

LAYER_PREFIXES = ("language_model.model.layers", "model.layers")
INDEX_FILE = "model.safetensors.index.json"


class CheckpointError(ValueError):
    """A checkpoint tensor is missing, truncated, or of the wrong shape or dtype."""


def expert_tensor_name(layer: int, expert: int, proj: str, kind: str,
                       prefix: str = LAYER_PREFIXES[0]) -> str:
    return f"{prefix}.{layer}.block_sparse_moe.experts.{expert}.{proj}.{kind}"


def moe_tensor_name(layer: int, suffix: str, prefix: str = LAYER_PREFIXES[0]) -> str:
    return f"{prefix}.{layer}.block_sparse_moe.{suffix}"


def open_shard(path: Path):
    """safe_open(path), or CheckpointError naming the file and the cause (missing, unreadable,
    truncated, corrupt header)."""
    with io_errors.mapped(CheckpointError, path, "cannot read shard"):
        # opened here first: safe_open reports a permission error as "No such file or directory"
        with open(path, "rb"):
            pass
    try:
        return safe_open(path, framework="pt")
    except BaseException as exc:  # safetensors raises its own types, a Rust panic a BaseException
        if isinstance(exc, (KeyboardInterrupt, SystemExit)):
            raise
        if isinstance(exc, OSError):
            raise CheckpointError(io_errors.describe(exc, path, "cannot read shard")) from None
        raise CheckpointError(f"{path} is not a readable safetensors file (truncated or corrupt header?): "
                              f"{one_line(exc)}") from None


def one_line(exc: BaseException) -> str:
    """An exception's message on one line (a library's multi-line text folded), else its type's name."""
    return " ".join(str(exc).split()) or type(exc).__name__


def read_index(path: Path) -> dict[str, str]:
    """The index file's weight_map (tensor -> shard file name), or CheckpointError naming the file."""
    loaded = io_errors.read_json(path, CheckpointError)
    weight_map = loaded.get("weight_map") if isinstance(loaded, dict) else None
    if weight_map is None:
        raise CheckpointError(f"{path} has no \"weight_map\" object")
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise CheckpointError(f"{path}: \"weight_map\" must map tensor names to shard file names")
    return weight_map


def weight_files(folder: Path, weight_map: dict[str, str] | None = None) -> tuple[list[Path], list[Path]]:
    """(the shards a tool reads, the *.safetensors it ignores): the one rule every reader of a model
    folder follows (the loaders, `doctor`, `convert` and its source fingerprint). With an index, the
    files it lists (`weight_map`, read from it when not given), each of which must exist; without
    one, every *.safetensors in the folder."""
    with io_errors.mapped(CheckpointError, folder, "cannot read folder"):  # glob would see an empty folder
        names = os.listdir(folder)
    present = sorted(folder / n for n in names if n.endswith(".safetensors") and not n.startswith("."))
    index = folder / INDEX_FILE
    if weight_map is None and not index.is_file():
        return present, []
    weight_map = read_index(index) if weight_map is None else weight_map
    listed = sorted({folder / shard for shard in weight_map.values()})
    missing = [p.name for p in listed if not p.is_file()]
    if missing:
        raise CheckpointError(f"{index} lists {len(missing)} shard(s) that are missing: {', '.join(missing[:5])}")
    return listed, [p for p in present if p not in set(listed)]


class CheckpointReader:
    """Finds tensors across safetensors shards, with or without an index file.

    Which file holds a tensor (the one rule `doctor`, `convert` and the
    loaders share, since they all read through this class): with an index,
    the file it names, and only the files it lists are ever opened (a stray
    `*.safetensors` beside them is ignored and listed in `unlisted`); without
    one, every `*.safetensors` in the folder, and a tensor name held by two
    files is refused naming both (either copy could be the wrong one).

    Every failure is a CheckpointError naming the file (and the tensor where
    known): an invalid index, shards it lists but that are missing (refused
    here), a truncated file or corrupt header (when the shard is first opened).
    """

    def __init__(self, path: str | Path):
        self.path = Path(path)
        if not self.path.is_dir():
            raise CheckpointError(f"checkpoint folder {self.path} does not exist")
        with io_errors.mapped(CheckpointError, self.path, "cannot read folder"):  # before any is_file() in it
            os.listdir(self.path)
        self._handles: dict[Path, object] = {}
        self.unlisted: list[Path] = []  # *.safetensors an index leaves out: never read
        self._where = self._index()
        self.prefix = self._detect_prefix()

    def shards(self) -> list[Path]:
        return sorted(set(self._where.values()))

    def _index(self) -> dict[str, Path]:
        index = self.path / INDEX_FILE
        if index.is_file():
            weight_map = read_index(index)
            _, self.unlisted = weight_files(self.path, weight_map)
            return {name: self.path / shard for name, shard in weight_map.items()}
        shards, _ = weight_files(self.path)
        if not shards:
            raise CheckpointError(f"no *.safetensors files in {self.path}")
        where: dict[str, Path] = {}
        for shard in shards:
            for name in self._handle(shard).keys():
                if name in where:
                    raise CheckpointError(
                        f"tensor {name!r} is in both {where[name]} and {shard}, and there is no "
                        f"{INDEX_FILE} to say which holds it; remove the stray file")
                where[name] = shard
        return where

    def check_shards(self) -> Iterable[tuple[Path, str | None]]:
        """(shard, problem or None) for each shard: headers parsed, every indexed tensor present."""
        for shard in self.shards():
            try:
                keys = set(self._handle(shard).keys())
            except CheckpointError as exc:
                yield shard, str(exc)
                continue
            absent = [name for name, s in self._where.items() if s == shard and name not in keys]
            yield shard, (f"tensor {absent[0]!r} is listed in {INDEX_FILE} for {shard} but that file does "
                          f"not hold it ({len(absent)} such tensor(s))" if absent else None)

    def _handle(self, shard: Path):
        handle = self._handles.get(shard)
        if handle is None:
            handle = self._handles[shard] = open_shard(shard)
        return handle

    def _detect_prefix(self) -> str:
        for prefix in LAYER_PREFIXES:
            if any(name.startswith(prefix + ".") for name in self._where):
                return prefix
        return LAYER_PREFIXES[0]

    def names(self) -> Iterable[str]:
        return self._where.keys()

    def __contains__(self, name: str) -> bool:
        return name in self._where

    def shard_of(self, name: str) -> Path | None:
        return self._where.get(name)

    def info(self, name: str) -> tuple[str, tuple[int, ...]]:
        """(safetensors dtype such as "U8", shape) of a tensor, read from its shard's header only."""
        shard = self._where.get(name)
        if shard is None:
            raise CheckpointError(f"tensor {name!r} is not in the checkpoint at {self.path}")
        try:
            view = self._handle(shard).get_slice(name)
            return view.get_dtype(), tuple(view.get_shape())
        except CheckpointError:
            raise
        except BaseException as exc:
            if isinstance(exc, (KeyboardInterrupt, SystemExit)):
                raise
            raise CheckpointError(f"tensor {name!r} in {shard} cannot be read: {one_line(exc)}") from None

    def get(self, name: str) -> torch.Tensor:
        shard = self._where.get(name)
        if shard is None:
            raise CheckpointError(f"tensor {name!r} is not in the checkpoint at {self.path}")
        try:
            handle = self._handle(shard)
        except CheckpointError as exc:
            raise CheckpointError(f"tensor {name!r}: {exc}") from None
        try:
            return handle.get_tensor(name)
        except BaseException as exc:  # safetensors raises its own types for truncation
            if isinstance(exc, (KeyboardInterrupt, SystemExit)):
                raise
            raise CheckpointError(f"tensor {name!r} in {shard} cannot be read: {one_line(exc)}") from None


def _as_2d_scale(t: torch.Tensor, name: str) -> torch.Tensor:
    try:
        return mxfp4.scale_as_2d(t, name)
    except ValueError as exc:
        raise CheckpointError(str(exc)) from None


def _read_checked(reader: CheckpointReader, name: str, shape: tuple[int, int], scale: bool) -> torch.Tensor:
    t = reader.get(name)
    if scale:
        t = _as_2d_scale(t, name)
    if t.dtype != torch.uint8:
        raise CheckpointError(f"tensor {name!r} has dtype {t.dtype}; expected torch.uint8")
    if tuple(t.shape) != shape:
        raise CheckpointError(f"tensor {name!r} has shape {tuple(t.shape)}; expected {shape}")
    return t


def read_layer_experts(
    checkpoint: str | Path | CheckpointReader,
    layer: int,
    *,
    hidden_size: int,
    intermediate_size: int,
    num_experts: int,
    tp_rank: int = 0,
    tp_size: int = 1,
    experts: Sequence[int] | None = None,
    device: torch.device | str = "cpu",
) -> Mxfp4Experts:
    """One layer's experts as `Mxfp4Experts`, sliced for this rank.

    Tensor parallelism splits the intermediate dim I (w1/w3 rows, w2
    columns) into `tp_size` equal parts; expert parallelism keeps only
    `experts` (global ids, in the order given).
    """
    reader = checkpoint if isinstance(checkpoint, CheckpointReader) else CheckpointReader(checkpoint)
    if not 0 <= tp_rank < tp_size or intermediate_size % tp_size:
        raise CheckpointError(f"tp_rank {tp_rank} / tp_size {tp_size} cannot split intermediate "
                              f"size {intermediate_size}")
    part = intermediate_size // tp_size
    if part % mxfp4.BLOCK_SIZE:
        raise CheckpointError(f"intermediate size per rank {part} is not a multiple of the "
                              f"MXFP4 block {mxfp4.BLOCK_SIZE}")
    ids = list(range(num_experts)) if experts is None else list(experts)
    bad = [e for e in ids if not 0 <= e < num_experts]
    if bad:
        raise CheckpointError(f"expert ids {bad} are outside [0, {num_experts})")
    h, i, blk = hidden_size, intermediate_size, mxfp4.BLOCK_SIZE
    rows = slice(tp_rank * part, (tp_rank + 1) * part)
    w13_p, w13_s, w2_p, w2_s = [], [], [], []
    for e in ids:
        def name(proj: str, kind: str, e: int = e) -> str:
            return expert_tensor_name(layer, e, proj, kind, reader.prefix)

        halves_p, halves_s = [], []
        for proj in ("w1", "w3"):
            halves_p.append(_read_checked(reader, name(proj, "weight_packed"), (i, h // 2), False)[rows])
            halves_s.append(_read_checked(reader, name(proj, "weight_scale"), (i, h // blk), True)[rows])
        w13_p.append(torch.cat(halves_p))
        w13_s.append(torch.cat(halves_s))
        down_p = _read_checked(reader, name("w2", "weight_packed"), (h, i // 2), False)
        down_s = _read_checked(reader, name("w2", "weight_scale"), (h, i // blk), True)
        w2_p.append(down_p[:, tp_rank * part // 2:(tp_rank + 1) * part // 2])
        w2_s.append(down_s[:, tp_rank * part // blk:(tp_rank + 1) * part // blk])
    stacked = (torch.stack(w13_p), torch.stack(w13_s), torch.stack(w2_p), torch.stack(w2_s))
    return Mxfp4Experts(*(t.contiguous().to(device) for t in stacked))


def read_router(checkpoint: str | Path | CheckpointReader, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(gate weight [E, hidden], e_score_correction_bias [E]) of one MoE layer."""
    reader = checkpoint if isinstance(checkpoint, CheckpointReader) else CheckpointReader(checkpoint)
    weight = reader.get(moe_tensor_name(layer, "gate.weight", reader.prefix))
    bias = reader.get(moe_tensor_name(layer, "gate.e_score_correction_bias", reader.prefix))
    return weight, bias
