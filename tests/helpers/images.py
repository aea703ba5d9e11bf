"""The test cluster's images, built without a registry: buildah (Debian's) builds docker/'s two
Dockerfiles on a Debian base made here with debootstrap, plus the two small images a node needs
(the sandbox "pause" image and the object store), and containerd imports each as an archive.

Why buildah: it is packaged by Debian, needs no daemon and reads our Dockerfiles as written
(`RUN --mount=type=bind`, an ignore file per Dockerfile). BuildKit would have to be built from the
Go module proxy and run as a daemon for the same result.

Why a base of our own: no registry is reachable, so neither `python:3.11-slim` nor the CUDA
image can be pulled. The Dockerfiles take their base as a build argument (PYTHON_IMAGE,
CUDA_IMAGE) and keep the upstream ones by default. The base trusts the host's CA certificates,
so that pip and apt inside a build reach the same mirrors the host does.

Everything built is kept in CACHE (and buildah's and containerd's stores) and reused: a
Dockerfile step is rebuilt only when its inputs change, and SOURCE_DIGEST (a digest of the parts
an image installs) tells buildah when the bind-mounted source did, which its layer cache cannot
see by itself."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import tarfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
CACHE = Path(os.environ.get("LORAPLANE_CLUSTER_CACHE", "/var/cache/loraplane"))
MIRROR = "http://deb.debian.org/debian"
SUITE = "bookworm"
PAUSE_VERSION = "3.10.2"  # k8s.io/kubernetes' build/pause, as kubeadm pins it for 1.37

BASE = f"localhost/loraplane/debian:{SUITE}"
PAUSE = f"localhost/loraplane/pause:{PAUSE_VERSION}"
# The names the chart and a BaseModel's default pull (the chart's appVersion), as e2e/README.md
# tags them for a kind cluster: with imagePullPolicy IfNotPresent the node never asks a registry.
APP_VERSION = next(line.split(":", 1)[1].strip().strip('"') for line in (REPO / "charts/loraplane/Chart.yaml").read_text()
                   .splitlines() if line.startswith("appVersion:"))  # fmt: skip
OPERATOR = f"ghcr.io/loraplane/operator:{APP_VERSION}"
SERVING = f"ghcr.io/loraplane/serving:{APP_VERSION}"
OBJECT_STORE = "localhost/loraplane/objectstore:dev"

# The parts each image installs (the Dockerfiles' pip lines): what SOURCE_DIGEST covers.
PARTS = {
    "operator": ["adapter_format", "admin_api", "cli", "eviction", "node_cache", "operator", "routing", "sim", "usage"],
    "serving": ["adapter_format", "admin_api", "cli", "eviction", "kernels", "node_cache", "routing", "serving", "sim",
                "usage"],
}  # fmt: skip


def run(*args: str | Path, **kwargs: object) -> str:
    """A command whose failure stops the build with its own output in the error."""
    r = subprocess.run([str(a) for a in args], capture_output=True, text=True, **kwargs)  # type: ignore[call-overload]
    if r.returncode != 0:
        raise RuntimeError(f"{' '.join(map(str, args))} failed ({r.returncode}):\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}")
    out: str = r.stdout
    return out


def exists(image: str) -> bool:
    return subprocess.run(["buildah", "inspect", "--type", "image", image], capture_output=True).returncode == 0


def image_id(image: str) -> str:
    return run("buildah", "inspect", "--type", "image", "--format", "{{.FromImageID}}", image).strip()


def base() -> str:
    """Debian with python3 and venv (what both Dockerfiles' first steps need from their upstream
    bases), the host's CA certificates and pip set to trust them."""
    if exists(BASE):
        return BASE
    rootfs = CACHE / f"rootfs-{SUITE}"
    if not (rootfs / ".complete").exists():
        shutil.rmtree(rootfs, ignore_errors=True)
        print(f"debootstrap {SUITE} into {rootfs} (about 2 minutes)", flush=True)
        run("debootstrap", "--variant=minbase", "--include=python3,python3-venv,ca-certificates", SUITE, rootfs, MIRROR)
        local_cas = sorted(Path("/usr/local/share/ca-certificates").glob("*.crt"))
        for ca in local_cas:
            shutil.copy(ca, rootfs / "usr/local/share/ca-certificates" / ca.name)
        if local_cas:
            run("chroot", rootfs, "update-ca-certificates")
        (rootfs / "etc/pip.conf").write_text("[global]\ncert = /etc/ssl/certs/ca-certificates.crt\ntimeout = 180\n")
        shutil.rmtree(rootfs / "var/cache/apt/archives", ignore_errors=True)
        (rootfs / "var/cache/apt/archives/partial").mkdir(parents=True)
        (rootfs / ".complete").touch()
    archive = CACHE / f"rootfs-{SUITE}.tar"
    with tarfile.open(archive, "w") as tar:
        for entry in sorted(rootfs.iterdir()):
            if entry.name != ".complete":
                tar.add(entry, arcname=entry.name)
    container = run("buildah", "from", "scratch").strip()
    try:
        run("buildah", "add", container, archive, "/")
        run("buildah", "config", "--env", "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
            "--cmd", "/bin/bash", container)  # fmt: skip
        run("buildah", "commit", "--quiet", container, BASE)
    finally:
        subprocess.run(["buildah", "rm", container], capture_output=True)
    archive.unlink()
    return BASE


