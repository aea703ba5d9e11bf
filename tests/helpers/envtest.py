"""A real Kubernetes control plane for the tests, in the shape of controller-runtime's envtest: etcd
and kube-apiserver (built by `make kube` from tools/kube/, pinned to one Kubernetes release) on
loopback with random ports, TLS from a CA generated per run, RBAC authorization and
service-account tokens, our CRDs and ClusterRole installed. No kubelet, scheduler or controller
manager runs: tests create Pods and EndpointSlices themselves and set their status, and nothing
garbage-collects or finishes a namespace's deletion.

Why a real server and not an emulator: it validates every object against the CRD schemas (CEL
rules included), applies defaults, prunes undeclared fields, keeps resourceVersions, evaluates
label selectors and RBAC, and calls webhooks; an emulator does none of it, so the operator was
never tested against what a cluster does.

The API server writes an audit log of every write that does not come from itself: that is how a
test counts the operator's API writes (``Kube.writes``)."""

from __future__ import annotations

import datetime
import ipaddress
import json
import os
import socket
import ssl
import subprocess
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import httpx
import yaml
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from cryptography.x509.oid import NameOID
from operator_process import stop
from waiting import wait_for

from loraplane.serving.http.loopback import free_port

REPO = Path(__file__).resolve().parents[2]
BIN = Path(os.environ.get("LORAPLANE_KUBE_BIN", REPO / ".kube-bin"))
OPERATOR_NAMESPACE, OPERATOR_ACCOUNT = "loraplane-system", "loraplane-operator"
OPERATOR_USER = f"system:serviceaccount:{OPERATOR_NAMESPACE}:{OPERATOR_ACCOUNT}"

# kind -> (group/version, plural, namespaced): the kinds the tests read and write by name.
RESOURCES = {
    "Namespace": ("v1", "namespaces", False),
    "Node": ("v1", "nodes", False),
    "PersistentVolume": ("v1", "persistentvolumes", False),
    "Pod": ("v1", "pods", True),
    "Secret": ("v1", "secrets", True),
    "Event": ("v1", "events", True),
    "ConfigMap": ("v1", "configmaps", True),
    "Service": ("v1", "services", True),
    "ServiceAccount": ("v1", "serviceaccounts", True),
    "Deployment": ("apps/v1", "deployments", True),
    "DaemonSet": ("apps/v1", "daemonsets", True),
    "NetworkPolicy": ("networking.k8s.io/v1", "networkpolicies", True),
    "EndpointSlice": ("discovery.k8s.io/v1", "endpointslices", True),
    "Role": ("rbac.authorization.k8s.io/v1", "roles", True),
    "RoleBinding": ("rbac.authorization.k8s.io/v1", "rolebindings", True),
    "ClusterRole": ("rbac.authorization.k8s.io/v1", "clusterroles", False),
    "ClusterRoleBinding": ("rbac.authorization.k8s.io/v1", "clusterrolebindings", False),
    "PodDisruptionBudget": ("policy/v1", "poddisruptionbudgets", True),
    "CustomResourceDefinition": ("apiextensions.k8s.io/v1", "customresourcedefinitions", False),
    "ValidatingWebhookConfiguration": ("admissionregistration.k8s.io/v1", "validatingwebhookconfigurations", False),
    "ClusterKopfPeering": ("kopf.dev/v1", "clusterkopfpeerings", False),
    "KopfPeering": ("kopf.dev/v1", "kopfpeerings", True),
    "BaseModel": ("loraplane.dev/v1alpha1", "basemodels", True),
    "LoraAdapter": ("loraplane.dev/v1alpha1", "loraadapters", True),
}

# Writes by anyone but the API server itself (its leases and bootstrap objects), at Metadata level.
AUDIT_POLICY = {
    "apiVersion": "audit.k8s.io/v1", "kind": "Policy", "omitStages": ["RequestReceived"],
    "rules": [
        {"level": "None", "users": ["system:apiserver"]},
        {"level": "Metadata", "verbs": ["create", "update", "patch", "delete", "deletecollection"]},
        {"level": "None"},
    ],
}  # fmt: skip


