# Two commands for a fresh machine: `make demo` (install + the main job) and `make test` (install + tests).
# Installs go into a project-local .venv. CPU machines get torch 2.13.0 (CPU build) and onnxruntime;
# machines with an NVIDIA GPU get onnxruntime-gpu instead (never both in one environment).

PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV   := .venv
PY     := $(VENV)/bin/python
GPU    := $(shell nvidia-smi -L >/dev/null 2>&1 && echo yes)
ORT    := $(if $(GPU),gpu,cpu)
PIP    := $(PY) -m pip install --quiet --disable-pip-version-check

.PHONY: install demo test test-isa test-all bench gpu-check clean

install: $(VENV)/.installed-$(ORT)

$(VENV)/.installed-$(ORT): pyproject.toml
	@echo "==> creating $(VENV) with $(PYTHON) (onnxruntime for $(ORT))"
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@rm -f $(VENV)/.installed-*
	$(if $(GPU),,$(PIP) "torch==2.13.0")
	$(PIP) -e ".[$(ORT),export,import,dev,serve,ray,audio]"
	@touch $@

demo: install
	$(VENV)/bin/onnxformer demo

test: install
	$(PY) -m pytest -q -m "not gpu and not slow" --durations=10

# the fast suite under each instruction set this CPU can stand in for, and int8 weights of 7 and 8 bits forced
test-isa: install
	bash scripts/test_isa.sh out/test-isa

test-all: install
	$(PY) -m pytest -q --durations=15

bench: install
	bash benchmarks/run.sh

gpu-check: install
	bash scripts/gpu_check.sh out/gpu-check

clean:
	rm -rf $(VENV) out .pytest_cache
