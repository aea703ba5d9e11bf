"""A one-node Kubernetes cluster from parts built here, every component a process on this machine,
the way Kubernetes tests itself on one host (`hack/local-up-cluster.sh`): etcd, kube-apiserver,
kube-controller-manager, kube-scheduler, kube-proxy and a kubelet from the pinned
`k8s.io/kubernetes` module (tools/kube/), CoreDNS (tools/coredns/), and Debian's containerd, runc
and CNI plugins (bridge + host-local + portmap). Pods run in containers, with their own network
namespaces on a bridge, reach Services through kube-proxy's iptables rules and resolve
`*.svc.cluster.local` through CoreDNS; `kubectl port-forward`, logs and probes go through the
kubelet as on any cluster.

    python tests/helpers/cluster.py up      # builds what is missing, runs until Ctrl-C
    make cluster                            # the same

Needs root (containers, iptables, mounts). What this VM needs, found by trying (details in
../shared/MACHINE-NOTES.md): cgroup v1 is accepted only with `failCgroupV1: false`; the VM
withholds CAP_SYS_RESOURCE, so containerd must not give sandboxes a negative oom_score_adj
(`restrict_oom_score_adj`); no registry is reachable, so every image, the pause image included,
is built here (images.py) and pods use what is on the node.

Everything lives under one run folder and is torn down on exit (containers, mounts, the bridge,
kube-proxy's rules); containerd's image store is kept in CACHE so that a 5 GB image is imported
once, not per run."""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import envtest
import httpx
import images
import yaml
from envtest import BIN, REPO, ControlPlane, Kube, node_address, stop_process
from kubectl import LOCAL_VALUES, NODE_CACHE_PATH, RELEASE, RELEASE_NS
from waiting import wait_for

POD_CIDR, SERVICE_CIDR, CLUSTER_DOMAIN = "10.244.0.0/24", "10.96.0.0/16", "cluster.local"
KUBERNETES_SERVICE_IP = "10.96.0.1"
NODE_BINARIES = ("kube-controller-manager", "kube-scheduler", "kube-proxy", "kubelet", "coredns", "objectstore", "helm")
STATE = images.CACHE / "containerd"  # kept between runs: the imported images
CHAINS = ("KUBE-", "CNI-")  # iptables chains of the kubelet, kube-proxy and the CNI plugins


def node_binaries() -> dict[str, Path]:
    found = {name: BIN / name for name in NODE_BINARIES}
    missing = [str(p) for p in found.values() if not os.access(p, os.X_OK)]
    if missing:
        raise RuntimeError(f"missing {', '.join(missing)}: run `make cluster-bin` (builds tools/ with Go)")
    return found


def missing_host_parts() -> list[str]:
    """What this machine lacks to run the cluster (root and Debian's packages), empty when ready."""
    missing = [] if os.geteuid() == 0 else ["root"]
    for tool in ("containerd", "runc", "buildah", "debootstrap", "iptables", "ctr", "gcc"):
        if shutil.which(tool) is None:
            missing.append(tool)
    if not Path("/usr/lib/cni/bridge").exists():
        missing.append("containernetworking-plugins")
    return missing


