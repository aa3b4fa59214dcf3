"""Expert data, the bottom floor: what a layer's experts are, in each format and layout.

`Mxfp4Experts` (MXFP4 as checkpoints hold it) -> `WeightFormat` conversion
(`weights.requant`) -> `Int4Experts` -> a backend's `PackedExperts` subclass
(the same values in its `Layout`). Imports only `formats` and torch.
"""
from kimi_k3_moe.experts.format import INT4, KINDS, MXFP4, MXFP4_FORMAT, WeightFormat
from kimi_k3_moe.experts.int4 import Int4Experts
from kimi_k3_moe.experts.mxfp4 import Mxfp4Experts
from kimi_k3_moe.experts.packed import CHECKPOINT_LAYOUT, Layout, PackedExperts, require_format
from kimi_k3_moe.experts.shapes import PackedShapes

__all__ = ["CHECKPOINT_LAYOUT", "Mxfp4Experts", "INT4", "Int4Experts", "KINDS", "Layout", "MXFP4", "MXFP4_FORMAT",
           "PackedExperts", "PackedShapes", "WeightFormat", "require_format"]
