"""`get_backend("triton", weight_format="mxfp4"|"int4")`: the Triton MoE backend.

forward = token alignment (or none, on the small-batch path) -> stage 1
(gate/up with SiLU or SiTUv2 in the epilogue) -> stage 2 (down projection,
router weight, fixed-order fp32 top-k sum). Tile configs come from the tuned
table of this device (configs/tables/triton_<device>.json) or a heuristic.
Nothing in forward reads device memory from the host, so it can be captured
in a CUDA graph.
"""
from __future__ import annotations

import importlib.util
import json
import logging
import os
from dataclasses import replace
from functools import lru_cache

import torch

from kimi_k3_moe.act_quant import BF16, check_supported
from kimi_k3_moe.activation import ActivationSpec
from kimi_k3_moe.experts import MXFP4, WeightFormat
from kimi_k3_moe.formats import int4
from kimi_k3_moe.kernels.base import BackendUnavailable, MoEBackend
from kimi_k3_moe.kernels.common import alignment
from kimi_k3_moe.kernels.triton import INTERPRETER_ARCH, SPEC
from kimi_k3_moe.kernels.triton import table as triton_table
from kimi_k3_moe.kernels.triton.layout import TritonExperts
from kimi_k3_moe.kernels.triton.table import Lookup, MoEConfig
from kimi_k3_moe.kernels.triton.tickets import tickets
from kimi_k3_moe.platform import PDL_MIN_SM, TRITON_MIN_SM, detect_platform, for_arch, is_rocm, sm_version
from kimi_k3_moe.reference import check_routing

ENV_INTERPRET = "TRITON_INTERPRET"
DEFAULT_CHUNK_TOKENS = 16384


def interpreter_on() -> bool:
    return os.environ.get(ENV_INTERPRET, "0") == "1"


def detect_arch() -> str | None:
    """"interpreter" under TRITON_INTERPRET=1, else "sm_90" / "gfx942" / ... of the current GPU, else None."""
    if interpreter_on():
        return INTERPRETER_ARCH
    if not torch.cuda.is_available():
        return None
    return detect_platform(torch.cuda.current_device()).arch


