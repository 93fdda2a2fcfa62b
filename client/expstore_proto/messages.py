"""Protobuf message helpers shared by server and client."""

from __future__ import annotations

from typing import Any


def message_to_dict(msg) -> dict[str, Any]:
    """Set fields only (proto3 ``optional`` gives presence), nested messages as dicts
    (map values and repeated fields too), repeated fields as lists, 64-bit integers as
    ints (unlike json_format, which writes them as strings)."""
    out: dict[str, Any] = {}
    for fd, value in msg.ListFields():
        if fd.message_type is not None and fd.message_type.GetOptions().map_entry:
            nested = fd.message_type.fields_by_name["value"].message_type is not None
            out[fd.name] = {k: message_to_dict(v) if nested else v for k, v in value.items()}
        elif _repeated(fd):
            out[fd.name] = [message_to_dict(v) if fd.message_type is not None else v for v in value]
        elif fd.message_type is not None:
            out[fd.name] = message_to_dict(value)
        else:
            out[fd.name] = value
    return out


def _repeated(fd) -> bool:
    """Whether a field is repeated (``is_repeated`` in protobuf >= 6.31; ``label`` before)."""
    is_repeated = getattr(fd, "is_repeated", None)
    return bool(is_repeated) if is_repeated is not None else fd.label == fd.LABEL_REPEATED
