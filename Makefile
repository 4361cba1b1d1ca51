# vamp-sglang: every command a newcomer needs. `make demo` runs the main job, `make test` the tests.
SHELL := /bin/bash
PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# qwen3_moe, mixtral, qwen3_next (the paper's hybrid model), deepseek_v3 or deepseek_v2 (MLA), glm4_moe (GLM-4.5),
# qwen3_5_moe (Qwen3.5/3.6 MoE): `make demo ARCH=qwen3_next`
ARCH ?= qwen3_moe
# fp8: the block-FP8 checkpoint of that arch (docs/fp8.md): `make demo QUANT=fp8`
QUANT ?= none
MODEL ?= models/tiny-$(subst _,-,$(ARCH))$(if $(filter fp8,$(QUANT)),-fp8)
PORT ?= 30000
MAX_TOTAL_TOKENS ?= 8192
VAMP_FLAGS ?=

.PHONY: install test test-long test-fast test-server test-dashboard lint serve-cpu demo model clean

install: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -e '.[test,eval,dev]'
	touch $(STAMP)

# The suite in two halves: `test` under 10 minutes here, `test-long` (the multi-server modules) 53-60; CI (.ci/run) runs both.
test: install
	OMP_NUM_THREADS=1 $(PY) -m pytest -q -m "not long" --durations=15

test-long: install
	OMP_NUM_THREADS=1 $(PY) -m pytest -q -m long --durations=15

test-fast: install
	OMP_NUM_THREADS=1 $(PY) -m pytest -q -m "not server"

test-server: install
	OMP_NUM_THREADS=1 $(PY) -m pytest -q -m server

# The Grafana dashboard against a real Prometheus (installs Debian's prometheus package when missing).
test-dashboard: model
	OMP_NUM_THREADS=1 $(PY) -m pytest -q tests/test_dashboard_prometheus.py

lint: install
	$(VENV)/bin/ruff check vamp_sglang eval tests

model: install
	$(PY) -m vamp_sglang.tiny_moe $(MODEL) --arch $(ARCH) --quant $(QUANT)

serve-cpu: model
	OMP_NUM_THREADS=1 $(PY) -m vamp_sglang.launch_server --model-path $(MODEL) --device cpu \
		--host 127.0.0.1 --port $(PORT) --max-total-tokens $(MAX_TOTAL_TOKENS) --enable-metrics \
		--enable-cache-report $(VAMP_FLAGS)

demo: model
	OMP_NUM_THREADS=1 $(PY) -m eval.demo --model $(MODEL)

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis

-include eval/eval.mk

# The eval targets (eval/eval.mk) need the environment and, on CPU, the tiny model.
ablation-ratio ablation-policy sweep-concurrency: model
report: install
