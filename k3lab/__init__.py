"""Development tools of kimi-k3-moe, outside the serving package and not in the wheel: what the
tests and benchmarks use to check and model kernels that cannot run here. Nothing in kimi_k3_moe
imports it (tests/core/test_import_layers.py)."""
