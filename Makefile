# Set-up and test entry points; README's commands and .ci/run call these.
# Each suite gets the environment it needs: the core one (torch CPU, triton
# for ahead-of-time compiles and the interpreter), and one venv per engine.
PYTHON ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
PIP_FLAGS ?= -q --disable-pip-version-check
PYTEST ?= $(VENV)/bin/python -m pytest

.PHONY: demo test test-core test-flydsl venv

venv: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install $(PIP_FLAGS) "$(TORCH_SPEC)"
	$(VENV)/bin/pip install $(PIP_FLAGS) -e ".[test,triton]"
	touch $@

demo: venv
	$(VENV)/bin/kimi-k3-moe demo

test: test-core test-flydsl

test-core: venv
	$(PYTEST) tests/core

# FlyDSL kernels, compile-only (no AMD GPU needed): a venv with flydsl and zig's
# linker, an ld.lld stand-in under .tools/, the CPU emulation and compile checks,
# then the resource table of docs/PERF.md from what was compiled.
FLYDSL_VENV ?= .venv-flydsl
FLYDSL_SPEC ?= flydsl==0.5.0
FLYDSL_ROCM ?= .tools/rocm
FLYDSL_OUT ?= out/flydsl

$(FLYDSL_VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(FLYDSL_VENV)
	$(FLYDSL_VENV)/bin/pip install $(PIP_FLAGS) "$(TORCH_SPEC)"
	$(FLYDSL_VENV)/bin/pip install $(PIP_FLAGS) "$(FLYDSL_SPEC)" -e ".[test,flydsl]"
	touch $@

$(FLYDSL_ROCM)/llvm/bin/ld.lld: $(FLYDSL_VENV)/.installed
	$(FLYDSL_VENV)/bin/python -m kimi_k3_moe.kernels.flydsl.toolchain --shim $(FLYDSL_ROCM)

test-flydsl: $(FLYDSL_VENV)/.installed $(FLYDSL_ROCM)/llvm/bin/ld.lld
	KIMI_K3_MOE_FLYDSL_ROCM="$(abspath $(FLYDSL_ROCM))" KIMI_K3_MOE_REQUIRE_FLYDSL=1 \
	KIMI_K3_MOE_FLYDSL_OUT="$(FLYDSL_OUT)" $(FLYDSL_VENV)/bin/python -m pytest tests/flydsl
	$(FLYDSL_VENV)/bin/python benchmarks/flydsl_resources.py --summary $(FLYDSL_OUT)/summary.json
