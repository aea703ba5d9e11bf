"""The cold tier: where adapter folders live before any node has them.

``file:///abs/path`` (or a plain path) is a local folder, the embedded default; ``s3://bucket/prefix``
is object storage through the ``minio`` client, with the endpoint and credentials from the
engine config or the usual environment variables (``AWS_ENDPOINT_URL``, ``AWS_ACCESS_KEY_ID``,
``AWS_SECRET_ACCESS_KEY``, ``AWS_REGION``). A source only copies the two PEFT files (and a
golden file, when there is one) into a folder, each stopped at its byte cap as it streams and the
whole at a deadline (``download``); validation happens once they are local.
"""

from __future__ import annotations

import contextlib
import errno
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol
from urllib.parse import urlparse

from loraplane.adapter_format.digest import CONFIG_FILE, GOLDEN_FILE, WEIGHTS_FILE
from loraplane.adapter_format.download import FetchBounds, file_chunks, response_chunks, write_capped
from loraplane.adapter_format.errors import AdapterValidationError, ErrorCode
from loraplane.adapter_format.validation import PICKLE_SUFFIXES

ADAPTER_FILES = (CONFIG_FILE, WEIGHTS_FILE)
READ_TIMEOUT_SECONDS = 60.0
_NOT_THERE = {errno.ENAMETOOLONG, errno.ENOTDIR, errno.EISDIR, errno.ELOOP, errno.EACCES, errno.EPERM, errno.EINVAL}
# S3's answers that mean "not now" rather than "not so": the store is busy or broken for a while.
_STORE_BUSY = {"ServiceUnavailable", "SlowDown", "InternalError", "RequestTimeout", "ServerBusy"}


class StoreUnavailable(ConnectionError):
    """The object store could not be reached, cut a transfer off, or answered with a server error:
    nothing is known about the adapter, and the same fetch may succeed later. A ``ConnectionError``
    (so an ``OSError``), so the callers that retry those with backoff (the serving load queue,
    the node agent) go on doing so, and the operator can say "waiting for the store" rather than
    fail an adapter because its store restarted."""


class AdapterSource(Protocol):
    @property
    def uri(self) -> str: ...

    def fetch(self, into: Path, bounds: FetchBounds | None = None) -> None:
        """Copy the adapter's files into the empty folder ``into`` within ``bounds`` (the
        defaults: ``FetchBounds.within()``); raise on any failure."""
        ...


@dataclass(frozen=True)
class S3Settings:
    endpoint: str | None = None
    access_key: str | None = None
    secret_key: str | None = None
    region: str | None = None

    @classmethod
    def from_env(cls) -> S3Settings:
        return cls(
            endpoint=os.environ.get("AWS_ENDPOINT_URL"),
            access_key=os.environ.get("AWS_ACCESS_KEY_ID"),
            secret_key=os.environ.get("AWS_SECRET_ACCESS_KEY"),
            region=os.environ.get("AWS_REGION"),
        )

    def client(self) -> Any:
        """A ``minio.Minio`` for these settings (AWS when no endpoint is set). Its HTTP pool is
        minio's own but for the read timeout: a store that sends nothing for a minute is down,
        where minio's five minutes would hold a fetch thread past most deadlines."""
        import certifi
        import urllib3
        from minio import Minio

        endpoint = self.endpoint or "https://s3.amazonaws.com"
        parsed = urlparse(endpoint if "://" in endpoint else f"https://{endpoint}")
        pool = urllib3.PoolManager(
            timeout=urllib3.Timeout(connect=READ_TIMEOUT_SECONDS, read=READ_TIMEOUT_SECONDS),
            maxsize=10,
            cert_reqs="CERT_REQUIRED",
            ca_certs=os.environ.get("SSL_CERT_FILE") or certifi.where(),
            retries=urllib3.Retry(total=5, backoff_factor=0.2, status_forcelist=[500, 502, 503, 504]),
        )
        return Minio(
            parsed.netloc,
            access_key=self.access_key,
            secret_key=self.secret_key,
            region=self.region,
            secure=parsed.scheme == "https",
            http_client=pool,
        )


