// Command coredns is CoreDNS with only the plugins a Kubernetes cluster's default Corefile names,
// the way CoreDNS documents building a server from chosen plugins (coremain plus plugin imports);
// the full build links every cloud provider's SDK, which this cluster never calls.
package main

import (
	"github.com/coredns/coredns/core/dnsserver"
	"github.com/coredns/coredns/coremain"

	_ "github.com/coredns/coredns/plugin/bind"
	_ "github.com/coredns/coredns/plugin/cache"
	_ "github.com/coredns/coredns/plugin/errors"
	_ "github.com/coredns/coredns/plugin/forward"
	_ "github.com/coredns/coredns/plugin/kubernetes"
	_ "github.com/coredns/coredns/plugin/log"
	_ "github.com/coredns/coredns/plugin/loop"
	_ "github.com/coredns/coredns/plugin/reload"
)

// The order a query passes through the plugins, as in CoreDNS's plugin.cfg.
var directives = []string{"reload", "bind", "errors", "log", "cache", "loop", "kubernetes", "forward"}

func main() {
	dnsserver.Directives = directives
	coremain.Run()
}
