"""Shape properties shared by every form of a layer's experts whose w13 codes are [E, 2I, H/2] uint8."""
from __future__ import annotations

import torch


class PackedShapes:
    """num_experts, hidden_size, intermediate_size and device, read off the w13 codes
    (the field `W13_FIELD` names: "w13" in prepared forms, "w13_packed" in Mxfp4Experts)."""

    W13_FIELD = "w13"

    @property
    def num_experts(self) -> int:
        return getattr(self, self.W13_FIELD).shape[0]

    @property
    def hidden_size(self) -> int:
        return getattr(self, self.W13_FIELD).shape[2] * 2

    @property
    def intermediate_size(self) -> int:
        return getattr(self, self.W13_FIELD).shape[1] // 2

    @property
    def device(self) -> torch.device:
        return getattr(self, self.W13_FIELD).device