def node_address() -> str:
    """This machine's own non-loopback IPv4 address, to stand for a pod IP: the API server refuses
    loopback addresses in EndpointSlices (a UDP connect picks the route's source; nothing is sent)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect(("10.255.255.255", 1))
        address: str = s.getsockname()[0]
    return address


def path(kind: str, namespace: str | None = None, name: str | None = None, subresource: str | None = None) -> str:
    group_version, plural, namespaced = RESOURCES[kind]
    prefix = "/api/v1" if group_version == "v1" else f"/apis/{group_version}"
    ns = f"/namespaces/{namespace}" if namespaced and namespace else ""
    return f"{prefix}{ns}/{plural}" + (f"/{name}" if name else "") + (f"/{subresource}" if subresource else "")


def binaries() -> dict[str, Path]:
    """The pinned control plane's binaries; a clear error naming the make target when absent."""
    found = {name: BIN / name for name in ("etcd", "kube-apiserver", "kubectl")}
    missing = [str(p) for p in found.values() if not os.access(p, os.X_OK)]
    if missing:
        raise RuntimeError(f"missing {', '.join(missing)}: run `make kube` (builds tools/kube/ with Go)")
    return found


class Pki:
    """A CA per run and what it signs: the API server's serving certificate, an admin client
    certificate (group system:masters) and the service-account signing key."""

    def __init__(self, folder: Path, hosts: list[str] | None = None, ips: list[str] | None = None) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        self.folder = folder
        now = datetime.datetime.now(datetime.UTC)
        self._valid = (now - datetime.timedelta(minutes=5), now + datetime.timedelta(days=1))
        self._ca_key = ec.generate_private_key(ec.SECP256R1())
        self._ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "loraplane-test-ca")])
        ca = self._builder(self._ca_name, self._ca_key).add_extension(x509.BasicConstraints(ca=True, path_length=None), True)
        self.ca = self._write("ca", ca.sign(self._ca_key, hashes.SHA256()), self._ca_key)
        self.ca_key = folder / "ca.key"
        names = [x509.DNSName(h) for h in ["localhost", *(hosts or [])]]
        names += [x509.IPAddress(ipaddress.ip_address(a)) for a in ["127.0.0.1", *(ips or [])]]
        self.serving = self.leaf("apiserver", "kube-apiserver", None, x509.SubjectAlternativeName(names), server=True)
        self.admin = self.leaf("admin", "loraplane-test-admin", "system:masters", None, server=False)
        sa_key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
        self.sa_key = folder / "sa.key"
        self.sa_key.write_bytes(sa_key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                                     serialization.NoEncryption()))  # fmt: skip
        self.sa_pub = folder / "sa.pub"
        self.sa_pub.write_bytes(sa_key.public_key().public_bytes(serialization.Encoding.PEM,
                                                                 serialization.PublicFormat.SubjectPublicKeyInfo))  # fmt: skip

    def admin_tls(self) -> ssl.SSLContext:
        """TLS that trusts only this run's CA and presents the admin's client certificate."""
        context = ssl.create_default_context(cafile=str(self.ca))
        context.load_cert_chain(str(self.admin[0]), str(self.admin[1]))
        return context

    def _builder(self, subject: x509.Name, key: Any) -> x509.CertificateBuilder:
        return (x509.CertificateBuilder().subject_name(subject).issuer_name(self._ca_name)
                .public_key(key.public_key()).serial_number(x509.random_serial_number())
                .not_valid_before(self._valid[0]).not_valid_after(self._valid[1]))  # fmt: skip

    def leaf(self, stem: str, cn: str, org: str | None, san: Any, server: bool) -> tuple[Path, Path]:
        """A key and a certificate this CA signs (``org`` is the Kubernetes group)."""
        key = ec.generate_private_key(ec.SECP256R1())
        attrs = [x509.NameAttribute(NameOID.COMMON_NAME, cn)]
        if org:
            attrs.insert(0, x509.NameAttribute(NameOID.ORGANIZATION_NAME, org))
        usage = x509.oid.ExtendedKeyUsageOID.SERVER_AUTH if server else x509.oid.ExtendedKeyUsageOID.CLIENT_AUTH
        builder = self._builder(x509.Name(attrs), key).add_extension(x509.ExtendedKeyUsage([usage]), False)
        if san is not None:
            builder = builder.add_extension(san, False)
        cert = self._write(stem, builder.sign(self._ca_key, hashes.SHA256()), key)
        return cert, self.folder / f"{stem}.key"

    def _write(self, stem: str, cert: x509.Certificate, key: Any) -> Path:
        out = self.folder / f"{stem}.crt"
        out.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        if key is not None:
            (self.folder / f"{stem}.key").write_bytes(key.private_bytes(
                serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()))  # fmt: skip
        return out


