"""Turning parse results into JSON: dataclasses, datetimes, sets and non-finite floats.

Non-finite floats are written as the bare tokens ``NaN``/``Infinity`` because that is what
the bundle spec's ``metrics.jsonl`` uses and what Python's json reads back; a NaN loss is
the most important value in an incident and must survive a round trip.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from datetime import datetime
from enum import Enum
from pathlib import PurePath
from typing import Any

from spikeops.timeparse import iso

__all__ = ["to_jsonable", "dumps"]


def to_jsonable(value: Any) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: to_jsonable(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, datetime):
        return iso(value)
    if isinstance(value, Enum):
        return value.value
    if isinstance(value, PurePath):
        return str(value)
    if isinstance(value, Mapping):
        return {str(k): to_jsonable(v) for k, v in value.items()}
    if isinstance(value, set | frozenset):
        return sorted(to_jsonable(v) for v in value)
    if isinstance(value, list | tuple):
        return [to_jsonable(v) for v in value]
    if hasattr(value, "item") and callable(value.item):  # numpy / pandas scalars
        return value.item()
    return value


def dumps(value: Any, *, indent: int | None = 2) -> str:
    return json.dumps(to_jsonable(value), indent=indent, ensure_ascii=False, allow_nan=True)
