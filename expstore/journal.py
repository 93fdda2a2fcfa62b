"""A durable table's log of state changes, and its snapshots.

Every change to a table's index (inserts, removals, samples, priority and version
updates, compactions, moves to the remote tier, stream deliveries and acks, cuts) is
appended as one record under the table lock, so the log order is the order the changes
were applied. A restart loads
the latest snapshot and replays the records after it (``recovery.restore``; the kinds of
record, each with its fields and replay, are in records.py). Records hold
effects, not requests: "these ids were sampled", never "sample 256", so replay needs no
randomness. Once the records since the last snapshot outweigh it, the table writes a new
snapshot and the older records are deleted in the same write: replay stays bounded. The
state is taken under the table lock; packing and writing it happen on a writer thread
(``snapshot``) while the table's calls go on.

A record is ``u32 header length | JSON header | raw numpy buffers | string lists``: the
header names the kind, the scalars, other lists (JSON) and each array's dtype and length
and each string list's count and bytes, so encoding and decoding are a few ``tobytes`` /
``frombuffer`` calls whatever the batch size. A list of strings is stored as Arrow stores
one (int64 offsets, then the UTF-8 bytes); records written before kept them in the header,
and still read.
"""

from __future__ import annotations

import json
import logging
import threading
from concurrent.futures import Executor
from typing import Any, Iterator

import numpy as np
import pyarrow as pa
from rocksdict import WriteBatch

from .tiers.rocks import Database, table_prefix

log = logging.getLogger("expstore.journal")


def pack(kind: str, fields: dict[str, Any]) -> bytes:
    scalars, strings, arrays, texts, buffers, text_buffers = {}, {}, [], [], [], []
    for name, value in fields.items():
        if isinstance(value, np.ndarray):
            arrays.append([name, value.dtype.str, len(value)])
            buffers.append(np.ascontiguousarray(value).tobytes())
        elif isinstance(value, (list, pa.Array, pa.ChunkedArray)):
            text = _text(value)
            if text is None:
                strings[name] = value if isinstance(value, list) else value.to_pylist()
            else:
                offsets, data = text
                texts.append([name, len(value), len(data)])
                text_buffers += (offsets, data)
        else:
            scalars[name] = value
    header = json.dumps({"k": kind, "s": scalars, "t": strings, "a": arrays, "u": texts},
                        separators=(",", ":")).encode()
    return len(header).to_bytes(4, "little") + header + b"".join(buffers + text_buffers)


def unpack(data: bytes) -> tuple[str, dict[str, Any]]:
    n = int.from_bytes(data[:4], "little")
    header = json.loads(data[4:4 + n])
    fields: dict[str, Any] = {**header["s"], **header["t"]}
    offset = 4 + n
    for name, dtype, length in header["a"]:
        dt = np.dtype(dtype)
        fields[name] = np.frombuffer(data, dtype=dt, count=length, offset=offset)
        offset += dt.itemsize * length
    buffer = pa.py_buffer(data)
    for name, count, nbytes in header.get("u", ()):  # records written before hold none
        offsets = buffer.slice(offset, 8 * (count + 1))
        offset += 8 * (count + 1)
        fields[name] = pa.Array.from_buffers(pa.large_string(), count,
                                             [None, offsets, buffer.slice(offset, nbytes)]).to_pylist()
        offset += nbytes
    return header["k"], fields


def _text(value: list | pa.Array | pa.ChunkedArray) -> tuple[memoryview | bytes, memoryview] | None:
    """A list (or Arrow array) of strings as Arrow's (offsets, UTF-8 bytes), or None for
    any other list, or one with nulls (kept as JSON). A snapshot holds every live item's
    key: JSON took ~90 ms for 200,000 of them, Arrow's own conversion ~20 (and reading
    them back 108 -> 27 ms)."""
    if isinstance(value, (pa.Array, pa.ChunkedArray)):
        if not (pa.types.is_string(value.type) or pa.types.is_large_string(value.type)):
            return None
        array = value.cast(pa.large_string())
        if isinstance(array, pa.ChunkedArray):
            array = array.combine_chunks()
    elif not value or not isinstance(value[0], str):
        return None
    else:
        try:
            array = pa.array(value, pa.large_string())
        except (pa.ArrowTypeError, pa.ArrowInvalid):
            return None
    if array.null_count or not len(array):
        return None
    _, offsets, data = array.buffers()
    bounds = np.frombuffer(offsets, np.int64, count=array.offset + len(array) + 1)[array.offset:]
    start, end = int(bounds[0]), int(bounds[-1])
    data = memoryview(data)[start:end] if data is not None else memoryview(b"")
    if start == 0 and array.offset == 0:
        return memoryview(offsets)[:8 * (len(array) + 1)], data
    return (bounds - start).tobytes(), data  # a slice: its offsets rebased to its first value


