"""One error type with a machine-readable code per rule, so the operator can put the code in a
condition's ``reason`` and the server in an HTTP error's ``code``."""

from __future__ import annotations

from enum import StrEnum


class ErrorCode(StrEnum):
    UNSAFE_NAME = "UnsafeName"
    MISSING_FILE = "MissingFile"
    PICKLE_REFUSED = "PickleRefused"
    BAD_CONFIG = "BadConfig"
    CORRUPT_SAFETENSORS = "CorruptSafetensors"
    DIGEST_MISMATCH = "DigestMismatch"
    BASE_MISMATCH = "BaseMismatch"
    RANK_OVER_CAP = "RankOverCap"
    UNSUPPORTED_TARGET = "UnsupportedTargetModule"
    SHAPE_MISMATCH = "ShapeMismatch"
    NO_MATCHING_TENSORS = "NoMatchingTensors"
    TOO_LARGE = "TooLarge"
    GOLDEN_DRIFT = "GoldenOutputDrift"


class AdapterValidationError(ValueError):
    def __init__(self, code: ErrorCode, message: str) -> None:
        super().__init__(f"{code.value}: {message}")
        self.code = code
        self.message = message
