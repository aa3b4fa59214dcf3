"""Engine entry points (vLLM `vllm.general_plugins`, SGLang `sglang.srt.plugins`)."""
