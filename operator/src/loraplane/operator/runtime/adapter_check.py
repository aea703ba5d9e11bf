"""A LoraAdapter's checks before any replica sees it: fetch from the object store, digest, the shared
validation rules (``loraplane.adapter_format``, the same code the engine runs), and the shape the
manifest declares. Each failure carries the reason that goes into the adapter's conditions."""

from __future__ import annotations

import asyncio
import errno
import tempfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from loraplane.adapter_format import AdapterValidationError, BaseShape, ValidationLimits, validate_adapter_dir
from loraplane.adapter_format.download import FETCH_DEADLINE_SECONDS, FetchBounds
from loraplane.adapter_format.sources import S3Settings, StoreUnavailable, open_source
from loraplane.adapter_format.validation import AdapterManifest
from loraplane.admin_api.engine_sizing import EngineSizing
from loraplane.operator.api.loraadapter import LoraAdapterSpec

# The object store's own threads. Every Kubernetes API call the operator makes (cluster.py) runs
# on the event loop's default executor; were fetches there too, a slow or hanging store would
# queue them behind its downloads and stall every reconcile and the webhook's lookups with it.
FETCHERS = ThreadPoolExecutor(max_workers=4, thread_name_prefix="adapter-fetch")


DEFERRED_REASONS = frozenset({"ScratchFull", "StoreUnreachable"})


@dataclass
class CheckDeferred(Exception):
    """The check could not run for a reason that is not the adapter's (the operator's scratch
    volume is full, the object store does not answer): nothing is known about the adapter, which
    is checked again later (its reason is one of ``DEFERRED_REASONS``), not failed."""

    reason: str  # CamelCase, for a condition
    message: str


@dataclass
class CheckFailed(Exception):
    reason: str  # CamelCase, for a condition
    message: str

    def __str__(self) -> str:
        return f"{self.reason}: {self.message}"


def check_adapter(
    spec: LoraAdapterSpec, base: BaseShape, engine: EngineSizing, s3: S3Settings | None = None,
    deadline: float = FETCH_DEADLINE_SECONDS,
) -> AdapterManifest:  # fmt: skip
    """The manifest of a valid adapter, or :class:`CheckFailed`, under the base's engine limits.
    Blocking (network and disk): run it in a thread. The fetch stops at each file's byte cap as it
    streams (the scratch folder is an emptyDir with a size limit) and at ``deadline`` seconds."""
    limits = ValidationLimits(
        max_lora_rank=engine.max_lora_rank, allow_rank_truncation=spec.rank_policy == "Truncate",
        require_adapter_digest=engine.require_adapter_digest,
    )  # fmt: skip
    try:
        manifest = _fetch_and_validate(spec, base, limits, s3, deadline)
    except TimeoutError:  # past the deadline (an OSError too): transient, the caller tries again later
        raise
    except OSError as err:  # the scratch folder itself, or the files landing in it
        if err.errno in (errno.ENOSPC, errno.EDQUOT):
            raise CheckDeferred("ScratchFull", f"the operator's scratch volume is full ({err}); retrying") from None
        raise CheckFailed("FetchFailed", f"{spec.source.uri}: {err}") from None
    if spec.rank is not None and spec.rank != manifest.rank:
        raise CheckFailed("DeclaredRankMismatch", f"the manifest declares rank {spec.rank}, the files have rank {manifest.rank}")
    if spec.target_modules is not None and set(spec.target_modules) != set(manifest.target_modules):
        raise CheckFailed(
            "DeclaredTargetsMismatch",
            f"the manifest declares {sorted(spec.target_modules)}, the files adapt {sorted(manifest.target_modules)}",
        )
    return manifest


def _fetch_and_validate(
    spec: LoraAdapterSpec, base: BaseShape, limits: ValidationLimits, s3: S3Settings | None, deadline: float
) -> AdapterManifest:
    """The adapter's files fetched into a scratch folder and validated there; the folder goes
    with the call. A full or failing disk is the caller's ``OSError``."""
    with tempfile.TemporaryDirectory(prefix="loraplane-check-") as tmp:
        folder = Path(tmp) / "adapter"
        folder.mkdir()
        try:
            open_source(spec.source.uri, s3).fetch(folder, FetchBounds.within(deadline))
            return validate_adapter_dir(folder, base, limits, expected_digest=spec.source.digest)
        except AdapterValidationError as err:
            raise CheckFailed(err.code.value, err.message) from None
        except StoreUnavailable as err:  # a ConnectionError, so before the caller's OSError
            raise CheckDeferred("StoreUnreachable", f"{err}; retrying") from None


async def check_adapter_off_loop(
    spec: LoraAdapterSpec, base: BaseShape, engine: EngineSizing, s3: S3Settings | None = None,
    *, deadline: float = FETCH_DEADLINE_SECONDS,
) -> AdapterManifest:  # fmt: skip
    """:func:`check_adapter` on the fetch threads, given up after ``deadline`` seconds with
    ``TimeoutError`` (a transient failure: the caller retries later). The fetch itself stops at
    the same deadline between chunks; a thread stuck in one read stays stuck until its socket
    times out, and there are only ``FETCHERS``' few of them."""
    future = asyncio.get_running_loop().run_in_executor(FETCHERS, check_adapter, spec, base, engine, s3, deadline)
    return await asyncio.wait_for(future, deadline)