class Node(ControlPlane):
    """The control plane of envtest.ControlPlane, listening on this machine's address so that pods
    reach it, plus everything that makes it a node."""

    def __init__(self, folder: Path) -> None:
        self.address = node_address()
        self.name = "loraplane-node"
        super().__init__(folder, hosts=["kubernetes", "kubernetes.default", "kubernetes.default.svc",
                                        f"kubernetes.default.svc.{CLUSTER_DOMAIN}", self.name],
                         ips=[self.address, KUBERNETES_SERVICE_IP])  # fmt: skip
        self.url = f"https://{self.address}:{self.port}"
        self.bins.update(node_binaries())
        self.bins["containerd"] = Path(shutil.which("containerd") or "/usr/bin/containerd")
        self.admin = Kube(self, self.admin_kubeconfig)
        self.containerd_socket = folder / "containerd" / "containerd.sock"
        self.ctr = ["ctr", "--address", str(self.containerd_socket)]
        self.processes: dict[str, subprocess.Popen[bytes]] = {}
        self.kubelet_root = folder / "kubelet"

    def apiserver_args(self) -> list[str]:
        return [
            "--etcd-servers", self.etcd_url, "--bind-address", "0.0.0.0", "--advertise-address", self.address,
            "--secure-port", str(self.port), "--cert-dir", str(self.folder / "pki"),
            "--tls-cert-file", str(self.pki.serving[0]), "--tls-private-key-file", str(self.pki.serving[1]),
            "--client-ca-file", str(self.pki.ca),
            "--kubelet-client-certificate", str(self.pki.admin[0]), "--kubelet-client-key", str(self.pki.admin[1]),
            "--kubelet-preferred-address-types", "InternalIP",  # the node's name is in no DNS
            "--service-account-issuer", f"https://kubernetes.default.svc.{CLUSTER_DOMAIN}",
            "--service-account-key-file", str(self.pki.sa_pub),
            "--service-account-signing-key-file", str(self.pki.sa_key),
            "--service-cluster-ip-range", SERVICE_CIDR, "--authorization-mode", "Node,RBAC",
            "--enable-admission-plugins", "NodeRestriction", "--allow-privileged=true",
            "--audit-policy-file", str(self.folder / "audit-policy.yaml"), "--audit-log-path", str(self.audit_log),
            "--audit-log-format", "json",
        ]  # fmt: skip

    # -- bring-up, in dependency order ----------------------------------------------------------

    def start(self) -> None:
        prepare_host()
        super().start()
        self.start_containerd()
        for image in (images.pause(), images.object_store(self.bins["objectstore"]),
                      images.dockerfile("operator", "PYTHON_IMAGE"),
                      images.dockerfile("serving", "CUDA_IMAGE", {"TORCH_INDEX": "https://pypi.org/simple"})):  # fmt: skip
            images.import_into(self.ctr, image)
        admin = str(self.admin_kubeconfig)
        self.spawn("kube-controller-manager", [
            "--kubeconfig", admin, "--authentication-kubeconfig", admin, "--authorization-kubeconfig", admin,
            "--service-account-private-key-file", str(self.pki.sa_key), "--root-ca-file", str(self.pki.ca),
            "--cluster-signing-cert-file", str(self.pki.ca), "--cluster-signing-key-file", str(self.pki.ca_key),
            "--use-service-account-credentials", "--service-cluster-ip-range", SERVICE_CIDR,
            "--bind-address", "127.0.0.1", "--secure-port", "0", "--leader-elect=false",
        ])  # fmt: skip
        self.spawn("kube-scheduler", ["--kubeconfig", admin, "--authentication-kubeconfig", admin,
                                      "--authorization-kubeconfig", admin, "--bind-address", "127.0.0.1",
                                      "--secure-port", "0", "--leader-elect=false"])  # fmt: skip
        self.spawn("kube-proxy", [
            "--kubeconfig", admin, "--hostname-override", self.name, "--proxy-mode", "iptables",
            "--cluster-cidr", POD_CIDR, "--conntrack-max-per-core", "0",
            "--metrics-bind-address", "127.0.0.1:10249", "--healthz-bind-address", "127.0.0.1:10256",
        ])  # fmt: skip
        self.start_coredns()
        self.start_kubelet()
        wait_for("the node Ready", self.node_ready, 180)
        # Until kube-proxy has written its rules, a Service's address leads nowhere (or, on a
        # machine behind a transparent proxy, to that proxy).
        wait_for("kube-proxy's rules", lambda: _ok("http://127.0.0.1:10256/healthz"), 60)
        self.persistent_volume()
        self.check_processes()

    def check_processes(self) -> None:
        """Every component still running: one that exited fails the bring-up with its log."""
        for name, proc in self.processes.items():
            if proc.poll() is not None:
                raise RuntimeError(f"{name} exited ({proc.returncode}):\n{self.log(name)}")

    def start_containerd(self) -> None:
        folder = self.containerd_socket.parent
        (folder / "cni").mkdir(parents=True, exist_ok=True)
        STATE.mkdir(parents=True, exist_ok=True)
        (folder / "cni" / "10-loraplane.conflist").write_text(json.dumps({
            "cniVersion": "1.0.0", "name": "loraplane",
            "plugins": [
                {"type": "bridge", "bridge": "cni0", "isGateway": True, "ipMasq": True, "hairpinMode": True,
                 "ipam": {"type": "host-local", "ranges": [[{"subnet": POD_CIDR}]], "routes": [{"dst": "0.0.0.0/0"}],
                          "dataDir": str(folder / "ipam")}},
                {"type": "portmap", "capabilities": {"portMappings": True}},
            ],
        }))  # fmt: skip
        config = folder / "config.toml"
        config.write_text(f"""version = 2
root = "{STATE}"
state = "{folder / "state"}"
[grpc]
  address = "{self.containerd_socket}"
[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = "{images.PAUSE}"
  # The VM withholds CAP_SYS_RESOURCE: a sandbox's negative oom_score_adj would kill runc.
  restrict_oom_score_adj = true
  [plugins."io.containerd.grpc.v1.cri".containerd]
    snapshotter = "overlayfs"
    default_runtime_name = "runc"
    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = "/usr/lib/cni"
    conf_dir = "{folder / "cni"}"
""")
        self.spawn("containerd", ["--config", str(config)])
        wait_for("containerd", lambda: subprocess.run([*self.ctr, "version"], capture_output=True).returncode == 0, 60)

    def start_coredns(self) -> None:
        """The cluster's DNS on this machine's address (the kubelet's clusterDNS): Services and
        pods of cluster.local from the API, everything else forwarded to the host's resolver."""
        folder = self.folder / "coredns"
        folder.mkdir(exist_ok=True)
        (folder / "Corefile").write_text(f""".:53 {{
    bind {self.address}
    errors
    kubernetes {CLUSTER_DOMAIN} in-addr.arpa ip6.arpa {{
        kubeconfig {self.admin_kubeconfig} envtest
        pods insecure
        fallthrough in-addr.arpa ip6.arpa
    }}
    forward . /etc/resolv.conf
    cache 30
}}
""")
        self.spawn("coredns", ["-conf", str(folder / "Corefile")])

    def start_kubelet(self) -> None:
        folder = self.folder / "kubelet-config"
        folder.mkdir(exist_ok=True)
        cert, key = self.pki.leaf("kubelet", f"system:node:{self.name}", "system:nodes", None, server=False)
        kubeconfig = envtest.kubeconfig(folder / "kubelet.kubeconfig", self.url, self.pki.ca,
                                        {"client-certificate": str(cert), "client-key": str(key)})  # fmt: skip
        config = folder / "config.yaml"
        config.write_text(yaml.safe_dump({
            "apiVersion": "kubelet.config.k8s.io/v1beta1", "kind": "KubeletConfiguration",
            "containerRuntimeEndpoint": f"unix://{self.containerd_socket}",
            "cgroupDriver": "cgroupfs",
            "failCgroupV1": False,  # this kernel offers cgroup v1 (with a cgroup2 mount beside it)
            "failSwapOn": False,
            "clusterDNS": [self.address], "clusterDomain": CLUSTER_DOMAIN, "resolvConf": "/etc/resolv.conf",
            "authentication": {"anonymous": {"enabled": False}, "webhook": {"enabled": True},
                               "x509": {"clientCAFile": str(self.pki.ca)}},
            "authorization": {"mode": "Webhook"},
            "address": self.address, "readOnlyPort": 0, "healthzBindAddress": "127.0.0.1",
            # Nothing can be pulled again: never collect an image, never evict for a full disk
            # the host shares with everything else.
            "imageGCHighThresholdPercent": 100, "imageGCLowThresholdPercent": 99,
            "evictionHard": {"memory.available": "100Mi", "nodefs.available": "1%", "imagefs.available": "1%",
                             "nodefs.inodesFree": "1%"},
            "podCIDR": POD_CIDR,
        }))  # fmt: skip
        self.spawn("kubelet", ["--config", str(config), "--kubeconfig", str(kubeconfig), "--root-dir", str(self.kubelet_root),
                               "--hostname-override", self.name, "--node-ip", self.address, "--v", "1"])  # fmt: skip

    def persistent_volume(self) -> None:
        """A hostPath PersistentVolume, as a cluster admin provides one where no provisioner runs:
        the chart's object store claims it."""
        folder = self.folder / "volumes" / "pv0"
        folder.mkdir(parents=True, exist_ok=True)
        folder.chmod(0o777)
        self.admin.apply({
            "apiVersion": "v1", "kind": "PersistentVolume", "metadata": {"name": "loraplane-pv0"},
            "spec": {"capacity": {"storage": "20Gi"}, "accessModes": ["ReadWriteOnce"],
                     "persistentVolumeReclaimPolicy": "Delete", "hostPath": {"path": str(folder)}},
        })  # fmt: skip

    def node_ready(self) -> bool:
        node = self.admin.get("Node", None, self.name) or {}
        conditions = (node.get("status") or {}).get("conditions") or []
        return any(c["type"] == "Ready" and c["status"] == "True" for c in conditions)

    def spawn(self, name: str, args: list[str]) -> None:
        self.processes[name] = self._spawn(name, args)

    # -- teardown ---------------------------------------------------------------------------------

    def stop(self) -> None:
        """Everything started, in reverse, then what the processes leave behind them: containers
        and their shims, the kubelet's mounts, the bridge, kube-proxy's rules and the node cache's
        hostPath folder a test used."""
        for name in ("kubelet", "coredns", "kube-proxy", "kube-scheduler", "kube-controller-manager"):
            stop_process(self.processes.pop(name, None))
        if "containerd" in self.processes:
            self.remove_containers()
            stop_process(self.processes.pop("containerd"))
        kill_shims(self.containerd_socket)
        unmount_below(self.folder)
        subprocess.run([str(self.bins["kube-proxy"]), "--cleanup"], capture_output=True)
        remove_kube_chains()
        subprocess.run(["ip", "link", "delete", "cni0"], capture_output=True)
        shutil.rmtree(NODE_CACHE_PATH, ignore_errors=True)
        super().stop()

    def remove_containers(self) -> None:
        ns = [*self.ctr, "-n", "k8s.io"]
        for task in _lines([*ns, "tasks", "ls", "-q"]):
            subprocess.run([*ns, "tasks", "kill", "-s", "SIGKILL", task], capture_output=True)
        deadline = time.monotonic() + 30
        while _lines([*ns, "tasks", "ls", "-q"]) and time.monotonic() < deadline:
            for task in _lines([*ns, "tasks", "ls", "-q"]):
                subprocess.run([*ns, "tasks", "delete", "-f", task], capture_output=True)
            time.sleep(0.5)
        for container in _lines([*ns, "containers", "ls", "-q"]):
            subprocess.run([*ns, "containers", "delete", container], capture_output=True)
        for netns in Path("/var/run/netns").glob("cni-*") if Path("/var/run/netns").exists() else []:
            subprocess.run(["ip", "netns", "delete", netns.name], capture_output=True)


