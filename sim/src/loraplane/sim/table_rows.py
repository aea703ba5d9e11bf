"""Rows of user-supplied tables (CSV, JSONL) validated into pydantic models, with errors that name
the file and line, shared by trace files and the planner's adapter table."""

from __future__ import annotations

import csv
from collections.abc import Iterator
from pathlib import Path
from typing import TypeVar

from pydantic import BaseModel, ValidationError

M = TypeVar("M", bound=BaseModel)


class RowError(ValueError):
    """A row that cannot be used; the message starts with ``file:line:``."""


def csv_rows(path: Path, fh: Iterator[str], error: type[ValueError] = RowError) -> Iterator[tuple[int, dict[str, object]]]:
    """(line number, fields) per data row; empty cells are dropped so model defaults apply."""
    reader = csv.DictReader(fh)
    for row in reader:
        if None in row:
            raise error(f"{path}:{reader.line_num}: more fields than the header has")
        yield reader.line_num, {k: v for k, v in row.items() if v not in (None, "")}


def validate_row(model: type[M], row: dict[str, object], where: str, error: type[ValueError] = RowError) -> M:
    try:
        return model.model_validate(row)
    except ValidationError as exc:
        first = exc.errors()[0]
        field = ".".join(str(p) for p in first["loc"]) or "row"
        raise error(f"{where}: {field}: {first['msg']}") from None
