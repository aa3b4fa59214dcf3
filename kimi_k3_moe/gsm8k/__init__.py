"""GSM8K accuracy against a live vLLM or SGLang server (`kimi-k3-moe gsm8k`).

The standard library plus aiohttp (a dependency of kimi-k3-moe, and already
there wherever vLLM, SGLang or lm-eval is), so the job runs from a bare client
box: data loading (data.py), prompt text (prompts.py), the lm-eval and
vLLM protocols (protocols.py) and their scoring (answers_lmeval.py,
answers_vllm.py), the HTTP client with retries and a total deadline per request (client.py), the report and
resume (report.py), the pass/fail gate (gate.py), the job loop (job.py) and the
command (command.py).
"""