def pause() -> str:
    """The sandbox image every pod starts with, from Kubernetes' own pause.c, linked statically."""
    source = kubernetes_module() / "build" / "pause" / "linux" / "pause.c"
    binary = CACHE / "pause"
    run("gcc", "-Os", "-static", "-Wall", "-Werror", f"-DVERSION=v{PAUSE_VERSION}", "-o", binary, source)
    run("strip", binary)
    return _scratch(PAUSE, binary, "/pause")


def object_store(binary: Path) -> str:
    """tools/objectstore (gofakes3 behind MinIO's command line), static, alone in its image."""
    return _scratch(OBJECT_STORE, binary, "/usr/bin/objectstore")


def _scratch(image: str, binary: Path, target: str) -> str:
    """``binary`` alone in an image, rebuilt only when the binary changed (a label holds its digest)."""
    digest = hashlib.sha256(binary.read_bytes()).hexdigest()
    label = '{{index .OCIv1.Config.Labels "dev.loraplane.binary"}}'
    if exists(image) and run("buildah", "inspect", "--type", "image", "--format", label, image).strip() == digest:
        return image
    container = run("buildah", "from", "scratch").strip()
    try:
        run("buildah", "copy", "--chmod", "0755", container, binary, target)
        run("buildah", "config", "--entrypoint", f'["{target}"]', "--user", "65535:65535",
            "--label", f"dev.loraplane.binary={digest}", container)  # fmt: skip
        run("buildah", "commit", "--quiet", container, image)
    finally:
        subprocess.run(["buildah", "rm", container], capture_output=True)
    return image


def source_digest(parts: list[str]) -> str:
    """A digest of every tracked file under the parts an image installs (what git would commit)."""
    files = run("git", "ls-files", "-z", "--", *parts, cwd=REPO).split("\0")
    h = hashlib.sha256()
    for name in sorted(f for f in files if f):
        h.update(name.encode() + b"\0" + (REPO / name).read_bytes() + b"\0")
    return h.hexdigest()[:16]


def dockerfile(name: str, base_arg: str, extra_args: dict[str, str] | None = None) -> str:
    """docker/<name>.Dockerfile built as written, on our base, with buildah's layer cache."""
    image = {"operator": OPERATOR, "serving": SERVING}[name]
    args = {base_arg: base(), "SOURCE_DIGEST": source_digest(PARTS[name]), **(extra_args or {})}
    print(f"buildah bud docker/{name}.Dockerfile -> {image}", flush=True)
    build_args = [a for k, v in args.items() for a in ("--build-arg", f"{k}={v}")]
    run("buildah", "bud", "--layers", "--network", "host", "--quiet", "-f", f"docker/{name}.Dockerfile",
        "--ignorefile", f"docker/{name}.Dockerfile.dockerignore", *build_args, "-t", image, ".", cwd=REPO)  # fmt: skip
    return image


def kubernetes_module() -> Path:
    """The pinned k8s.io/kubernetes module's folder in Go's module cache (tools/kube/ downloads it)."""
    out = run("go", "list", "-m", "-f", "{{.Dir}}", "k8s.io/kubernetes", cwd=REPO / "tools" / "kube",
              env=dict(os.environ, GOTOOLCHAIN="local", GOFLAGS="-mod=mod"))  # fmt: skip
    return Path(out.strip())


def import_into(containerd: list[str], image: str) -> None:
    """The image into containerd's `k8s.io` namespace (the kubelet's), unless this very build is
    already there: a marker per image records the last imported ID."""
    marker = CACHE / "imported" / image.replace("/", "_").replace(":", "_")
    built = image_id(image)
    if marker.exists() and marker.read_text() == built and _in_containerd(containerd, image):
        return
    archive = CACHE / "export.tar"
    print(f"import {image} into containerd", flush=True)
    try:
        run("buildah", "push", "--quiet", image, f"docker-archive:{archive}:{image}")
        run(*containerd, "-n", "k8s.io", "images", "import", "--no-unpack=false", archive)
    finally:
        archive.unlink(missing_ok=True)
    marker.parent.mkdir(parents=True, exist_ok=True)
    marker.write_text(built)


def _in_containerd(containerd: list[str], image: str) -> bool:
    listed = run(*containerd, "-n", "k8s.io", "images", "ls", "-q")
    return any(line.strip() in (image, f"docker.io/{image}") for line in listed.splitlines())
