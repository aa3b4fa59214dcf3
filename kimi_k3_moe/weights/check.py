"""Every check a model's weights must pass to be served (what `doctor --model` runs).

Shards present and readable (headers parsed against the file sizes), every
expected expert tensor present with dtype uint8 and the shape the config
implies, and the load-time scale scan (`weights.validate`) over every layer.
Each problem is one line; a layer's problems of one kind are summarised.
"""
from __future__ import annotations

import sys
from collections.abc import Iterator

from tqdm.auto import tqdm

from kimi_k3_moe.formats import mxfp4
from kimi_k3_moe.weights.checkpoint import (
    INDEX_FILE,
    CheckpointError,
    CheckpointReader,
    expert_tensor_name,
    read_layer_experts,
)
from kimi_k3_moe.weights.validate import find_problems

PROJECTIONS = ("w1", "w3", "w2")


def check_weights(path, cfg, *, progress: bool = True) -> tuple[list[str], str]:
    """(problems, a summary of what was checked) for the model folder `path` with config `cfg`."""
    try:
        reader = CheckpointReader(path)
    except CheckpointError as exc:
        return [str(exc)], "weights: unreadable"
    checked = list(reader.check_shards())
    problems = [problem for _, problem in checked if problem]
    unreadable = {shard for shard, problem in checked if problem}
    layers = cfg.moe_layers()
    for layer in tqdm(layers, desc="checking expert weights", unit="layer", file=sys.stderr,
                      disable=not progress):
        layer_problems = list(_tensor_problems(reader, cfg, layer, unreadable))
        if not layer_problems:
            try:
                experts = read_layer_experts(reader, layer, hidden_size=cfg.routed_expert_hidden_size,
                                             intermediate_size=cfg.moe_intermediate_size,
                                             num_experts=cfg.num_experts)
            except CheckpointError as exc:
                layer_problems = [f"layer {layer}: {exc}"]
            else:
                layer_problems = find_problems(experts, layer=f"layer {layer}")
                del experts
        problems += layer_problems
    ignored = (f"; ignored {len(reader.unlisted)} *.safetensors file(s) that {INDEX_FILE} does not list "
               f"({', '.join(p.name for p in reader.unlisted[:3])})" if reader.unlisted else "")
    summary = (f"weights: {len(reader.shards())} shard(s){ignored}; {len(layers)} MoE layer(s) "
               f"x {cfg.num_experts} experts "
               f"x {2 * len(PROJECTIONS)} tensors checked (dtype, shape, NaN/overflowing scale bytes)")
    return problems, summary


def _tensor_problems(reader: CheckpointReader, cfg, layer: int, unreadable: set) -> Iterator[str]:
    h, i = cfg.routed_expert_hidden_size, cfg.moe_intermediate_size
    sizes = {"w1": (i, h), "w3": (i, h), "w2": (h, i)}
    missing, wrong, in_bad_shards = [], [], 0
    for e in range(cfg.num_experts):
        for proj in PROJECTIONS:
            rows, cols = sizes[proj]
            for kind, want in (("weight_packed", (rows, cols // 2)),
                               ("weight_scale", (rows, cols // mxfp4.BLOCK_SIZE))):
                name = expert_tensor_name(layer, e, proj, kind, reader.prefix)
                if name not in reader:
                    missing.append(name)
                    continue
                if reader.shard_of(name) in unreadable:
                    in_bad_shards += 1
                    continue
                try:
                    dtype, shape = reader.info(name)
                except CheckpointError as exc:
                    wrong.append(str(exc))
                    continue
                if dtype != "U8":
                    wrong.append(f"tensor {name!r} has dtype {dtype}; expected U8 (uint8)")
                    continue
                if kind == "weight_scale":
                    try:  # the reader's one rule for 4-D scales
                        shape = mxfp4.scale_shape_2d(shape, name)
                    except ValueError as exc:
                        wrong.append(str(exc))
                        continue
                if shape != want:
                    wrong.append(f"tensor {name!r} has shape {shape}; expected {want}")
    if in_bad_shards:
        yield f"layer {layer}: {in_bad_shards} expert tensor(s) are in the unreadable shard(s) above"
    if missing:
        yield f"layer {layer}: {len(missing)} expert tensor(s) missing, first {missing[0]!r}"
    if wrong:
        more = f" (and {len(wrong) - 1} more tensor(s) of this layer)" if len(wrong) > 1 else ""
        yield f"layer {layer}: {wrong[0]}{more}"
