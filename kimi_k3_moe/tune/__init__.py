"""`kimi-k3-moe tune`: the generic loop (`loop`) and one target per backend (`triton_target`, `flydsl_target`)."""
