"""Bounding text a client sent before the server logs it or echoes it back.

A table name, a consumer group or a SQL statement may be megabytes long; the audit log,
the JSON logs and a status message must not grow with it. ``clip`` keeps the head of the
text and says how much was cut, so a reader sees both what it was and that it was cut.
"""

from __future__ import annotations

FIELD_CHARS = 256      # one logged field (a table name, a detail)
MESSAGE_CHARS = 2048   # a status message sent back (gRPC trailing metadata is ~8 KiB at most)
LOG_CHARS = 65536      # one field of a JSON log line, a traceback included


def clip(text: str, limit: int = FIELD_CHARS) -> str:
    """``text`` if it has at most ``limit`` characters, else its first ``limit``
    characters followed by ``...[N more characters]``."""
    if len(text) <= limit:
        return text
    return f"{text[:limit]}...[{len(text) - limit} more characters]"
