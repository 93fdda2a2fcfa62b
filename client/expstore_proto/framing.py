"""Zero-copy framing of the messages that carry Arrow payloads.

Protobuf copies a ``bytes`` field on every step: building a message, serialising it,
parsing it and reading the field back (measured here: ~20-40 ms each for 9 MB). The
messages with a large ``arrow_ipc`` field (InsertRequest, RowsResponse) are therefore
framed by hand, in the exact protobuf wire format, so any protobuf peer reads them:

* encode: ``small fields serialised by protobuf`` + ``tag, varint length, payload``:
  protobuf parses concatenated fields as one message, so the only copy is the join;
* decode: walk the top-level fields, hand the payload out as a ``memoryview`` into the
  received buffer, and let protobuf parse only the small remaining fields.
"""

from __future__ import annotations

from typing import TypeVar

from google.protobuf.message import DecodeError

M = TypeVar("M")

_LEN = 2  # wire type of length-delimited fields


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte = value & 0x7F
        value >>= 7
        if value:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def _read_varint(buf: memoryview, pos: int) -> tuple[int, int]:
    result = shift = 0
    while True:
        if pos >= len(buf) or shift > 63:
            raise ValueError("truncated or oversized varint")
        byte = buf[pos]
        pos += 1
        result |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return result, pos
        shift += 7


def encode(message, field: int, *payload) -> bytes:
    """``message`` (payload field unset) with ``payload``, one buffer or the pieces of
    one (``arrow_ipc.encode_pieces``), as length-delimited ``field``."""
    size = sum(memoryview(piece).nbytes for piece in payload)
    return b"".join((message.SerializeToString() + _varint(field << 3 | _LEN) + _varint(size), *payload))


def decode(data: bytes, message_type: type[M], field: int) -> tuple[M, memoryview]:
    """Parse ``data``; the payload of ``field`` (its last occurrence) comes back as a view
    into ``data``, the other fields parsed by protobuf. Raises ValueError (malformed)."""
    buf = memoryview(data)
    payload = memoryview(b"")
    rest: list[memoryview] = []
    pos = 0
    while pos < len(buf):
        start = pos
        key, pos = _read_varint(buf, pos)
        number, wire = key >> 3, key & 7
        if wire == 0:
            _, pos = _read_varint(buf, pos)
        elif wire == 1:
            pos += 8
        elif wire == 5:
            pos += 4
        elif wire == _LEN:
            length, pos = _read_varint(buf, pos)
            if number == field:
                if pos + length > len(buf):
                    raise ValueError("truncated payload")
                payload = buf[pos:pos + length]
                pos += length
                continue
            pos += length
        else:
            raise ValueError(f"unsupported wire type {wire}")
        if pos > len(buf):
            raise ValueError("truncated message")
        rest.append(buf[start:pos])
    try:
        message = message_type.FromString(b"".join(rest))
    except DecodeError as e:
        raise ValueError(f"malformed {message_type.__name__}: {e}") from None
    return message, payload
