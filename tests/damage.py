"""Damage real stored files, as a failing disk or bucket would: one flipped byte in a
value of a RocksDB SST or blob file, or in a Lance fragment's data file."""

from __future__ import annotations

from pathlib import Path

import lance
import numpy as np


def flush(db) -> None:
    """Write the memtables of every column family to SST files (what a damaged disk holds)."""
    for cf in db.cf.values():
        cf.flush(True)


def flip_in_sst(data_dir: Path, value: bytes, at: int | None = None) -> Path:
    """Flip one byte of a stored value (at ``at``; default: its middle) where RocksDB
    wrote it, in the one SST file under ``data_dir`` that holds it. The server is stopped."""
    at = len(value) // 2 if at is None else at
    hits = [(f, data.find(value)) for f in sorted(Path(data_dir, "rocksdb").glob("*.sst"))
            for data in [f.read_bytes()] for _ in range(data.count(value))]
    assert len(hits) == 1, f"the value is stored {len(hits)} times, expected once (flush, no compaction)"
    path, offset = hits[0]
    data = bytearray(path.read_bytes())
    data[offset + at] ^= 0x5A
    path.write_bytes(bytes(data))
    return path


def flip_stored(data_dir: Path, key: bytes, value: bytes) -> Path:
    """Flip one byte of the stored value of ``key`` where RocksDB wrote it: in an SST file
    (small values, stored as they are) or in a blob file (values of MIN_BLOB_BYTES or
    more, LZ4-compressed: the byte flipped is in the compressed value, just after the
    key that the blob record stores in the clear). The server is stopped."""
    from expstore.tiers.rocks import MIN_BLOB_BYTES
    if len(value) < MIN_BLOB_BYTES:
        return flip_in_sst(data_dir, value)
    hits = [(f, data.find(key)) for f in sorted(Path(data_dir, "rocksdb").glob("*.blob"))
            for data in [f.read_bytes()] for _ in range(data.count(key))]
    assert len(hits) == 1, f"the key is in blob files {len(hits)} times, expected once (flush, no compaction)"
    path, offset = hits[0]
    data = bytearray(path.read_bytes())
    data[offset + len(key) + 64] ^= 0x5A
    path.write_bytes(bytes(data))
    return path


def fragment_file(uri: str, chunk: int) -> Path:
    """The data file of the Lance fragment holding ``chunk`` in dataset ``uri`` (file://)."""
    ds = lance.dataset(uri)
    for f in ds.get_fragments():
        if f.to_table(columns=["_chunk"]).column(0)[0].as_py() == chunk:
            return Path(uri.removeprefix("file://"), "data", f.data_files()[0].path)
    raise AssertionError(f"no fragment holds chunk {chunk}")


def flip_in_file(path: Path, needle: bytes) -> None:
    """Flip one byte inside the one occurrence of ``needle`` in a file."""
    data = bytearray(path.read_bytes())
    assert data.count(needle) == 1, "the bytes to damage are not in the file exactly once"
    data[data.find(needle) + len(needle) // 2] ^= 0x5A
    path.write_bytes(bytes(data))


def logprob_bytes(batch, row: int) -> bytes:
    """The raw float32 logprobs of one row (Lance stores them as they are)."""
    return np.asarray(batch.column("logprobs")[row].values.to_numpy(), np.float32).tobytes()