@dataclass(frozen=True)
class FileSource:
    uri: str
    folder: Path

    def fetch(self, into: Path, bounds: FetchBounds | None = None) -> None:
        try:
            self._copy(into, bounds or FetchBounds.within())
        except OSError as err:
            # A path no folder can have (too long, through a file) or may not be read: the files
            # are not there for this server, now or on a retry. Anything else (EIO) stays an
            # OSError, which the load queue retries with backoff.
            if err.errno not in _NOT_THERE:
                raise
            raise AdapterValidationError(ErrorCode.MISSING_FILE, f"{self.uri[:256]} cannot be read: {err.strerror}") from None

    def _copy(self, into: Path, bounds: FetchBounds) -> None:
        for name in ADAPTER_FILES:
            if not (self.folder / name).is_file():
                raise AdapterValidationError(ErrorCode.MISSING_FILE, f"{name} is missing from {self.uri[:256]}")
        # Pickle files are refused by validation, which needs only their names: carried empty.
        for pickle in self.folder.iterdir():
            if pickle.suffix.lower() in PICKLE_SUFFIXES and pickle.is_file():
                (into / pickle.name).touch()
        names = [*ADAPTER_FILES, GOLDEN_FILE] if (self.folder / GOLDEN_FILE).is_file() else [*ADAPTER_FILES]
        for name in names:
            source, cap = self.folder / name, bounds.cap(name)
            bounds.check_size(name, source.stat().st_size, self.uri[:256])
            write_capped(file_chunks(source, cap), into / name, cap, bounds, self.uri[:256])


@dataclass(frozen=True)
class S3Source:
    uri: str
    bucket: str
    prefix: str
    settings: S3Settings

    def fetch(self, into: Path, bounds: FetchBounds | None = None) -> None:
        import urllib3
        from minio.error import S3Error, ServerError

        where = self.settings.endpoint or "AWS S3"
        try:
            self._fetch(into, bounds or FetchBounds.within())
        except (urllib3.exceptions.HTTPError, ServerError) as err:
            raise StoreUnavailable(f"{self.uri}: the object store at {where} did not answer ({type(err).__name__})") from err
        except S3Error as err:
            if err.code in _STORE_BUSY:
                raise StoreUnavailable(f"{self.uri}: the object store at {where} answered {err.code}") from err
            raise

    def _fetch(self, into: Path, bounds: FetchBounds) -> None:
        from minio.error import S3Error

        client = self.settings.client()
        listed = {o.object_name.rsplit("/", 1)[-1]: o.size for o in client.list_objects(self.bucket, prefix=self.prefix + "/")}
        pickles = sorted(n for n in listed if n.lower().endswith(PICKLE_SUFFIXES))
        if pickles:
            raise AdapterValidationError(ErrorCode.PICKLE_REFUSED, f"{self.uri} holds pickle files {pickles}; use safetensors")
        for name in [*ADAPTER_FILES, GOLDEN_FILE]:
            if name == GOLDEN_FILE and name not in listed:
                continue
            if listed.get(name) is not None:
                bounds.check_size(name, listed[name], self.uri)
            bounds.check_time(self.uri)
            try:
                response = client.get_object(self.bucket, f"{self.prefix}/{name}")
            except S3Error as err:
                if err.code in ("NoSuchKey", "NoSuchBucket"):
                    raise AdapterValidationError(ErrorCode.MISSING_FILE, f"{name} is missing from {self.uri}") from err
                raise
            try:
                write_capped(response_chunks(response), into / name, bounds.cap(name), bounds, self.uri)
            finally:
                response.close()  # a refused stream's connection is dropped, not drained
                response.release_conn()


def open_source(uri: str, s3: S3Settings | None = None) -> AdapterSource:
    parsed = urlparse(uri)
    if parsed.scheme == "s3":
        if not parsed.netloc:
            raise ValueError(f"{uri!r}: an s3:// source needs a bucket, as in s3://bucket/prefix")
        return S3Source(uri, parsed.netloc, parsed.path.strip("/"), s3 or S3Settings.from_env())
    if parsed.scheme in ("file", ""):
        folder = Path(parsed.path if parsed.scheme else uri)
        with contextlib.suppress(RuntimeError):  # "~name" for no user here: kept as written, as a shell does
            folder = folder.expanduser()
        return FileSource(uri, folder)
    raise ValueError(f"{uri!r}: adapter sources are s3://bucket/prefix, file:///path or a local path")


def under_prefix(uri: str, prefix: str) -> bool:
    """``uri`` is ``prefix`` or inside it, at a path-segment boundary: a policy of
    ``s3://adapters/acme`` admits ``s3://adapters/acme/x``, never ``s3://adapters/acme-evil/x``."""
    return uri == prefix.rstrip("/") or uri.startswith(prefix if prefix.endswith("/") else prefix + "/")