class Journal:
    def __init__(self, db: Database, table_id: int, writer: Executor | None = None) -> None:
        """``writer``: where due snapshots are packed and written (one thread, shared by the
        server's tables); None: at once, by the caller."""
        self.db = db
        self._prefix = table_prefix(table_id)
        self._snapshot_key = b"snapshot/" + self._prefix
        self._next = 0
        self.bytes_since_snapshot = 0
        self.snapshot_bytes = 0
        self._writer = writer
        self._writing = threading.Lock()  # a snapshot write, and DropTable's delete, one at a time
        self._snapshot_next = 0  # journal_next of the stored snapshot: an older one never replaces it
        self._dropped = False

    def append(self, kind: str, durability: str = "wal", *,
               manifest: tuple[int, np.ndarray, np.ndarray] | None = None,
               drop_manifests_after: int | None = None, **fields: Any) -> None:
        """Append one record. In the same atomic write, ``manifest=(step, ids, versions)``
        replaces step's manifest (a training cut), and ``drop_manifests_after=step``
        deletes the manifests of every later step (a resume)."""
        value = pack(kind, fields)
        wb = WriteBatch(raw_mode=True)
        wb.put(self._key(self._next), value, self.db.handle["journal"])
        if manifest is not None:
            step, ids, versions = manifest
            wb.delete_range(self._manifest_key(step), self._manifest_key(step + 1), self.db.handle["meta"])
            wb.put(self._manifest_key(step, self._next), pack("manifest", {"ids": ids, "versions": versions}),
                   self.db.handle["meta"])
        if drop_manifests_after is not None:
            wb.delete_range(self._manifest_key(drop_manifests_after + 1), self._manifests_end(),
                            self.db.handle["meta"])
        self.db.write(wb, durability)
        self._next += 1
        self.bytes_since_snapshot += len(value)

    def wants_snapshot(self) -> bool:
        return self.bytes_since_snapshot > max(1 << 20, self.snapshot_bytes)

    def snapshot(self, fields: dict[str, Any]) -> None:
        """Snapshot the table state ``fields``, taken (under the table lock) after the
        records so far: packed and written on the writer's thread, so that the table's
        calls go on meanwhile (at 200,000 items the lock was held ~150-190 ms while the
        snapshot was written; the capture takes ~15-22). A crash before it is written loses
        nothing: the records it would have dropped are still there. Without a writer, as
        ``write_snapshot``."""
        upto, self.bytes_since_snapshot = self._next, 0
        if self._writer is not None:
            try:
                self._writer.submit(self._write_later, fields, upto)
                return
            except RuntimeError:  # the catalog is closing (its writer is shut down)
                pass
        self._write(fields, upto)

    def write_snapshot(self, fields: dict[str, Any]) -> None:
        """Store a snapshot of the whole table state (after the records so far) now."""
        self.bytes_since_snapshot = 0
        self._write(fields, self._next)

    def _write(self, fields: dict[str, Any], upto: int) -> None:
        """The snapshot and the deletion of the records before ``upto``, in one atomic
        write; skipped if a snapshot taken later is stored already (or the table was
        dropped): an older one would drop fewer records but replay from the wrong place."""
        with self._writing:
            if self._dropped or upto < self._snapshot_next:
                return
            value = pack("snapshot", {**fields, "journal_next": upto})
            wb = WriteBatch(raw_mode=True)
            wb.put(self._snapshot_key, value, self.db.handle["meta"])
            wb.delete_range(self._key(0), self._key(upto), self.db.handle["journal"])
            self.db.write(wb, "wal")
            self.snapshot_bytes, self._snapshot_next = len(value), upto

    def _write_later(self, fields: dict[str, Any], upto: int) -> None:
        try:
            self._write(fields, upto)
        except Exception:  # noqa: BLE001 - the records stay; the next snapshot tries again
            log.exception("writing a snapshot of table id %d failed; its records are kept",
                          int.from_bytes(self._prefix, "big"))

    def load(self) -> tuple[dict[str, Any] | None, Iterator[tuple[str, dict[str, Any]]]]:
        """(the latest snapshot or None, the records after it in order). Exhausting the
        records sets the next sequence number past the last one."""
        raw = self.db.get("meta", [self._snapshot_key])[0]
        snapshot = None
        if raw is not None:
            snapshot = unpack(raw)[1]
            self.snapshot_bytes = len(raw)
            self._next = self._snapshot_next = int(snapshot["journal_next"])
        start = self._next

        def records():
            for key, value in self.db.items("journal", self._prefix):
                seq = int.from_bytes(key[4:], "big")
                if seq >= start:
                    self.bytes_since_snapshot += len(value)
                    self._next = seq + 1
                    yield unpack(value)
        return snapshot, records()

    def add_manifest(self, step: int, ids: np.ndarray, versions: np.ndarray) -> None:
        """Record what one sample for training step ``step`` returned (several samples
        of a step add up)."""
        wb = WriteBatch(raw_mode=True)
        wb.put(self._manifest_key(step, self._next), pack("manifest", {"ids": ids, "versions": versions}),
               self.db.handle["meta"])
        self.db.write(wb, "wal")
        self._next += 1

    def manifest(self, step: int) -> list[tuple[np.ndarray, np.ndarray]]:
        return [(f["ids"], f["versions"])
                for f in (unpack(v)[1] for _, v in self.db.items("meta", self._manifest_key(step)))]

    def drop(self) -> None:
        """Delete the table's records and snapshot (DropTable), after a snapshot being
        written; one still waiting for the writer is not written."""
        with self._writing:
            self._dropped = True
            wb = WriteBatch(raw_mode=True)
            wb.delete_range(self._prefix, table_prefix(int.from_bytes(self._prefix, "big") + 1),
                            self.db.handle["journal"])
            wb.delete(self._snapshot_key, self.db.handle["meta"])
            wb.delete_range(self._manifest_key(0), self._manifests_end(), self.db.handle["meta"])
            self.db.write(wb, "wal")

    def _key(self, seq: int) -> bytes:
        return self._prefix + seq.to_bytes(8, "big")

    def _manifest_key(self, step: int, seq: int | None = None) -> bytes:
        """``manifest/<table>/<step>/<seq>``: a step's parts sort together, in order."""
        key = b"manifest/" + self._prefix + step.to_bytes(8, "big")
        return key if seq is None else key + seq.to_bytes(8, "big")

    def _manifests_end(self) -> bytes:
        return b"manifest/" + self._prefix + b"\xff" * 17
