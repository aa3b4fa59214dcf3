"""Checkpoint reading, load-time requantisation, synthetic checkpoints."""
from kimi_k3_moe.weights.checkpoint import (
                                            CheckpointError,
                                            CheckpointReader,
                                            expert_tensor_name,
                                            read_layer_experts,
                                            read_router,
)

__all__ = ["CheckpointError", "CheckpointReader", "expert_tensor_name", "read_layer_experts",
           "read_router"]
