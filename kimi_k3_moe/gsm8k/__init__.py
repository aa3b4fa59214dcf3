"""GSM8K accuracy against a live vLLM or SGLang server (`kimi-k3-moe gsm8k`).

Standard library only (threads + http.client), so the job runs from a bare
client box: data loading (data.py), prompt text (prompts.py), the lm-eval and
vLLM protocols (protocols.py) and their scoring (answers_lmeval.py,
answers_vllm.py), the HTTP client with retries (client.py), the report and
resume (report.py), the pass/fail gate (gate.py), the job loop (job.py) and the
command (command.py).
"""
