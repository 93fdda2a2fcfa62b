"""The tables of section 7 (no measuring here)."""

from __future__ import annotations

from ..report import _f, _table

from .data import BATCH


# -- the tables ---------------------------------------------------------------------------


def render(t: dict) -> str:
    mode = "quick" if t.get("quick") else "full"
    parts = [f"7. Durable tables, in process ({mode}; benchmarks/tiers/)"]

    for size, ins in t["insert"]["sizes"].items():
        c = ins["configs"]
        rows = []
        for name in ins["order"]:
            r = c[name]
            ceiling = r["ceiling"]
            ratio = f"{r['items_per_s'] / c[ceiling]['items_per_s']:.2f}x of {ceiling}" if ceiling else "ceiling"
            rows.append([name, _f(r["items_per_s"]), _f(r["MB_per_s"]), _f(r["latency"]["p50_ms"], 1),
                         _f(r["latency"]["p99_ms"], 1), "" if r.get("fsyncs") is None else r["fsyncs"], ratio])
        ssd = "durable table (ssd, default)"
        group = c[f"{ssd}, fsync, 4 threads"]["items_per_s"] / c[f"{ssd}, wal, 4 threads"]["items_per_s"]
        parts += ["\n".join([
            f"7a. Insert, {ins['rows_per_batch']} rows x {ins['arrow_bytes_per_batch'] / BATCH:,.0f} B ({size} rows; "
            f"Arrow {ins['arrow_bytes_per_batch'] / 1e6:.2f} MB/batch, written {ins['stored_bytes_per_batch'] / 1e6:.2f} MB); "
            f"{ins['batches_per_round']} batches/round, median of {ins['rounds']} rounds, fresh data dir each",
            _table(["table kind, durability", "items/s", "Arrow MB/s", "p50 ms", "p99 ms", "fsyncs", "ratio"], rows,
                   align_left=1),
            f"   fsync with 4 threads (group commit) = {group:.2f}x wal with 4 threads; raw RocksDB: the same "
            "stored values and keys, one WriteBatch per insert, the engine's options (blob files, LZ4 at flush); "
            "raw chunk file: the same values as one file per insert and its meta put (chunks of 1 MiB or more)"])]

    s = t["sample"]
    rows = []
    mem_p50 = s["tables"]["memory"]["steady"]["p50_ms"]
    labels = {"memory": "memory (cache > data)", "ssd": "SSD (1 MiB cache)",
              "remote": "remote (cache > data)", "remote_cold": "remote (1 MiB cache)"}
    for name in labels:
        r = s["tables"][name]
        for phase in ("first", "steady", "cold", "stream"):
            if phase not in r:
                continue
            b = r["after_first"] if name == "remote" and phase == "steady" else r["before"]
            where = f"{b['items_memory']:,} / {b['items_ssd']:,} / {b['items_remote']:,}"
            p = r[phase]
            rows.append([labels[name], phase, p["calls"], _f(p["p50_ms"], 1), _f(p["p99_ms"], 1), _f(p["max_ms"], 1),
                         f"{p['p50_ms'] / mem_p50:.1f}x", where])
    extra = [f"reopen of the store (4 tables) before the remote rows: {s['reopen_s']:.2f} s"]
    for name in ("remote", "remote_cold"):
        r = s["tables"][name]
        a = r["after"]
        extra.append(f"{name}: demote() x {r['demoted_chunks']} chunks in {r['demote_s']:.1f} s "
                     f"({s['arrow_bytes'] / 1e6 / r['demote_s']:.0f} Arrow MB/s); after sampling: "
                     f"{a['promotions']:,} promotions, {a['evictions']:,} evictions")
    parts += ["\n".join([f"7b. Sample(256), uniform, in process: {s['items']:,} items, {s['arrow_bytes'] / 1e6:,.0f} MB Arrow "
              f"per table (ratio = p50 / memory p50); remote tables sampled after a store reopen (memory empty)",
              _table(["data in", "phase", "calls", "p50 ms", "p99 ms", "max ms", "vs memory",
                      "items mem / ssd / remote before"], rows, align_left=2),
              *("   " + e for e in extra),
              "   SSD reads hit the OS page cache (written moments before; caches not dropped)"])]

    rows = []
    for name in sorted(t["codec"], key=lambda k: (not k.startswith("realistic"), k)):
        r = t["codec"][name]
        rows.append([name, r["values"], _f(r["arrow_bytes"] / 1e6, 2), _f(r["encoded_bytes"] / 1e6, 2),
                     f"{r['ratio']:.2f}x", _f(r["encode_MB_per_s"]), _f(r["decode_MB_per_s"])])
    cols = "; ".join(f"{k}: " + ", ".join(f"{c} {v:.2f}x" for c, v in r["column_ratios"].items())
                     for k, r in t["codec"].items() if "column_ratios" in r)
    parts += ["\n".join(["7c. SSD blocks (IPC; ratio: the files after RocksDB LZ4) vs one IPC stream (zstd-1), 256 rows x 4096 tokens; MB/s of Arrow bytes, best of reps",
              _table(["data, unit", "values", "Arrow MB", "encoded MB", "ratio", "encode MB/s", "decode MB/s"], rows),
              "   per column: " + cols])]

    r = t["restart"]
    rows = []
    for case in ("with snapshots", "no snapshot"):
        x = r["cases"][case]
        for kind in ("crash_restart", "clean_restart"):
            y = x[kind]
            rows.append([case, kind.replace("_", " "), f"{y['items']:,}", f"{y['records']:,}", _f(y["seconds"], 2),
                         _f(y["first_sample_ms"], 1), f"{x['inserts']:,}", _f(x["build_s"], 0),
                         _f(x["disk_bytes"] / 1e6)])
    note = " (--quick: 100k, not 1M)" if t.get("quick") else ""
    parts += ["\n".join([f"7d. Restart: Catalog(data_dir) with {r['items']:,} items{note} x {r['tokens_per_item']} tokens, "
              f"inserted {r['rows_per_insert']} rows at a time, one sample(256) after each insert",
              _table(["journal", "restart", "items", "records replayed", "seconds", "1st sample ms", "inserts",
                      "build s", "disk MB"], rows, align_left=2),
              "   crash: the builder exited without closing; clean: reopened after a close (median of 2-3; each "
              "reopen then samples once, so records grow by 1); build s: both dirs built at once; "
              "'no snapshot': Journal.wants_snapshot patched off for the dir's whole life"])]

    ck = t["checkpoint"]
    rows = []
    for dest in ("file", "s3"):
        x = ck.get(dest)
        if not x:
            continue
        if "skipped" in x:
            rows.append([dest, "", "", "", "", "", x["skipped"]])
            continue
        label = "file:// (local disk)" if dest == "file" else "S3 (moto on 127.0.0.1, in memory)"
        rows.append([label, _f(x["num_bytes"] / 1e6), _f(x["expstore_s"], 2), _f(x["expstore_s_per_GB"], 2),
                     _f(x["ceiling_s"], 2), _f(x["ceiling_s_per_GB"], 2),
                     f"{x['ceiling_s'] / x['expstore_s']:.0%}"])
    parts += ["\n".join(["7e. Checkpoint of the restart data dir (median of rounds); ceiling: fsspec put(recursive) of a "
              "RocksDB checkpoint of the same DB",
              _table(["remote", "MB", "Checkpointer s", "s/GB", "fsspec put s", "s/GB", "speed vs ceiling"], rows)])]
    return "\n\n".join(parts)


