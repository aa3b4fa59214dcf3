"""GSM8K accuracy against a live vLLM or SGLang server (`kimi-k3-moe gsm8k`).

Standard library only (threads + http.client), so the job runs from a bare
client box: data loading (data.py), prompts (prompts.py), answer extraction
(answers.py), the HTTP client with retries (client.py), the report and resume
(report.py), the pass/fail gate (gate.py), the job loop (job.py) and the
command (command.py).
"""
