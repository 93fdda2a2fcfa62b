"""Arrow / Python values as JSON for the pages: exact where JSON can be, text otherwise."""

from __future__ import annotations

import datetime
import decimal
import json
import math
from typing import Any

CELL_CHARS = 200  # characters of a grid cell (the downloads have every character)
CELL_ITEMS = 16   # list elements a grid cell shows


def jsonable(v: Any) -> Any:
    """``v`` as JSON-encodable values: non-finite floats as "nan"/"inf"/"-inf", maps
    (lists of key-value pairs from Arrow) as objects, bytes as hex, times as ISO text."""
    if v is None or isinstance(v, (bool, int, str)):
        return v
    if isinstance(v, float):
        return v if math.isfinite(v) else str(v)
    if isinstance(v, dict):
        return {str(k): jsonable(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        if v and all(isinstance(x, tuple) and len(x) == 2 for x in v):  # an Arrow map
            return {str(k): jsonable(x) for k, x in v}
        return [jsonable(x) for x in v]
    if isinstance(v, (bytes, bytearray, memoryview)):
        return bytes(v).hex()
    if isinstance(v, (datetime.date, datetime.time, datetime.timedelta)):
        return v.isoformat() if hasattr(v, "isoformat") else str(v)
    if isinstance(v, decimal.Decimal):
        return str(v)
    return str(v)


def cell_text(v: Any) -> str | float | int | bool | None:
    """A grid cell: numbers and booleans as they are, everything else as text of at most
    CELL_CHARS characters (lists show their first CELL_ITEMS elements and their length)."""
    if v is None or isinstance(v, (bool, int)):
        return v
    if isinstance(v, float):
        return v if math.isfinite(v) else str(v)
    if isinstance(v, str):
        s = v
    elif isinstance(v, (list, tuple)) and len(v) > CELL_ITEMS:
        s = json.dumps(jsonable(list(v[:CELL_ITEMS])))[:-1] + f", … ({len(v)} items)]"
    else:
        s = json.dumps(jsonable(v))
    return s if len(s) <= CELL_CHARS else s[:CELL_CHARS - 1] + "…"


def sql_string(text: str) -> str:
    """A SQL string literal (DuckDB: quotes doubled, backslashes plain)."""
    return "'" + str(text).replace("'", "''") + "'"
