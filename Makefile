# Set-up and test entry points; README's commands and .ci/run call these.
# Each suite gets the environment it needs: the core one (torch CPU, triton
# for ahead-of-time compiles and the interpreter), and one venv per engine.
PYTHON ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
PIP_FLAGS ?= -q --disable-pip-version-check
PYTEST ?= $(VENV)/bin/python -m pytest

.PHONY: demo test test-core test-triton test-compile-triton venv

venv: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install $(PIP_FLAGS) "$(TORCH_SPEC)"
	$(VENV)/bin/pip install $(PIP_FLAGS) -e ".[test,triton]"
	touch $@

demo: venv
	$(VENV)/bin/kimi-k3-moe demo

test: test-core test-triton test-compile-triton

test-core: venv
	$(PYTEST) tests/core

# Triton backend: kernels under the CPU interpreter, then ahead-of-time compiles
# of every table specialisation for sm_90, gfx942 and gfx950 (separate processes:
# the interpreter must be off for the compiles).
test-triton: venv
	TRITON_INTERPRET=1 $(PYTEST) tests/triton

test-compile-triton: venv
	TRITON_INTERPRET=0 $(PYTEST) tests/compile
