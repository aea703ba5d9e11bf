"""The LoRA adapter format and its validation rules, shared by the engine and the operator.

Torch-free by contract (import-linter): the operator validates adapters before any serving
replica sees them, and the engine runs the same checks again at load, so both must agree and
neither may drag the other's dependencies in.
"""

from loraplane.adapter_format.base_shape import LLAMA_TARGETS, BaseShape
from loraplane.adapter_format.digest import adapter_digest, file_digest, parse_digest
from loraplane.adapter_format.errors import AdapterValidationError, ErrorCode
from loraplane.adapter_format.names import check_adapter_name
from loraplane.adapter_format.peft_config import PeftLoraConfig
from loraplane.adapter_format.safetensors_header import TensorInfo, read_safetensors_header
from loraplane.adapter_format.validation import AdapterManifest, ValidationLimits, validate_adapter_dir

__all__ = [
    "LLAMA_TARGETS",
    "AdapterManifest",
    "AdapterValidationError",
    "BaseShape",
    "ErrorCode",
    "PeftLoraConfig",
    "TensorInfo",
    "ValidationLimits",
    "adapter_digest",
    "check_adapter_name",
    "file_digest",
    "parse_digest",
    "read_safetensors_header",
    "validate_adapter_dir",
]