class TritonBackend(MoEBackend):
    name = "triton"
    spec = SPEC

    def __init__(self, weight_format: str = MXFP4, int4_method: str = int4.DEFAULT_METHOD, *,
                 config: MoEConfig | None = None, decode: str | None = None,
                 table: dict | None = None, chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
                 act_dtype: str = BF16, arch: str | None = None):
        """`config` pins one MoEConfig for every batch (tests, tuner); `decode`
        ("ptx"|"bits") overrides the table's decoder; `table` replaces the
        packaged table; batches above `chunk_tokens` run in chunks (bounds the
        per-pair buffers). `act_dtype` is "bf16" (the only one: see kernels/triton/__init__.py);
        `arch` ("sm_90", "gfx942", ...) defaults to this machine's."""
        try:
            weight_format = WeightFormat.of(weight_format, int4_method)
        except ValueError as exc:
            raise ValueError(f"triton backend: {exc}") from None
        if decode not in (None, *triton_table.DECODES):
            raise ValueError(f"triton backend: decode {decode!r} not in {triton_table.DECODES}")
        if chunk_tokens < 1:
            raise ValueError(f"triton backend: chunk_tokens must be >= 1, got {chunk_tokens}")
        self.arch = arch if arch is not None else detect_arch()
        # as the spec declares (the error names the arch and its choices)
        act_dtype = check_supported(self.name, self.arch, act_dtype,
                                    SPEC.act_dtypes(for_arch(self.arch), weight_format.kind))
        self.act_dtype = act_dtype
        self.act_quant = SPEC.act_quant_for(self.arch, act_dtype)
        self.format = weight_format
        self.prepared_types = (TritonExperts,)
        self.config = config
        self.decode = decode
        self.table = table
        self.chunk_tokens = chunk_tokens

    def describe(self) -> str:
        if self.act_quant.quantizes:
            return f"{self.name}[{self.format}, {self.act_quant.tag()}]"
        return f"{self.name}[{self.format}]"

    # -- where it runs --------------------------------------------------
    def available(self) -> tuple[bool, str]:
        if importlib.util.find_spec("triton") is None:
            return False, "the triton package is not installed (pip install 'kimi-k3-moe[triton]')"
        if interpreter_on():
            return True, "Triton interpreter (TRITON_INTERPRET=1): CPU tensors, tiny shapes, tests only"
        if not torch.cuda.is_available():
            return False, ("no GPU visible to PyTorch (torch.cuda.is_available() is False); the Triton "
                           "kernels need an NVIDIA sm_80+ or AMD GPU (TRITON_INTERPRET=1 runs them on "
                           "the CPU interpreter, for tests only)")
        here = detect_platform(torch.cuda.current_device())
        if here.vendor == "cuda" and here.sm < TRITON_MIN_SM:
            return False, f"{here.device_name} is {here.arch}; the Triton kernels need sm_{TRITON_MIN_SM} or newer"
        import triton
        return True, f"Triton {triton.__version__} on {here.device_name}"

    @staticmethod
    def _target(device: torch.device) -> tuple[str, bool]:
        """(device key for the config table, whether the PTX decoder can run)."""
        if device.type != "cuda":
            return "interpreter", False
        name = torch.cuda.get_device_name(device)
        return triton_table.device_key(name), not is_rocm()

    # -- weights --------------------------------------------------------
    def prepare(self, experts) -> TritonExperts:
        prepared = super().prepare(experts)
        alignment.counters(prepared.device, prepared.num_experts)  # at load: never first inside a graph capture
        tickets(prepared.device)  # likewise the split stage 1's
        return prepared

    def lay_out(self, experts) -> TritonExperts:
        """MXFP4 or int4 experts -> the kernels' word layout."""
        prepared = TritonExperts.from_experts(experts)
        if prepared.wide_scales:
            _log_wide_scales_once()
        return prepared

    # -- configs --------------------------------------------------------
    def lookup(self, prepared, num_tokens: int) -> Lookup:
        dev_key, is_cuda = self._target(prepared.device)
        has_pdl = sm_version(self.arch) >= PDL_MIN_SM and triton_has_pdl()
        if self.config is not None:
            found = Lookup(self.config, "pinned")
        else:
            found = _cached_lookup(dev_key, prepared.weight_format, prepared.num_experts, prepared.hidden_size,
                                   prepared.intermediate_size, num_tokens, is_cuda, self.table, self.arch)
        cfg = found.config
        if self.decode is not None and self.decode != cfg.decode:
            cfg = replace(cfg, decode=self.decode)
        target_cfg = cfg.for_target(is_cuda, has_pdl)
        decoded = "" if cfg is found.config else f" decode={target_cfg.decode}"
        return Lookup(target_cfg, found.source + decoded)

    # -- running --------------------------------------------------------
    def plan(self, prepared, hidden: torch.Tensor, topk_weights: torch.Tensor,
             topk_ids: torch.Tensor, activation: ActivationSpec, expert_map: torch.Tensor | None,
             out: torch.Tensor):
        """The launches for one chunk (<= chunk_tokens tokens); used by forward and the benchmarks."""
        cfg = self.lookup(prepared, hidden.shape[0]).config
        from kimi_k3_moe.kernels.triton.moe import plan_moe
        return plan_moe(prepared, hidden, topk_weights, topk_ids, activation, expert_map, out, cfg)

    def forward(self, prepared: TritonExperts, hidden: torch.Tensor, topk_weights: torch.Tensor,
                topk_ids: torch.Tensor, activation: ActivationSpec,
                expert_map: torch.Tensor | None = None, *, out: torch.Tensor | None = None) -> torch.Tensor:
        """`out` ([T, H], hidden's dtype), when given, receives the result (every element is written)."""
        if not isinstance(prepared, TritonExperts):
            raise TypeError(f"triton backend: forward() needs prepare()'s result (TritonExperts), "
                            f"got {type(prepared).__name__}")
        hidden, topk_weights, topk_ids, expert_map = self._check_inputs(
            prepared, hidden, topk_weights, topk_ids, expert_map)
        if out is None:
            out = torch.empty_like(hidden)
        elif out.shape != hidden.shape or out.dtype != hidden.dtype or out.device != hidden.device \
                or out.stride(-1) != 1:
            raise ValueError(f"out must be a row-major {tuple(hidden.shape)} {hidden.dtype} tensor on "
                             f"{hidden.device}, got {tuple(out.shape)} {out.dtype} on {out.device}")
        for start in range(0, hidden.shape[0], self.chunk_tokens):
            stop = min(hidden.shape[0], start + self.chunk_tokens)
            for launch in self.plan(prepared, hidden[start:stop], topk_weights[start:stop],
                                    topk_ids[start:stop], activation, expert_map, out[start:stop]):
                launch()
        return out

    def _check_inputs(self, prepared, hidden, topk_weights, topk_ids, expert_map):
        check_routing(hidden, topk_weights, topk_ids, hidden_size=prepared.hidden_size,
                      num_experts=prepared.num_experts, expert_map=expert_map)
        for name, t in (("hidden", hidden), ("topk_weights", topk_weights), ("topk_ids", topk_ids),
                        ("expert_map", expert_map)):
            if t is not None and t.device != prepared.device:
                raise ValueError(f"{name} is on {t.device}, the experts on {prepared.device}")
        if hidden.stride(-1) != 1:
            hidden = hidden.contiguous()
        return hidden, topk_weights.contiguous(), topk_ids.contiguous(), \
            None if expert_map is None else expert_map.contiguous()


