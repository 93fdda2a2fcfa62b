"""Durable tables, in process (no gRPC): insert, sample, codec, restart, checkpoint.

Five measurements, one module each (insert, sample, blocks, restart, checkpoint; ``data``
holds what they share, ``report`` the tables), each against a ceiling measured in the
same run where one exists:

1. insert: batches of 256 trajectories (realistic tokens, below) of ~36 KiB and of ~300 B
   rows into a fresh table of each kind: the DEFAULT durable table (tiers "ssd", memory
   cache 256 MiB) at durability wal (its default), fsync and memory, and a memory table
   (tiers "memory"); then 4 threads at wal and at fsync (group commit: the fsyncs run are
   counted). Ceilings: raw writes of the same stored values as the SSD tier stores them:
   300 B rows under the same keys to a RocksDB with the engine's options (``Database``:
   blob files, LZ4 at flush), one WriteBatch per insert; 36 KiB rows (chunks over
   ``FILE_BYTES``) as one chunk file per insert and its meta put (and, for comparison, as
   RocksDB puts); the log unsynced or synced per batch (1 and 4 threads). Each
   config gets its own data dir; configs alternate per round; median of rounds.
2. sample(256), uniform, p50/p99 when the data sits in memory (durable table, cache
   larger than the data), on the SSD only (cache of 1 MiB: every sample reads RocksDB
   blocks; the OS page cache is warm, as it is right after the inserts), then a consumer
   group streaming the table once through (``stream(256)`` + ``ack``), and on the
   remote tier (file:// Lance under the temp dir; ssd_bytes 1 MiB, ``demote`` until 0).
   A remote read promotes whole chunks into memory, so: the first sample (cold), the
   steady state after it (cache larger than the data), and with a 1 MiB cache (every
   sample cold).
3. the SSD tier's blocks (``codec.encode_block``/``decode_block``: IPC messages; the CRC32C
   check on decode) against one whole-batch IPC stream with Arrow's zstd (``_ipc_stream``):
   MB/s of Arrow bytes, on one 256-row batch whole and in the SSD tier's ~64 KiB blocks,
   realistic tokens vs the uniform tokens of ``expstore.synthetic``; the ratio of the
   blocks is that of the files after RocksDB's LZ4 (written to a Database and flushed).
4. restart of 1M items (64 tokens each; --quick: 100k): a child process builds each data
   dir (the two at once) (inserts of 2048 rows, one sample(256) after each) and exits without closing (a
   crash); ``Catalog(data_dir)`` is timed on the crash restart, then on clean restarts.
   Once with the journal's own snapshots, once with snapshots turned off for the whole
   life of the dir (``Journal.wants_snapshot`` patched in this process and the child):
   every record replayed.
5. ``Checkpointer.create`` to a file:// remote vs fsspec ``put`` (local copy) of a
   RocksDB checkpoint of the same database; and, if ``moto_server`` starts, the same
   against S3 on 127.0.0.1 (moto keeps objects in memory, in its own process).

"Realistic" token data: token ids drawn i.i.d. from a Zipf law (s = 1.1) over a
151,936-id vocabulary (Qwen2's), ranks shuffled onto ids; logprobs float32 <= 0 (as
``synthetic``: -Exp(1) on completion tokens, 0 on the prompt). Real text also repeats
n-grams, which zstd would find too: these ratios are a floor. Runs with glibc's large
buffers kept (``keep_freed_memory``), as the server does by default. Prints JSON on its
last stdout line and the tables (``render``) on stderr.
"""

from __future__ import annotations

import shutil
import sys
import tempfile
import time
from pathlib import Path

from expstore_server.main import keep_freed_memory


from .blocks import bench_codec
from .checkpoint import bench_checkpoint
from .insert import bench_insert
from .report import render
from .restart import bench_restart, build_restart_dir
from .sample import bench_sample


# -- the run ------------------------------------------------------------------------------

def run(quick: bool) -> dict:
    keep_freed_memory()  # as the server does by default: large buffers reused, not faulted in afresh
    tmp = Path(tempfile.mkdtemp(prefix="expstore-tiers-"))
    out: dict = {"quick": quick}
    timings = {}
    try:
        for name, fn in (("codec", lambda: bench_codec(quick)), ("insert", lambda: bench_insert(tmp, quick)),
                         ("sample", lambda: bench_sample(tmp, quick)), ("restart", lambda: bench_restart(tmp, quick))):
            t0 = time.perf_counter()
            out[name] = fn()
            timings[name] = time.perf_counter() - t0
            print(f"tiers: {name} done in {timings[name]:.0f} s", file=sys.stderr, flush=True)
        t0 = time.perf_counter()
        out["checkpoint"] = bench_checkpoint(tmp, Path(out["restart"].pop("checkpoint_dir")), quick)
        timings["checkpoint"] = time.perf_counter() - t0
        out["timings_s"] = timings
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out
