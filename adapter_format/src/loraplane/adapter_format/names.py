"""Adapter names end up in cache paths, metric labels and URLs, so only a safe alphabet passes."""

from __future__ import annotations

import re

from loraplane.adapter_format.errors import AdapterValidationError, ErrorCode

# The owner of adapters a server registers for itself (a quality gate's candidate, a new version
# under golden replay before it takes its name): no API key maps to it and no caller sees them.
INTERNAL_OWNER = "loraplane:internal"

# DNS-1123-like so a name is also a valid Kubernetes object name; dots allowed for versions.
# The same expression is the LoraAdapter CRD's servedName pattern (RE2 reads it too).
ADAPTER_NAME_PATTERN = r"^[a-z0-9]([a-z0-9._-]{0,126}[a-z0-9])?$"
_NAME = re.compile(ADAPTER_NAME_PATTERN)


def check_adapter_name(name: str) -> str:
    if not _NAME.match(name) or ".." in name:
        raise AdapterValidationError(
            ErrorCode.UNSAFE_NAME,
            f"adapter name {name!r} must be 1-128 lowercase letters, digits, '.', '_' or '-', "
            "start and end with a letter or digit, and contain no '..'",
        )
    return name
