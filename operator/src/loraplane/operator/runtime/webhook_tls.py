"""The webhook's self-signed serving certificate, made with `cryptography`.

kopf makes one itself only through ``certbuilder``, an optional extra kopf leaves out of its runtime
dependencies: the image installed it by hand, and a `pip install loraplane[operator]` without it
exits at startup with ``--webhook-port`` (found when the tests first ran the webhook behind a real
API server). ``certbuilder`` rests on ``oscrypto``, which has had no release in years, so we build
the same certificate with `cryptography` instead, and the operator extra carries it: a self-signed
CA certificate for the webhook's host names and addresses, which kopf also puts into the
ValidatingWebhookConfiguration's ``caBundle``.

In a cluster the configuration names the webhook's Service rather than a URL (:class:`WebhookServer`):
the API server dials the Service's cluster IP it looks up itself, while a URL's host name goes
through the API server's own resolver, which knows no cluster DNS on kubeadm, kind and managed
control planes (some of which, such as GKE's private clusters, need a firewall rule for the port).
Found on the one-node cluster: every call failed open with "no such host", so the webhook checked
nothing."""

from __future__ import annotations

import contextlib
import datetime
import ipaddress
import urllib.parse
from collections.abc import AsyncGenerator, AsyncIterator, Collection
from typing import Any, cast

import kopf
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

VALIDITY = datetime.timedelta(days=365)


def self_signed(hostnames: Collection[str], password: str | None = None) -> tuple[bytes, bytes]:
    """PEM certificate and private key for ``hostnames`` (names and IP addresses; unspecified
    addresses such as 0.0.0.0 are left out, as kopf does)."""
    ips: list[ipaddress.IPv4Address | ipaddress.IPv6Address] = []
    names: list[str] = []
    for host in dict.fromkeys(hostnames):
        try:
            ip = ipaddress.ip_address(host)
        except ValueError:
            names.append(host)
            continue
        if not ip.is_unspecified:
            ips.append(ip)
    if not names and not ips:
        raise ValueError(f"no host name or address to certify in {list(hostnames)}")
    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, names[0] if names else str(ips[0]))])
    now = datetime.datetime.now(datetime.UTC)
    sans: list[x509.GeneralName] = [x509.DNSName(n) for n in names] + [x509.IPAddress(ip) for ip in ips]
    cert = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + VALIDITY)
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .add_extension(x509.SubjectAlternativeName(sans), critical=False)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .sign(key, hashes.SHA256())
    )
    encryption = serialization.BestAvailableEncryption(password.encode()) if password else serialization.NoEncryption()
    pem_key = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, encryption)
    return cert.public_bytes(serialization.Encoding.PEM), pem_key


class WebhookServer(kopf.WebhookServer):
    """kopf's webhook server with the certificate above; given ``service`` (namespace, name), the
    client configuration it yields names that Service on the server's port (which the Service's
    port must equal) instead of a URL, and the certificate is for its ``<name>.<namespace>.svc``."""

    def __init__(self, *, service: tuple[str, str] | None = None, **kwargs: Any) -> None:
        if service is not None:
            namespace, name = service
            kwargs.setdefault("host", f"{name}.{namespace}.svc")
            kwargs.setdefault("extra_sans", [f"{name}.{namespace}.svc.cluster.local"])
        super().__init__(**kwargs)
        self.service = service

    async def __call__(self, fn: kopf.WebhookFn) -> AsyncIterator[kopf.WebhookClientConfig]:
        inner = cast(AsyncGenerator[kopf.WebhookClientConfig], super().__call__(fn))  # kopf's is a generator
        async with contextlib.aclosing(inner) as configs:  # closed with this one: kopf's server stops
            async for config in configs:
                if self.service is not None:
                    namespace, name = self.service
                    url = urllib.parse.urlsplit(config.pop("url") or "")
                    config["service"] = {"namespace": namespace, "name": name, "port": url.port, "path": url.path}
                yield config

    @staticmethod
    def build_certificate(hostnames: Collection[str], password: str | None = None) -> tuple[bytes, bytes]:
        return self_signed(hostnames, password)
