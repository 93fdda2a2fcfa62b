"""Shared by the durable-table benchmarks: realistic token data, the SSD tier's blocks, helpers."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import pyarrow as pa

from expstore.synthetic import trajectories
from expstore.tiers.rocks import CHUNK_FAMILY, Database, block_offsets

from ..wire import relabel


BATCH = 256
TOKENS = 4096          # ~36 KiB a row
VOCAB = 151_936
ZIPF_S = 1.1
RESTART_TOKENS = 64
RESTART_BATCH = 2048   # ~1.4 MB chunks: above the 1 MiB small-chunk merge threshold

MiB = 1 << 20

# -- data ---------------------------------------------------------------------------------

_ZIPF: tuple[np.ndarray, np.ndarray] | None = None


def zipf_tokens(total: int, rng: np.random.Generator) -> np.ndarray:
    """``total`` int32 token ids, i.i.d. Zipf(s=ZIPF_S) over VOCAB ids (rank -> id shuffled)."""
    global _ZIPF
    if _ZIPF is None:
        p = 1.0 / np.arange(1, VOCAB + 1) ** ZIPF_S
        _ZIPF = (np.cumsum(p / p.sum()), np.random.default_rng(12345).permutation(VOCAB).astype(np.int32))
    cdf, ids = _ZIPF
    return ids[np.minimum(np.searchsorted(cdf, rng.random(total)), VOCAB - 1)]


def realistic(n: int, tokens: int = TOKENS, seed: int = 0, prefix: str = "t") -> pa.Table:
    """``synthetic.trajectories`` (uniform tokens in [0, 50k)) with the tokens replaced."""
    t = trajectories(n, tokens=tokens, seed=seed, id_prefix=prefix)
    col = t.column("tokens").combine_chunks()
    values = zipf_tokens(len(col.values), np.random.default_rng(seed + 1))
    new = pa.ListArray.from_arrays(col.offsets, pa.array(values, pa.int32()))
    i = t.schema.get_field_index("tokens")
    return t.set_column(i, t.schema.field(i), new)


_POOL: list[pa.Table] = []


def pool() -> list[pa.Table]:
    """Four distinct 256-row realistic batches, built once (~1 s each), reused by 7a and 7b."""
    if not _POOL:
        _POOL.extend(realistic(BATCH, seed=s, prefix=f"p{s}") for s in range(4))
    return _POOL


def blocks(batch: pa.RecordBatch) -> list[pa.RecordBatch]:
    """The slices the SSD tier encodes one value each (RocksTier.encode's rule)."""
    offsets = block_offsets(batch.num_rows, batch.get_total_buffer_size()).tolist()
    return [batch.slice(lo, hi - lo) for lo, hi in zip(offsets[:-1], offsets[1:])]


def _batch(t: pa.Table) -> pa.RecordBatch:
    return t.combine_chunks().to_batches()[0]


def _pct(times: list[float]) -> dict:
    ms = np.array(times) * 1e3
    return {"calls": len(ms), "p50_ms": float(np.percentile(ms, 50)), "p99_ms": float(np.percentile(ms, 99)),
            "mean_ms": float(ms.mean()), "max_ms": float(ms.max())}


def _du(path: Path) -> int:
    return sum(p.stat().st_size for p in Path(path).rglob("*") if p.is_file())


def _raw_db(path: Path) -> tuple[Database, str]:
    """A RocksDB with the engine's options (``Database``: blob files, LZ4 at flush, the
    memtable budget) and one table's chunk family, for raw writes."""
    db = Database(path)
    return db, db.family(f"{CHUNK_FAMILY}1")


SIZES = {"36 KiB": TOKENS, "300 B": 20}  # row size -> tokens per row (benchmarks.wire's sizes)
KINDS = {"durable table (ssd, default)": "ssd", "memory table": "memory"}


def _labelled(data: list[pa.Table], n: int, prefix: str) -> list[pa.Table]:
    """n batches cycling over ``data`` with fresh traj_ids (the key of trajectory tables)."""
    return [relabel(data[i % len(data)], f"{prefix}{i}") for i in range(n)]


def _timed(fn, calls: int) -> list[float]:
    times = []
    for _ in range(calls):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return times
