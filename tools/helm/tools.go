//go:build tools

// Package tools records the helm command this module builds (`go build helm.sh/helm/v4/cmd/helm`),
// so that `go mod tidy` keeps its requirements.
package tools

import _ "helm.sh/helm/v4/cmd/helm"
