"""Triton runs on CPU here through its interpreter, which must be switched on before import."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")
