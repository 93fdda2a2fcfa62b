"""7c. The SSD tier's blocks against one whole-batch IPC stream with zstd (see benchmarks/tiers/__init__.py)."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import pyarrow as pa
from rocksdict import WriteBatch

from expstore import codec
from expstore.synthetic import trajectories
from expstore.tiers.rocks import BLOCK_BYTES

from .data import BATCH, TOKENS, _batch, _raw_db, _timed, blocks, realistic


# -- 3. codec -----------------------------------------------------------------------------

_ZSTD_IPC = pa.ipc.IpcWriteOptions(compression=pa.Codec("zstd", compression_level=1))


def _ipc_stream(batch: pa.RecordBatch) -> bytes:
    """The baseline: a self-describing IPC stream with Arrow's per-buffer zstd."""
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, batch.schema, options=_ZSTD_IPC) as writer:
        writer.write(batch)
    return sink.getvalue().to_pybytes()


def _read_ipc_stream(data: bytes) -> pa.Table:
    return pa.ipc.open_stream(pa.py_buffer(data)).read_all()


def _on_disk(values: list[bytes]) -> int:
    """Bytes of the blob and SST files holding ``values`` once RocksDB flushed them."""
    d = Path(tempfile.mkdtemp(prefix="expstore-codec-"))
    try:
        db, family = _raw_db(d)
        wb = WriteBatch(raw_mode=True)
        for i, v in enumerate(values):
            wb.put(i.to_bytes(8, "big"), v, db.handle[family])
        db.write(wb)
        db.flush()
        db.close()
        return sum(p.stat().st_size for p in (d / "rocksdb").glob("*") if p.suffix in (".blob", ".sst"))
    finally:
        shutil.rmtree(d, ignore_errors=True)


def bench_codec(quick: bool) -> dict:
    reps = 5 if quick else 20
    data = {"realistic (Zipf 152k)": _batch(realistic(BATCH, seed=7)),
            "synthetic (uniform 50k)": _batch(trajectories(BATCH, tokens=TOKENS, seed=7))}
    out = {}
    for label, rb in data.items():
        for unit, parts in (("batch", [rb]), (f"{BLOCK_BYTES >> 10} KiB blocks", blocks(rb))):
            arrow = rb.get_total_buffer_size()
            if unit == "batch":  # a self-describing IPC stream
                encode, decode = _ipc_stream, _read_ipc_stream
            else:  # the SSD tier's blocks: record batch messages, the schema kept once per chunk
                encode = lambda p: codec.encode_block(p).to_pybytes()  # noqa: E731 - RocksDB values are bytes
                decode = lambda e: codec.decode_block(e, rb.schema, "bench", codec.block_checksum(e))  # noqa: E731
            enc = [encode(p) for p in parts]
            t_enc = min(_timed(lambda: [encode(p) for p in parts], reps))
            t_dec = min(_timed(lambda: [decode(e) for e in enc], reps))
            stored = sum(map(len, enc)) if unit == "batch" else _on_disk(enc)
            out[f"{label}, {unit}"] = {"arrow_bytes": arrow, "encoded_bytes": stored, "values": len(parts),
                                       "ratio": arrow / stored, "encode_MB_per_s": arrow / t_enc / 1e6,
                                       "decode_MB_per_s": arrow / t_dec / 1e6}
        cols = {}
        for name in ("tokens", "logprobs", "loss_mask"):
            one = pa.record_batch([rb.column(name)], names=[name])
            cols[name] = one.get_total_buffer_size() / len(_ipc_stream(one))
        out[f"{label}, batch"]["column_ratios"] = cols
    return out