@lru_cache(maxsize=1)
def triton_has_pdl() -> bool:
    """Whether this Triton launches programmatic dependents (3.4+: launch_pdl, griddepcontrol)."""
    from kimi_k3_moe.kernels.common._details import pdl
    return pdl.AVAILABLE


@lru_cache(maxsize=1)
def _log_wide_scales_once() -> None:
    logging.getLogger(__name__).info(
        "MXFP4 experts with a scale above 2 (an e8m0 byte above 128): their layers decode with two bf16 "
        "multiplies per weight pair instead of one (docs/TRITON.md, Decoding); results are the same")


@lru_cache(maxsize=4096)
def _cached_lookup_inner(dev_key, weight_format, e, h, i, t, is_cuda, arch) -> Lookup:
    return triton_table.lookup(dev_key, weight_format, e, h, i, t, is_cuda=is_cuda, verify=spill_check(arch), arch=arch)


def _cached_lookup(dev_key, weight_format, e, h, i, t, is_cuda, table, arch) -> Lookup:
    if table is not None:
        return triton_table.lookup(dev_key, weight_format, e, h, i, t, is_cuda=is_cuda, table=table,
                                   verify=spill_check(arch))
    return _cached_lookup_inner(dev_key, weight_format, e, h, i, t, is_cuda, arch)


# what a table entry tuned under another Triton is compiled with before it serves: the model's activation
# (the betas are runtime arguments: every pair shares the binary) and its top-k
CHECK_ACTIVATION = ActivationSpec.situv2(4.0, 25.0)
CHECK_TOP_K = 16


def spill_check(arch: str):
    """The lookup's check of a table entry tuned under another Triton (triton_table.Verify)."""
    return lambda cfg, weight_format, e, h, i, tier: _spills(arch, weight_format, e, h, i, tier,
                                                             json.dumps(cfg.to_json(), sort_keys=True))


@lru_cache(maxsize=256)
def _spills(arch: str, weight_format: str, e: int, h: int, i: int, tier: int, cfg_json: str) -> str | None:
    """None when every launch of this config compiles for `arch` under the running Triton without
    spilling (aot.CompileReport; once per config: compiling is seconds, on the CPU), else why not."""
    from kimi_k3_moe.kernels.triton import aot
    if arch not in aot.TARGETS:
        return f"no compile check for {arch}"
    cfg = MoEConfig.from_json(json.loads(cfg_json))
    plan = aot.plan_for_shape(aot.meta_experts(weight_format, e, h, i), tier, CHECK_TOP_K, CHECK_ACTIVATION, cfg)
    for launch in plan:
        try:
            report, _ = aot.compile_launch(launch, arch)
        except Exception as exc:  # noqa: BLE001  (any compile failure refuses the entry, with its reason)
            return f"{launch.label} does not compile ({type(exc).__name__})"
        if report.spills:
            return f"{launch.label} spills {report.spills} bytes"
    return None


__all__ = ["TritonBackend", "BackendUnavailable"]