def kubeconfig(target: Path, url: str, ca: Path, user: dict[str, str]) -> Path:
    target.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config",
        "clusters": [{"name": "envtest", "cluster": {"server": url, "certificate-authority": str(ca)}}],
        "users": [{"name": "user", "user": user}],
        "contexts": [{"name": "envtest", "context": {"cluster": "envtest", "user": "user"}}],
        "current-context": "envtest",
    }))  # fmt: skip
    return target


class Kube:
    """The calls a test makes against the API server, as an admin (system:masters) over TLS.
    ``kubeconfig`` is the operator's: a ServiceAccount token bound to crds/rbac.yaml's ClusterRole
    and nothing else, so a permission the ClusterRole lacks fails the test that needs it."""

    operator_user = OPERATOR_USER

    def __init__(self, plane: ControlPlane, operator_kubeconfig: Path) -> None:
        self.plane, self.url = plane, plane.url
        self.kubeconfig, self.admin_kubeconfig = operator_kubeconfig, plane.admin_kubeconfig
        self.http = httpx.Client(base_url=plane.url, timeout=30, verify=plane.pki.admin_tls())
        self._namespaces: set[str] = set()

    def apply(self, obj: dict[str, Any]) -> dict[str, Any]:
        """Server-side apply, as `kubectl apply --server-side --force-conflicts` does: fields this
        manager set before and the manifest no longer sets are removed. A manifest's ``status``
        goes to the status subresource afterwards, as a kubelet or controller would write it. The
        namespace is created first when it does not exist yet."""
        meta = obj["metadata"]
        namespace = meta.get("namespace")
        if namespace and RESOURCES[obj["kind"]][2] and namespace not in self._namespaces:
            if self.get("Namespace", None, namespace) is None:
                self.apply({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": namespace}})
            self._namespaces.add(namespace)  # nothing deletes a namespace here (no controller would finish it)
        body = {k: v for k, v in obj.items() if k != "status"}
        result = self._apply(path(obj["kind"], namespace, meta["name"]), body)
        if "status" in obj:
            status = {
                "apiVersion": obj["apiVersion"],
                "kind": obj["kind"],
                "metadata": {"name": meta["name"]},
                "status": obj["status"],
            }
            if namespace:
                status["metadata"]["namespace"] = namespace
            result = self._apply(path(obj["kind"], namespace, meta["name"], "status"), status)
        return result

    def _apply(self, url: str, body: dict[str, Any]) -> dict[str, Any]:
        r = self.http.patch(url, content=json.dumps(body), params={"fieldManager": "loraplane-tests", "force": "true"},
                            headers={"Content-Type": "application/apply-patch+yaml"})  # fmt: skip
        if r.status_code >= 400:
            raise httpx.HTTPStatusError(f"{r.status_code} {url}: {r.text}", request=r.request, response=r)
        result: dict[str, Any] = r.json()
        return result

    def merge_patch(
        self, kind: str, namespace: str | None, name: str, body: dict[str, Any], subresource: str | None = None
    ) -> dict[str, Any]:
        """A JSON merge patch, as kopf writes status: the server prunes what the schema does not declare."""
        r = self.http.patch(path(kind, namespace, name, subresource), content=json.dumps(body),
                            headers={"Content-Type": "application/merge-patch+json"})  # fmt: skip
        r.raise_for_status()
        result: dict[str, Any] = r.json()
        return result

    def get(self, kind: str, namespace: str | None, name: str) -> dict[str, Any] | None:
        r = self.http.get(path(kind, namespace, name))
        if r.status_code == 404:
            return None
        r.raise_for_status()
        result: dict[str, Any] = r.json()
        return result

    def list(self, kind: str, namespace: str | None = None, **params: str) -> list[dict[str, Any]]:
        r = self.http.get(path(kind, namespace), params=params)
        r.raise_for_status()
        items: list[dict[str, Any]] = r.json()["items"]
        return items

    def delete(self, kind: str, namespace: str | None, name: str) -> None:
        self.http.delete(path(kind, namespace, name)).raise_for_status()

    def writes(self, by: str | None = None) -> int:
        """The writes the API server has answered so far from anyone but itself, or only those of
        user ``by`` (``Kube.operator_user`` for the operator's), from its audit log."""
        return sum(1 for e in self.plane.audit() if by is None or e["user"]["username"] == by)

    def requests(self) -> int:
        """Every request the API server has answered (its ``apiserver_request_total``), reads included."""
        total = 0.0
        for line in self.http.get("/metrics").text.splitlines():
            if line.startswith("apiserver_request_total{"):
                total += float(line.rsplit(" ", 1)[1])
        return int(total)

    def write_log(self) -> list[str]:
        """User, verb and path of the latest 500 writes, oldest first."""
        return [f"{e['user']['username']} {e['verb']} {e['requestURI']}" for e in self.plane.audit()[-500:]]

    def kubectl(self, *args: str, input: str | None = None, check: bool = True) -> subprocess.CompletedProcess[str]:
        """The real kubectl, as the admin, against this server."""
        env = dict(os.environ, KUBECONFIG=str(self.admin_kubeconfig))
        return subprocess.run([str(binaries()["kubectl"]), *args], input=input, capture_output=True, text=True,
                              env=env, check=check, timeout=120)  # fmt: skip

    def wait_for(self, what: str, check: Callable[[], Any], timeout: float = 60) -> Any:
        return wait_for(what, check, timeout)


class ControlPlane:
    """etcd and kube-apiserver as child processes; ``restart_apiserver`` keeps etcd (and so every
    object) and starts a new API server on the same port, as a control-plane upgrade does."""

    def __init__(self, folder: Path, hosts: list[str] | None = None, ips: list[str] | None = None) -> None:
        self.folder, self.bins = folder, binaries()
        self.pki = Pki(folder / "pki", hosts, ips)
        self.port = free_port()
        self.url = f"https://127.0.0.1:{self.port}"
        self.audit_log = folder / "audit.log"
        self.admin_kubeconfig = kubeconfig(folder / "admin.kubeconfig", self.url, self.pki.ca,
                                           {"client-certificate": str(self.pki.admin[0]),
                                            "client-key": str(self.pki.admin[1])})  # fmt: skip
        self.etcd: subprocess.Popen[bytes] | None = None
        self.apiserver: subprocess.Popen[bytes] | None = None
        self._audit_offset, self._audit_events = 0, list[dict[str, Any]]()

    def start(self) -> None:
        client, peer = f"http://127.0.0.1:{free_port()}", f"http://127.0.0.1:{free_port()}"
        self.etcd_url = client
        self.etcd = self._spawn("etcd", [
            "--data-dir", str(self.folder / "etcd"), "--name", "default",
            "--listen-client-urls", client, "--advertise-client-urls", client,
            "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer, "--initial-cluster", f"default={peer}",
            "--unsafe-no-fsync", "--log-level", "warn",
        ])  # fmt: skip
        self.start_apiserver()

    def start_apiserver(self, timeout: float = 120) -> None:
        (self.folder / "audit-policy.yaml").write_text(yaml.safe_dump(AUDIT_POLICY))
        self.apiserver = self._spawn("kube-apiserver", self.apiserver_args())
        deadline = time.monotonic() + timeout
        with httpx.Client(verify=self.pki.admin_tls()) as http:
            while True:
                assert self.apiserver.poll() is None, f"kube-apiserver exited:\n{self.log('kube-apiserver')}"
                try:
                    if http.get(f"{self.url}/readyz", timeout=5).status_code == 200:
                        return
                except httpx.HTTPError:
                    pass
                if time.monotonic() > deadline:
                    raise RuntimeError(f"kube-apiserver not ready after {timeout:.0f} s:\n{self.log('kube-apiserver')}")
                time.sleep(0.25)

    def apiserver_args(self) -> list[str]:
        """Loopback only, no kubelet or controllers behind it (cluster.Node overrides this)."""
        return [
            "--etcd-servers", self.etcd_url, "--bind-address", "127.0.0.1", "--advertise-address", "127.0.0.1",
            "--secure-port", str(self.port), "--cert-dir", str(self.folder / "pki"),
            "--tls-cert-file", str(self.pki.serving[0]), "--tls-private-key-file", str(self.pki.serving[1]),
            "--client-ca-file", str(self.pki.ca),
            "--service-account-issuer", "https://kubernetes.default.svc.cluster.local",
            "--service-account-key-file", str(self.pki.sa_pub),
            "--service-account-signing-key-file", str(self.pki.sa_key),
            "--service-cluster-ip-range", "10.0.0.0/24", "--authorization-mode", "RBAC", "--allow-privileged=true",
            # No controller manager creates each namespace's `default` ServiceAccount, which this
            # admission plugin would require of every Pod (envtest disables it for the same reason).
            "--disable-admission-plugins", "ServiceAccount",
            # The `kubernetes` Service's endpoints would be this loopback address, which it refuses.
            "--endpoint-reconciler-type", "none",
            "--audit-policy-file", str(self.folder / "audit-policy.yaml"), "--audit-log-path", str(self.audit_log),
            "--audit-log-format", "json",
        ]  # fmt: skip

    def stop_apiserver(self) -> None:
        stop_process(self.apiserver)

    def restart_apiserver(self) -> None:
        self.stop_apiserver()
        self.start_apiserver()

    def stop(self) -> None:
        stop_process(self.apiserver)
        stop_process(self.etcd)

    def audit(self) -> list[dict[str, Any]]:
        """Every audited write so far, oldest first; read on from where the last call stopped, so
        that a fleet's tens of thousands of writes are parsed once."""
        if self.audit_log.exists():
            with self.audit_log.open("rb") as f:
                f.seek(self._audit_offset)
                chunk = f.read()
            complete = chunk[: chunk.rfind(b"\n") + 1]
            self._audit_offset += len(complete)
            self._audit_events += [json.loads(line) for line in complete.splitlines() if line.strip()]
        return self._audit_events

    def log(self, name: str) -> str:
        return (self.folder / f"{name}.log").read_text()[-6000:]

    def _spawn(self, name: str, args: list[str]) -> subprocess.Popen[bytes]:
        with (self.folder / f"{name}.log").open("ab") as log:
            return subprocess.Popen([str(self.bins[name]), *args], stdout=log, stderr=log)


def stop_process(proc: subprocess.Popen[bytes] | None) -> None:
    if proc is not None and proc.poll() is None:
        stop(proc)


# kopf's peering CRDs, the same as the chart installs (charts/loraplane/templates/operator/peering.yaml):
# kopf neither creates them nor the peering objects.
def _peering_crd(kind: str, scope: str) -> dict[str, Any]:
    plural = f"{kind.lower()}s"
    schema = {"type": "object", "properties": {"status": {"type": "object", "x-kubernetes-preserve-unknown-fields": True}}}
    return {
        "apiVersion": "apiextensions.k8s.io/v1", "kind": "CustomResourceDefinition",
        "metadata": {"name": f"{plural}.kopf.dev"},
        "spec": {"group": "kopf.dev", "scope": scope, "names": {"kind": kind, "plural": plural, "singular": kind.lower()},
                 "versions": [{"name": "v1", "served": True, "storage": True, "schema": {"openAPIV3Schema": schema}}]},
    }  # fmt: skip


def install(kube: Kube) -> None:
    """Our CRDs (and kopf's peering CRDs), each Established, and the operator's ClusterRole from crds/."""
    crds = [yaml.safe_load(p.read_text()) for p in sorted((REPO / "crds").glob("*.loraplane.dev.yaml"))]
    crds += [_peering_crd("ClusterKopfPeering", "Cluster"), _peering_crd("KopfPeering", "Namespaced")]
    for crd in crds:
        kube.apply(crd)
    for crd in crds:
        name = crd["metadata"]["name"]

        def established(name: str = name) -> bool:
            obj = kube.get("CustomResourceDefinition", None, name) or {}
            # A CRD just created can read back with "conditions": null before the server fills them in.
            conditions = (obj.get("status") or {}).get("conditions") or []
            return any(c["type"] == "Established" and c["status"] == "True" for c in conditions)

        kube.wait_for(f"CRD {name} Established", established, timeout=30)
    for doc in yaml.safe_load_all((REPO / "crds" / "rbac.yaml").read_text()):
        if doc:
            kube.apply(doc)


def service_account_kubeconfig(kube: Kube, namespace: str, account: str, cluster_role: str, target: Path) -> Path:
    """A ServiceAccount bound to ``cluster_role``, and a kubeconfig with a token for it."""
    kube.apply({"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": account, "namespace": namespace}})
    kube.apply({
        "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRoleBinding",
        "metadata": {"name": f"{namespace}-{account}"},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": cluster_role},
        "subjects": [{"kind": "ServiceAccount", "name": account, "namespace": namespace}],
    })  # fmt: skip
    return token_kubeconfig(kube, namespace, account, target)


def token_kubeconfig(kube: Kube, namespace: str, account: str, target: Path) -> Path:
    """A kubeconfig holding a token minted for an existing ServiceAccount through the TokenRequest
    API (what a projected token volume gives a pod): that account's permissions and no others."""
    r = kube.http.post(path("ServiceAccount", namespace, account, "token"),
                       json={"apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest",
                             "spec": {"expirationSeconds": 86400}})  # fmt: skip
    r.raise_for_status()
    return kubeconfig(target, kube.url, kube.plane.pki.ca, {"token": r.json()["status"]["token"]})


@contextmanager
def control_plane(folder: Path) -> Iterator[Kube]:
    """A fresh control plane in ``folder`` (its own etcd data), CRDs and RBAC installed; the Kube's
    ``kubeconfig`` is the operator's least-privilege one, ``admin_kubeconfig`` the admin's."""
    folder.mkdir(parents=True, exist_ok=True)
    with ExitStack() as stack:
        plane = ControlPlane(folder)
        stack.callback(plane.stop)
        plane.start()
        admin = Kube(plane, plane.admin_kubeconfig)
        install(admin)
        operator = service_account_kubeconfig(admin, OPERATOR_NAMESPACE, OPERATOR_ACCOUNT, "loraplane-operator",
                                              folder / "operator.kubeconfig")  # fmt: skip
        yield Kube(plane, operator)
