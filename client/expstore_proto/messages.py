"""Protobuf message helpers shared by server and client."""

from __future__ import annotations

from typing import Any


def message_to_dict(msg) -> dict[str, Any]:
    """Set fields only (proto3 ``optional`` gives presence), nested messages as dicts,
    64-bit integers as ints (unlike json_format, which writes them as strings)."""
    out: dict[str, Any] = {}
    for fd, value in msg.ListFields():
        if fd.message_type is not None and fd.message_type.GetOptions().map_entry:
            out[fd.name] = dict(value)
        elif fd.message_type is not None:
            out[fd.name] = message_to_dict(value)
        else:
            out[fd.name] = value
    return out
