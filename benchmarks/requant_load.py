"""What converting one Kimi-K3 MoE layer to int4 costs at load time, at the TP8 per-rank shape.

Per method (amax, search, asym) and place:
- cpu:            MXFP4 in host memory, converted on the CPU;
- gpu-resident:   MXFP4 already on the GPU (the plugins' case), converted there;
- gpu-from-host:  MXFP4 in host memory, converted on the GPU, int4 back to the
                  host (the `kimi-k3-moe convert` case);
it reports seconds per layer (896 experts, w13 [896, 768, 3584] and w2
[896, 3584, 384]: ~1.97 GB of MXFP4) and the peak scratch memory on the
computing device against the chunk budget (the bound is two chunks). It
also times reading a layer back from a pre-converted safetensors file.

The CPU path is slow, so by default it converts --cpu-experts (28, 1/32 of
the layer) and extrapolates linearly to 896, labelled as such; the GPU
runs the full layer. Run on a GPU machine:

  python benchmarks/requant_load.py --json requant_load.json
  python benchmarks/requant_load.py --skip-cpu --json requant_load_gpu.json   # GPU rows only
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kimi_k3_moe.formats import int4, mxfp4  # noqa: E402
from kimi_k3_moe.experts import ExpertWeights  # noqa: E402
from kimi_k3_moe.weights.peak_memory import measure_peak  # noqa: E402
from kimi_k3_moe.weights.requant import (CPU_CHUNK_BYTES, GPU_CHUNK_BYTES,  # noqa: E402
                                         requantize_experts)

EXPERTS, HIDDEN, INTER_PER_RANK = 896, 3584, 384  # K3 at TP8


def layer_experts(num_experts: int, pool: int, seed: int) -> ExpertWeights:
    """MXFP4 experts of the TP8 shape: `pool` experts quantised from Gaussian weights, repeated.

    Quantising 3.7 G floats on the CPU would take longer than the benchmark;
    conversion cost depends on the data only through its groups' value
    histograms, which a pool of real quantised experts already has.
    """
    gen = torch.Generator().manual_seed(seed)
    pool = min(pool, num_experts)
    w13 = torch.randn(pool, 2 * INTER_PER_RANK, HIDDEN, generator=gen) * (3.0 / HIDDEN ** 0.5)
    w2 = torch.randn(pool, HIDDEN, INTER_PER_RANK, generator=gen) / INTER_PER_RANK ** 0.5
    for w in (w13, w2):
        idx = torch.randint(0, w.shape[-1], (*w.shape[:-1], 2), generator=gen)
        w.scatter_(-1, idx, w.gather(-1, idx) * 8)  # two outliers per row
    parts = [*mxfp4.quantize(w13), *mxfp4.quantize(w2)]
    pick = torch.arange(num_experts) % pool
    return ExpertWeights(*(p[pick].contiguous() for p in parts))


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_conversion(experts: ExpertWeights, method: str, device: torch.device, out_device: torch.device,
                    chunk_bytes: int, repeats: int):
    """(seconds of each timed run, peak memory of an untimed run, that run's result)."""
    result, peak = measure_peak(lambda: requantize_experts(experts, method=method, device=device,
                                                           out_device=out_device, chunk_bytes=chunk_bytes,
                                                           progress=False), device)
    times, cpu_times = [], []
    for _ in range(repeats):
        synchronize(device)
        start, cpu_start = time.perf_counter(), time.process_time()
        requantize_experts(experts, method=method, device=device, out_device=out_device,
                           chunk_bytes=chunk_bytes, progress=True, desc="layer")
        synchronize(device)
        times.append(time.perf_counter() - start)
        cpu_times.append(time.process_time() - cpu_start)
    return times, cpu_times, peak, result


def time_file_load(converted, device: torch.device, folder: Path) -> float:
    """Seconds to read one converted (layer, rank) file back onto `device` (page cache warm, so
    this is the floor: a cold read adds the file size over the disk's bandwidth)."""
    from safetensors.torch import load_file, save_file

    tensors = {}
    for name, w in (("w13", converted.w13), ("w2", converted.w2)):
        tensors.update({f"{name}.packed": w.packed.cpu(), f"{name}.scales": w.scales.cpu()})
        if w.offsets is not None:
            tensors[f"{name}.offsets"] = w.offsets.cpu()
    path = folder / "layer.safetensors"
    save_file(tensors, path)
    del tensors
    load_file(path, device=str(device))  # warm the page cache
    synchronize(device)
    start = time.perf_counter()
    loaded = load_file(path, device=str(device))
    if device.type == "cpu":  # CPU tensors may be mapped lazily: touch every byte, as a server would
        loaded = {k: v.clone() for k, v in loaded.items()}
    synchronize(device)
    seconds = time.perf_counter() - start
    path.unlink()
    return seconds


def run_place(place: str, experts: ExpertWeights, methods, args, folder: Path) -> list[dict]:
    gpu = torch.device("cuda")
    if place == "cpu":
        device, out_device, source = torch.device("cpu"), torch.device("cpu"), experts
        chunk = args.chunk_mib << 20 if args.chunk_mib else CPU_CHUNK_BYTES
    elif place == "gpu-resident":
        device, out_device, source = gpu, gpu, experts.to(gpu)
        chunk = args.chunk_mib << 20 if args.chunk_mib else GPU_CHUNK_BYTES
    else:
        device, out_device, source = gpu, torch.device("cpu"), experts
        chunk = args.chunk_mib << 20 if args.chunk_mib else GPU_CHUNK_BYTES
    scale = EXPERTS / experts.num_experts
    rows = []
    for method in methods:
        requantize_experts(source.select(slice(0, 2)), method=method, device=device, progress=False)  # warm-up
        times, cpu_times, peak, result = time_conversion(source, method, device, out_device, chunk,
                                              args.repeats if device.type == "cuda" else 1)
        row = {
            "place": place, "method": method, "device": _device_name(device),
            "experts_converted": experts.num_experts,
            "seconds_per_layer": statistics.median(times) * scale,
            "seconds_measured": times,
            # CPU time of all this process's threads: on a shared machine, wall time also counts waiting.
            "process_cpu_seconds_per_layer": statistics.median(cpu_times) * scale,
            "extrapolated_from_experts": experts.num_experts if scale != 1 else None,
            "chunk_bytes": chunk,
            "peak_extra_bytes": peak.extra_bytes,
            "peak_extra_over_chunk": peak.extra_bytes / chunk,
            "within_two_chunks": peak.extra_bytes <= 2 * chunk,
            "mxfp4_bytes": experts.nbytes,
        }
        if place != "gpu-from-host":
            load_device = device if place == "gpu-resident" else torch.device("cpu")
            row["load_converted_file_seconds_per_layer"] = time_file_load(result, load_device, folder) * scale
        del result
        rows.append(row)
        note = f" (extrapolated from {experts.num_experts} experts)" if scale != 1 else ""
        load = (f", read back from file {row['load_converted_file_seconds_per_layer']:.2f} s"
                if "load_converted_file_seconds_per_layer" in row else "")
        print(f"{place:14s} {method:7s} {row['seconds_per_layer']:8.2f} s/layer{note} "
              f"(process CPU {row['process_cpu_seconds_per_layer']:.1f} s); peak scratch "
              f"{peak.extra_bytes / 2**20:8.1f} MiB = {row['peak_extra_over_chunk']:.2f} x chunk "
              f"({chunk >> 20} MiB){load}", flush=True)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return rows


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"cpu ({os.cpu_count()} cores, {torch.get_num_threads()} threads)"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--methods", nargs="+", default=list(int4.METHODS), choices=int4.METHODS)
    parser.add_argument("--cpu-experts", type=int, default=28, help="experts converted on the CPU (896 = all)")
    parser.add_argument("--skip-cpu", action="store_true")
    parser.add_argument("--chunk-mib", type=int, help="chunk budget (default: the library's per device)")
    parser.add_argument("--repeats", type=int, default=3, help="timed repeats on the GPU (median)")
    parser.add_argument("--pool", type=int, default=8, help="distinct experts drawn, repeated to 896")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", help="write the rows here")
    args = parser.parse_args(argv)

    rows = []
    setup = {"shape": f"TP8 per rank: {EXPERTS} experts, H {HIDDEN}, I/8 {INTER_PER_RANK}",
             "torch": torch.__version__, "date": datetime.datetime.now().isoformat(timespec="seconds"),
             "cpu_threads": torch.get_num_threads()}
    print(f"requant load cost, {setup['shape']}; torch {torch.__version__}")
    with tempfile.TemporaryDirectory(prefix="requant-load-") as tmp:
        if not args.skip_cpu:
            experts = layer_experts(args.cpu_experts, args.pool, args.seed)
            rows += run_place("cpu", experts, args.methods, args, Path(tmp))
            del experts
        if torch.cuda.is_available():
            setup["gpu"] = torch.cuda.get_device_name(0)
            experts = layer_experts(EXPERTS, args.pool, args.seed)
            print(f"full layer: {experts.nbytes / 1e9:.2f} GB of MXFP4")
            rows += run_place("gpu-resident", experts, args.methods, args, Path(tmp))
            rows += run_place("gpu-from-host", experts, args.methods, args, Path(tmp))
        else:
            print("no GPU here: GPU rows skipped")
    if args.json:
        Path(args.json).write_text(json.dumps({"setup": setup, "rows": rows}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
