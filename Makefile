# Set-up and test entry points; README's commands and .ci/run call these.
# Each suite gets the environment it needs: the core one (torch CPU, triton
# for ahead-of-time compiles and the interpreter), and one venv per engine.
PYTHON ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
PIP_FLAGS ?= -q --disable-pip-version-check
PYTEST ?= $(VENV)/bin/python -m pytest

.PHONY: demo test test-core test-gsm8k venv

venv: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install $(PIP_FLAGS) "$(TORCH_SPEC)"
	$(VENV)/bin/pip install $(PIP_FLAGS) -e ".[test,triton]"
	touch $@

demo: venv
	$(VENV)/bin/kimi-k3-moe demo

test: test-core test-gsm8k test-vllm

test-core: venv
	$(PYTEST) tests/core

# GSM8K job against a localhost server the tests start (standard library client)
test-gsm8k: venv
	$(PYTEST) tests/gsm8k

# --- vLLM plugin suite: the real vllm wheel in its own venv (~9.4 GB, ~4 min).
# vLLM picks its torch (2.14, a CUDA build that runs on the CPU); the freeze
# taken right after is a constraints file, so installing our package can add
# packages but never change one vLLM installed.
VLLM_VENV ?= .venv-vllm
VLLM_SPEC ?= vllm==0.33.0

.PHONY: venv-vllm test-vllm

venv-vllm: $(VLLM_VENV)/.installed

$(VLLM_VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install $(PIP_FLAGS) "$(VLLM_SPEC)"
	$(VLLM_VENV)/bin/pip freeze --exclude-editable | grep -v ' @ ' > $(VLLM_VENV)/engine-constraints.txt
	$(VLLM_VENV)/bin/pip install $(PIP_FLAGS) -c $(VLLM_VENV)/engine-constraints.txt -e ".[test]"
	touch $@

# VLLM_TARGET_DEVICE=cpu selects vLLM's CPU platform (no GPU here); VLLM_PLUGINS
# would filter our entry point: the suite sets it itself where it needs it.
test-vllm: venv-vllm
	env -u VLLM_PLUGINS VLLM_TARGET_DEVICE=cpu $(VLLM_VENV)/bin/python -m pytest tests/engines/vllm
