"""The MoE stage-1 activations: SiLU and Kimi-K3's SiTUv2.

Stage 1 produces `[gate | up]` per token row; every path (kernels, reference,
self-check) turns it into `[I]` with one of these. The betas never get a
default here: they come from the model's HF config or from the caller.
"""
from __future__ import annotations

import math
import struct
from dataclasses import dataclass
from typing import Any

import torch

from kimi_k3_moe.configs.hf_dict import ConfigError, load_config_dict, text_config

SILU = "silu"
SITUV2 = "situv2"
# hidden_act values accepted in an HF config, and the activation each one means.
HF_ACTIVATION_NAMES = {"silu": SILU, "situ": SITUV2, "situv2": SITUV2}


class UnsupportedActivationError(ConfigError):
    """An activation this package does not implement (it never substitutes another)."""


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    # fp32 at least; float64 inputs (the reference) stay float64.
    return torch.promote_types(dtype, torch.float32)


def _split_gate_up(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    if x.shape[-1] % 2:
        raise ValueError(
            f"stage-1 output must be [..., 2I] (gate|up); last dim is {x.shape[-1]}"
        )
    return x.to(_compute_dtype(x.dtype)).chunk(2, dim=-1)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up, fp32 inside, result in x's dtype."""
    gate, up = _split_gate_up(x)
    return (torch.nn.functional.silu(gate) * up).to(x.dtype)


def situv2_and_mul(
    x: torch.Tensor, beta: float, linear_beta: float | None
) -> torch.Tensor:
    """SiTUv2: beta*tanh(gate/beta)*sigmoid(gate) * linear_beta*tanh(up/linear_beta).

    `linear_beta=None` lets `up` through unchanged. fp32 inside, result in x's dtype.
    """
    _check_beta("beta", beta)
    if linear_beta is not None:
        _check_beta("linear_beta", linear_beta)
    gate, up = _split_gate_up(x)
    gate_act = beta * torch.tanh(gate / beta) * torch.sigmoid(gate)
    up_act = up if linear_beta is None else linear_beta * torch.tanh(up / linear_beta)
    return (gate_act * up_act).to(x.dtype)


FLOAT32_MAX, FLOAT32_TINY = 3.4028234663852886e38, 1.1754943508222875e-38


def _check_beta(field: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{field} must be a number, got {value!r}")
    try:
        as_float = float(value)
    except OverflowError:  # an int beyond any float
        as_float = math.inf
    if not math.isfinite(as_float) or as_float <= 0:
        shown = repr(value) if len(repr(value)) <= 40 else f"{repr(value)[:12]}... ({len(repr(value))} digits)"
        raise ValueError(f"{field} must be finite and > 0, got {shown}")
    # the kernels take the betas as float32: beyond its range one rounds to inf or 0 and serves NaN
    if not FLOAT32_TINY <= as_float <= FLOAT32_MAX:
        raise ValueError(f"{field} {value!r} is outside float32's normal range [{FLOAT32_TINY:.4g}, "
                         f"{FLOAT32_MAX:.4g}], which the kernels compute in")


def _float_bits(value: float) -> str:
    return struct.pack(">d", float(value)).hex()


@dataclass(frozen=True)
class ActivationSpec:
    """Which activation a MoE layer uses, with its exact parameters.

    Immutable and hashable, so it can key caches of compiled kernels.
    """

    name: str
    beta: float | None = None
    linear_beta: float | None = None

    def __post_init__(self) -> None:
        if self.name not in (SILU, SITUV2):
            raise UnsupportedActivationError(
                f"activation {self.name!r} is not supported; choose {SILU!r} or {SITUV2!r}"
            )
        if self.name == SILU:
            if self.beta is not None or self.linear_beta is not None:
                raise ValueError("silu takes no betas; got "
                                 f"beta={self.beta!r}, linear_beta={self.linear_beta!r}")
            return
        if self.beta is None:
            raise ValueError("situv2 needs beta (activation_situ_beta); none was given")
        _check_beta("beta (activation_situ_beta)", self.beta)
        object.__setattr__(self, "beta", float(self.beta))
        if self.linear_beta is not None:
            _check_beta("linear_beta (activation_situ_linear_beta)", self.linear_beta)
            object.__setattr__(self, "linear_beta", float(self.linear_beta))

    @classmethod
    def silu(cls) -> ActivationSpec:
        return cls(SILU)

    @classmethod
    def situv2(cls, beta: float, linear_beta: float | None) -> ActivationSpec:
        return cls(SITUV2, beta, linear_beta)

    @classmethod
    def from_hf_config(cls, config: Any) -> ActivationSpec:
        """Read `hidden_act` and the SiTU betas from a flat or nested HF config.

        `config` is a dict, a path to `config.json` or its folder, or a
        transformers config. A missing `activation_situ_beta` is an error (no
        default); a missing or null `activation_situ_linear_beta` means the
        up half passes unchanged, as SiTUv2 defines.
        """
        fields = text_config(load_config_dict(config))
        if "hidden_act" not in fields:
            raise ConfigError("HF config has no hidden_act")
        act = fields["hidden_act"]
        name = HF_ACTIVATION_NAMES.get(act) if isinstance(act, str) else None
        if name is None:
            raise UnsupportedActivationError(
                f"hidden_act {act!r} is not supported; accepted: "
                f"{sorted(HF_ACTIVATION_NAMES)}"
            )
        if name == SILU:
            return cls.silu()
        if fields.get("activation_situ_beta") is None:
            raise ConfigError(
                f"hidden_act is {act!r} but activation_situ_beta is missing; "
                "refusing to guess (engines disagree on its default)"
            )
        try:
            return cls.situv2(fields["activation_situ_beta"], fields.get("activation_situ_linear_beta"))
        except ValueError as exc:
            raise ConfigError(f"HF config: {exc}") from None

    def defaults_note(self) -> str:
        """What was decided for a field the config left out ("" when nothing was): for logs and doctor."""
        if self.name == SITUV2 and self.linear_beta is None:
            return ("no activation_situ_linear_beta in the config: the up half passes unchanged "
                    "(identity, linear_beta=None), as SiTUv2 defines")
        return ""

    def apply(self, x: torch.Tensor) -> torch.Tensor:
        if self.name == SILU:
            return silu_and_mul(x)
        return situv2_and_mul(x, self.beta, self.linear_beta)

    def cache_tag(self) -> str:
        """A name fragment that differs for any two specs differing in any bit."""
        if self.name == SILU:
            return SILU
        linear = "none" if self.linear_beta is None else _float_bits(self.linear_beta)
        return f"{SITUV2}_b{_float_bits(self.beta)}_lb{linear}"

    def __str__(self) -> str:
        if self.name == SILU:
            return SILU
        return f"{SITUV2}(beta={self.beta:g}, linear_beta={self.linear_beta})"
