"""Values of any field a trainer puts (tensors, arrays, JSON-able data) as Arrow columns, and back.

A value is a torch tensor (any dtype, bfloat16 included; any shape; any device, copied
to the CPU), a numpy array or scalar of a fixed-width dtype, or JSON-able data (str,
numbers, bools, None, and lists and dicts of them: verl's non-tensor fields; a tuple
comes back as a list). Each becomes one row of (kind, dtype, shape, data): ``data`` holds
the tensor's bytes in C order, or the JSON text. Anything else is refused with a
TypeError naming the value, never pickled: what the store holds is data, not code.

Copies: encoding joins the values' bytes into one buffer (one copy); decoding copies
each received buffer once (so that the tensors it returns are writable) and hands out
views into that copy.
"""

from __future__ import annotations

import json
import math
from typing import Any, Sequence

import numpy as np
import pyarrow as pa
import torch

KIND_TENSOR, KIND_NUMPY, KIND_JSON = "tensor", "numpy", "json"

FIELDS = [pa.field("kind", pa.string(), nullable=False), pa.field("dtype", pa.string(), nullable=False),
          pa.field("shape", pa.list_(pa.int64()), nullable=False),
          pa.field("data", pa.large_binary(), nullable=False)]


def encode(values: Sequence[Any], names: Sequence[str]) -> dict[str, pa.Array]:
    """Columns kind, dtype, shape, data for ``values``; ``names[i]`` names value i in errors."""
    kinds, dtypes, shapes, chunks = [], [], [], []
    for value, name in zip(values, names, strict=True):
        kind, dtype, shape, chunk = _encode_one(value, name)
        kinds.append(kind)
        dtypes.append(dtype)
        shapes.append(shape)
        chunks.append(chunk)
    offsets = np.zeros(len(chunks) + 1, dtype=np.int64)
    np.cumsum([c.nbytes for c in chunks], out=offsets[1:])
    data = np.concatenate(chunks) if chunks else np.zeros(0, np.uint8)
    binary = pa.Array.from_buffers(pa.large_binary(), len(chunks), [None, pa.py_buffer(offsets), pa.py_buffer(data)])
    return {"kind": pa.array(kinds, pa.string()), "dtype": pa.array(dtypes, pa.string()),
            "shape": pa.array(shapes, pa.list_(pa.int64())), "data": binary}


def _encode_one(value: Any, name: str) -> tuple[str, str, list[int], np.ndarray]:
    if isinstance(value, torch.Tensor):
        t = value.detach()
        if t.is_nested or t.layout != torch.strided:
            raise TypeError(f"{name}: a {t.layout} tensor; expected a dense tensor per value")
        t = t.cpu().contiguous()
        return KIND_TENSOR, str(t.dtype).removeprefix("torch."), list(t.shape), t.reshape(-1).view(torch.uint8).numpy()
    if isinstance(value, (np.ndarray, np.generic)) and not isinstance(value, (np.str_, np.bytes_)):
        a = np.ascontiguousarray(value)
        if a.dtype.hasobject or a.dtype.kind not in "biufcmM":
            raise TypeError(f"{name}: a numpy array of dtype {a.dtype}; expected a fixed-width numeric dtype "
                            f"(convert object arrays to lists)")
        return KIND_NUMPY, a.dtype.str, list(a.shape), a.reshape(-1).view(np.uint8)
    try:
        text = json.dumps(value, allow_nan=True, default=_json_default)
    except (TypeError, ValueError) as e:
        raise TypeError(f"{name}: a {type(value).__name__} is neither a tensor, a numpy array nor JSON-able data "
                        f"({e})") from None
    return KIND_JSON, "", [], np.frombuffer(text.encode(), np.uint8)


def _json_default(v: Any) -> Any:
    if isinstance(v, np.generic):
        return v.item()
    if isinstance(v, np.ndarray) and not v.dtype.hasobject:
        return v.tolist()
    raise TypeError(f"{type(v).__name__} is not JSON-able")


def decode(rows: pa.Table) -> list[Any]:
    """The values of ``rows`` (columns kind, dtype, shape, data), in row order."""
    out: list[Any] = []
    for batch in rows.select(["kind", "dtype", "shape", "data"]).to_batches():
        kinds, dtypes, shapes = (batch.column(i).to_pylist() for i in range(3))
        data = batch.column(3)
        offsets = np.frombuffer(data.buffers()[1], np.int64)[data.offset:data.offset + len(data) + 1]
        values = data.buffers()[2]
        raw = memoryview(bytearray(values if values is not None else b""))  # the one copy: writable tensors
        for kind, dtype, shape, start, end in zip(kinds, dtypes, shapes, offsets[:-1], offsets[1:]):
            out.append(_decode_one(kind, dtype, shape, raw, int(start), int(end)))
    return out


def _decode_one(kind: str, dtype: str, shape: list[int], raw: memoryview, start: int, end: int) -> Any:
    if kind == KIND_JSON:
        return json.loads(bytes(raw[start:end]))
    if kind == KIND_NUMPY:
        dt = np.dtype(dtype)
        return np.frombuffer(raw, dt, count=(end - start) // dt.itemsize, offset=start).reshape(tuple(shape))
    if kind == KIND_TENSOR:
        dt = getattr(torch, dtype, None)
        if not isinstance(dt, torch.dtype):
            raise ValueError(f"a stored tensor of unknown dtype {dtype!r}")
        count = math.prod(shape)
        if count == 0:
            return torch.empty(tuple(shape), dtype=dt)
        if start % dt.itemsize:  # after an odd-sized value: an aligned copy of its own
            return torch.frombuffer(bytearray(raw[start:end]), dtype=dt).reshape(tuple(shape))
        return torch.frombuffer(raw, dtype=dt, count=count, offset=start).reshape(tuple(shape))
    raise ValueError(f"a stored value of unknown kind {kind!r}")