def prepare_host() -> None:
    """Forwarding and bridged traffic through iptables, as kube-proxy needs (the kubeadm
    preflight's settings). This VM's kernel has br_netfilter and overlay built in and no modprobe."""
    if shutil.which("modprobe"):
        for module in ("br_netfilter", "overlay"):
            subprocess.run(["modprobe", module], capture_output=True)
    for key in ("net/ipv4/ip_forward", "net/bridge/bridge-nf-call-iptables"):
        Path("/proc/sys", key).write_text("1")


def _ok(url: str) -> bool:
    try:
        return httpx.get(url, timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def remove_kube_chains() -> None:
    """The iptables chains the kubelet makes (KUBE-FIREWALL, its canaries) and those of the CNI
    plugins' masquerading and port maps for sandboxes that were killed rather than stopped: no
    command removes them. Jumps to them from the built-in chains first, then the chains."""
    for tool in ("iptables", "ip6tables"):
        for table in ("filter", "nat", "mangle"):
            rules = _lines([tool, "-t", table, "-S"])
            for rule in rules:
                parts = shlex.split(rule)  # comments are quoted, with quotes inside
                if parts[0] == "-A" and "-j" in parts and parts[parts.index("-j") + 1].startswith(CHAINS):
                    subprocess.run([tool, "-t", table, "-D", *parts[1:]], capture_output=True)
            for rule in rules:
                if rule.startswith("-N") and rule.split()[1].startswith(CHAINS):
                    subprocess.run([tool, "-t", table, "-F", rule.split()[1]], capture_output=True)
            for rule in rules:
                if rule.startswith("-N") and rule.split()[1].startswith(CHAINS):
                    subprocess.run([tool, "-t", table, "-X", rule.split()[1]], capture_output=True)


def _lines(argv: list[str]) -> list[str]:
    r = subprocess.run(argv, capture_output=True, text=True)
    return [line.strip() for line in r.stdout.splitlines() if line.strip()]


def kill_shims(socket: Path) -> None:
    """containerd's shims outlive it by design; ours name our socket on their command line."""
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            argv = (proc / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if argv and argv[0].endswith(b"containerd-shim-runc-v2") and str(socket).encode() in argv:
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(proc.name), signal.SIGKILL)


def unmount_below(folder: Path) -> None:
    """The kubelet's volume mounts (secrets on tmpfs, projected tokens) under the run folder, deepest first."""
    mounts = [line.split()[1] for line in Path("/proc/self/mounts").read_text().splitlines()]
    for target in sorted((m for m in mounts if m.startswith(str(folder))), key=len, reverse=True):
        subprocess.run(["umount", "-l", target], capture_output=True)


@contextlib.contextmanager
def cluster(folder: Path | None = None) -> Iterator[Node]:
    """A running one-node cluster; its admin kubeconfig is ``node.admin_kubeconfig``."""
    missing = missing_host_parts()
    if missing:
        raise RuntimeError(f"this machine lacks {', '.join(missing)} (make cluster-deps installs the packages)")
    with contextlib.ExitStack() as stack:
        if folder is None:
            folder = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="loraplane-cluster-")))
        node = Node(folder)
        stack.callback(node.stop)
        node.start()
        yield node


def user_env(node: Node) -> dict[str, str]:
    """A user's shell pointed at the cluster: KUBECONFIG, and kubectl and helm on PATH."""
    return dict(os.environ, KUBECONFIG=str(node.admin_kubeconfig), PATH=f"{BIN}:{os.environ['PATH']}")


def helm_install(node: Node) -> None:
    """`helm install` of the chart as the docs say, with the object store from this machine."""
    print("helm install", flush=True)
    subprocess.run(["helm", "install", RELEASE, str(REPO / "charts" / "loraplane"), "-n", RELEASE_NS,
                    "--create-namespace", "-f", str(LOCAL_VALUES), "--wait", "--timeout", "10m"],
                   env=user_env(node), check=True)  # fmt: skip


def run_tests(node: Node, pytest_args: list[str]) -> int:
    """e2e/test_cluster.py unchanged, then tests/cluster/ (faults, network policy, then helm's
    upgrade, rollback and uninstall, last because it removes the release)."""
    helm_install(node)
    env = dict(user_env(node), LORAPLANE_E2E_CLUSTER="1", LORAPLANE_CLUSTER_DIR=str(node.folder))
    suite = sorted(str(f.relative_to(REPO)) for f in (REPO / "tests" / "cluster").glob("test_*.py") if f.name != "test_helm.py")
    argv = [sys.executable, "-m", "pytest", "-m", "cluster", "-p", "no:cacheprovider",
            "e2e/test_cluster.py", *suite, "tests/cluster/test_helm.py", *pytest_args]  # fmt: skip
    return subprocess.run(argv, env=env, cwd=REPO).returncode


def main() -> None:
    command = sys.argv[1] if len(sys.argv) > 1 else ""
    if command not in ("up", "test"):
        raise SystemExit("usage: cluster.py up | test [pytest args]\n  up: run a one-node cluster until interrupted\n"
                         "  test: bring it up, helm install the chart, run the cluster tests, tear it down")  # fmt: skip
    folder = Path(os.environ.get("LORAPLANE_CLUSTER_DIR", REPO / ".cluster"))
    unmount_below(folder)  # what an interrupted run may have left
    shutil.rmtree(folder, ignore_errors=True)
    with cluster(folder) as node:
        if command == "test":
            raise SystemExit(run_tests(node, sys.argv[2:]))
        print(f"cluster up: export KUBECONFIG={node.admin_kubeconfig} PATH={BIN}:$PATH   (Ctrl-C tears it down)", flush=True)
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})
        signal.sigwait({signal.SIGINT, signal.SIGTERM})


if __name__ == "__main__":
    main()
