"""Turn the modules' JSON into the printed tables (figures, ratios, targets) and the
JSON file. No measuring here."""

from __future__ import annotations

import json
from pathlib import Path

TARGETS = {
    "ratio": 0.70,           # expstore / raw ceiling, same bytes, same run (36 KiB rows over gRPC)
    "ratio_flight": 1.00,    # the same over Arrow Flight, where the bytes never become Python objects
    "ratio_small": 0.50,     # 300 B rows, either path
    "items_per_s": 10_000,   # 36 KiB items, insert and sample
    "sample_p99_ms": 40.0,   # sample(256) of 36 KiB items
    "stream_vs_sample": 0.90,  # stream delivery at the rate of sample on the same path (within the spread)
    "engine_10m_us": 1000.0,  # prioritized sample of 256 from 10M, in the engine (p50)
    "rss_ratio": 1.10,       # RSS growth / payload bytes
    "producers_errors": 0,
}


def _mark(ok: bool) -> str:
    return "pass" if ok else "MISS"


def _table(headers: list[str], rows: list[list], align_left: int = 1) -> str:
    cells = [[str(h) for h in headers]] + [[str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    def line(r):
        return "  ".join(c.ljust(w) if i < align_left else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths)))
    return "\n".join([line(cells[0]), "  ".join("-" * w for w in widths)] + [line(r) for r in cells[1:]])


def _f(x: float, digits: int = 0) -> str:
    return f"{x:,.{digits}f}"


WIRE_OPS = (("insert", "raw_upload", "upload"), ("insert x2", "raw_upload", "upload"),
            ("insert flight", "raw_upload", "upload"), ("sample", "raw_download", "download"),
            ("sample x2", "raw_download", "download"), ("sample flight", "raw_download", "download"),
            ("sample x2 flight", "raw_download", "download"),
            ("stream", "raw_download", "download"), ("stream flight", "raw_download", "download"),
            ("stream auto-ack", "raw_download", "download"), ("stream auto-ack flight", "raw_download", "download"))
# The Flight rows again, against the raw Arrow Flight ceiling of the same run.
FLIGHT_OPS = (("insert flight", "raw_flight_put", "raw_upload"), ("sample flight", "raw_flight_get", "raw_download"),
              ("sample x2 flight", "raw_flight_get", "raw_download"),
              ("stream flight", "raw_flight_get", "raw_download"),
              ("stream auto-ack flight", "raw_flight_get", "raw_download"))
# Stream delivery against sample on the same path (target: the same rate).
STREAM_OPS = (("stream", "sample"), ("stream auto-ack", "sample"), ("stream flight", "sample flight"),
              ("stream auto-ack flight", "sample flight"))


def _ratio_target(size: str, op: str) -> float:
    if size != "36KiB":
        return TARGETS["ratio_small"]
    return TARGETS["ratio_flight"] if op.endswith("flight") else TARGETS["ratio"]


def wire_section(wire: dict[str, dict], checks: list) -> str:
    rows, latency_rows, flight_rows, stream_rows = [], [], [], []
    for env, res in wire.items():
        for size, s in res["sizes"].items():
            for op, raw_key, raw_name in WIRE_OPS:
                if op not in s:  # results written before the row existed
                    continue
                e, r = s[op], s[raw_key]
                ratio = e["batches_per_s"] / r["batches_per_s"]
                want = _ratio_target(size, op)
                ok_ratio = ratio >= want
                target = f">={want:.0%} {_mark(ok_ratio)}"
                if size == "36KiB":
                    ok_items = e["items_per_s"] >= TARGETS["items_per_s"]
                    target += f"; >=10k/s {_mark(ok_items)}"
                    checks.append((f"{op} 36 KiB >= 10k items/s [{env}]", ok_items, f"{_f(e['items_per_s'])}/s"))
                checks.append((f"{op} {size} >= {want:.0%} of raw {raw_name} [{env}]", ok_ratio, f"{ratio:.0%}"))
                rows.append([env, size, _f(s["arrow_bytes_per_row"]), op, _f(r["MB_per_s"]), _f(r["items_per_s"]),
                             _f(e["MB_per_s"]), _f(e["items_per_s"]), f"{ratio:.2f}x", target])
            for op, raw_key, grpc_key in FLIGHT_OPS:
                if op in s and raw_key in s:
                    e, r = s[op], s[raw_key]
                    flight_rows.append([env, size, op, raw_key, _f(r["items_per_s"]), _f(e["items_per_s"]),
                                        f"{e['batches_per_s'] / r['batches_per_s']:.2f}x",
                                        f"{r['batches_per_s'] / s[grpc_key]['batches_per_s']:.2f}x"])
            for op, base in STREAM_OPS:
                if op in s:
                    ratio = s[op]["batches_per_s"] / s[base]["batches_per_s"]
                    ok = ratio >= TARGETS["stream_vs_sample"]
                    checks.append((f"{op} {size} at the rate of {base} (>= {TARGETS['stream_vs_sample']:.0%}) [{env}]",
                                   ok, f"{ratio:.0%}"))
                    stream_rows.append([env, size, op, base, _f(s[base]["items_per_s"]), _f(s[op]["items_per_s"]),
                                        f"{ratio:.2f}x", f">={TARGETS['stream_vs_sample']:.0%} {_mark(ok)}"])
            if size == "36KiB":
                for op, lat in s["sample_latency_ms"].items():
                    ok = lat["p99"] < TARGETS["sample_p99_ms"]
                    checks.append((f"{op} p99 < 40 ms [{env}]", ok, f"{lat['p99']:.1f} ms"))
                    latency_rows.append([env, size, op, lat["calls"], _f(lat["p50"], 1), _f(lat["p99"], 1),
                                         f"<40 ms {_mark(ok)}"])
    any_res = next(iter(wire.values()))
    mb = any_res["message_bytes"]
    notes = [f"message split: client MESSAGE_BYTES={mb['client']:,}, server message_bytes={mb['server']:,}"]
    for size, s in any_res["sizes"].items():
        notes.append(f"{size}: {s['tokens']} tokens/row, Arrow {s['arrow_bytes_per_row']:,.0f} B/row, "
                     f"batch IPC {s['batch_ipc_bytes']:,} B in messages up {s['upload_messages']} "
                     f"down {s['download_messages']}")
    rounds = {env: {size: {op: s[op]["rounds"] for op in ("raw_upload", "raw_download", *(o for o, _, _ in WIRE_OPS))
                           if op in s}
                    for size, s in res["sizes"].items()} for env, res in wire.items()}
    out = [f"1-3. Throughput on the {any_res.get('table', 'benchmark')} table, batch 256, one sync client "
           "(ratio = expstore / raw grpcio ceiling, same bytes and message sizes, measured alternately in "
           "the same run; median of rounds). 'insert'/'sample': Client over gRPC (flight=False); 'x2': two "
           "calls in flight (Client.insert_future, Client.sampler(prefetch=2)); 'flight': Client over "
           "Arrow Flight (DoPut/DoGet); the raw ceiling is one call at a time",
           _table(["env", "items", "B/row", "op", "raw MB/s", "raw items/s", "expstore MB/s",
                   "expstore items/s", "ratio", "target"], rows, align_left=2),
           *("   " + n for n in notes),
           "   batches/s per round: " + json.dumps(rounds),
           "", "3a. The Arrow Flight rows against the raw Arrow Flight ceiling (a trivial pyarrow.flight "
           "server: DoPut drops the table, DoGet streams a prebuilt one), same run",
           _table(["env", "items", "op", "ceiling", "raw Flight items/s", "expstore items/s", "ratio",
                   "raw Flight / raw grpcio"], flight_rows, align_left=4),
           "", "3b. Sample latency, batch 256 x ~36 KiB",
           _table(["env", "items", "op", "calls", "p50 ms", "p99 ms", "target"], latency_rows, align_left=3),
           "", "3c. Stream delivery (a fresh consumer group; 'auto-ack': each batch acked by the Stream call "
           "that fetches the next, else an Ack call a batch) against sample on the same path, same run",
           _table(["env", "items", "op", "against", "sample items/s", "stream items/s", "ratio", "target"],
                  stream_rows, align_left=4)]
    envs = list(wire)
    if len(envs) == 2:
        a, b = envs
        cmp_rows = []
        for size in wire[a]["sizes"]:
            for op in ("raw_upload", "insert", "raw_download", "sample"):
                x, y = wire[a]["sizes"][size][op]["MB_per_s"], wire[b]["sizes"][size][op]["MB_per_s"]
                cmp_rows.append([size, op, _f(x), _f(y), f"{y / x:.2f}x"])
        out += ["", f"3d. glibc malloc env vs default (MB/s; {b} / {a})",
                _table(["items", "op", f"{a}", f"{b}", "ratio"], cmp_rows, align_left=2)]
    return "\n".join(out)


def engine_section(engine: dict, checks: list) -> str:
    rows = []
    for n, e in engine.items():
        s = e["sampler_sample"]
        kinds = e.get("kinds") or {"memory table": e}
        for kind, k in kinds.items():
            t, u = k["table_sample"], k["table_update_priorities"]
            target = ""
            if int(n) == 10_000_000:
                ok = t["p50_us"] < TARGETS["engine_10m_us"]
                target = f"p50 <1 ms {_mark(ok)}"
                checks.append((f"prioritized 256 from 10M < 1 ms in-engine (Table.sample p50, {kind})", ok,
                               f"{t['p50_us']:.0f} us (p99 {t['p99_us']:.0f} us)"))
            rows.append([f"{int(n):,}", kind, _f(t["p50_us"]), _f(t["p99_us"]), _f(s["p50_us"]), _f(s["p99_us"]),
                         _f(u["p50_us"]), _f(u["p99_us"]), f"{k['table_build_s']:.1f}", t["calls"], target])
    return "\n".join([
        "4. Engine only (in process): prioritized (alpha 0.6, beta 0.4) sample of 256, microseconds",
        _table(["items", "table kind", "Table.sample p50", "p99", "Prioritized.sample p50", "p99",
                "update_priorities(256) p50", "p99", "build s", "calls", "target"], rows, align_left=2),
        "   Table: generic table, one int64 column, built by Table.insert of 1M-row batches (durable: each "
        "sample journals a 'sampled' record at wal); Prioritized: the sampler alone (sum tree)"])


def memory_section(memory: dict[str, dict], checks: list) -> str:
    rows = []
    mb = 1e6
    for env, runs in memory.items():
        for kind, m in (runs.get("kinds") or {"memory table": runs}).items():
            ratio = m["growth_per_arrow_byte"]
            if kind == "memory table":
                ok = ratio <= TARGETS["rss_ratio"]
                target = f"<=1.1x {_mark(ok)}"
                checks.append((f"server RSS growth <= 1.1x payload, memory table [{env}]", ok, f"{ratio:.2f}x"))
            else:  # bounded by its cache (here: above the payload) as a memory table, and RocksDB's budget
                bound = TARGETS["rss_ratio"] * m["arrow_nbytes"] + runs["rocksdb_bytes"]
                ok = m["rss_growth"] <= bound
                target = f"<=1.1x + RocksDB {runs['rocksdb_bytes'] / mb:.0f} MB {_mark(ok)}"
                checks.append((f"server RSS growth <= 1.1x payload + RocksDB budget, durable table [{env}]", ok,
                               f"{m['rss_growth'] / mb:.0f} MB of {bound / mb:.0f} MB"))
            rows.append([env, kind, f"{m['items']:,}", _f(m["arrow_nbytes"] / mb), _f(m["memory_bytes_stat"] / mb),
                         _f(m["rss_idle"] / mb), _f(m["rss_after"] / mb), _f(m["rss_peak"] / mb),
                         _f(m["rss_growth"] / mb), _f((m["rss_growth"] - m["arrow_nbytes"]) / mb), f"{ratio:.2f}x",
                         f"{m['growth_per_stat_byte']:.2f}x", target])
    return "\n".join([
        "5. Server memory after inserting ~36 KiB items (MB = 1e6 bytes; growth = RSS after - idle RSS; overhead = growth - Arrow)",
        _table(["env", "table kind", "items", "Arrow MB", "stat memory_bytes MB", "idle RSS", "RSS after", "peak RSS",
                "growth", "overhead", "growth/Arrow", "growth/stat", "target"], rows, align_left=2)])


def _rpcs(c: dict) -> str:
    """The Insert calls a run's producers made, where recorded."""
    return f"{c['rpcs']:,} RPCs; " if "rpcs" in c else ""


def concurrency_section(c: dict, checks: list) -> str:
    ok = c["errors"] == 0 and c["stored_items"] == c["expected_items"]
    checks.append((f"{c['producers']:,} concurrent producers, 0 errors", ok,
                   f"{c['errors']} errors, {c['stored_items']:,}/{c['expected_items']:,} rows stored"))
    lat, raw = c["latency_ms"], c["raw"]
    row = ["expstore", c["producers"], c["channels"], f"{c['calls_per_producer']} x {c['rows_per_call']}",
           _f(c["arrow_bytes_per_row"]), f"{c['wall_s']:.1f}", _f(c["items_per_s"]), _f(c["calls_per_s"]),
           _f(lat["p50"], 1), _f(lat["p99"], 1), c["errors"], f"{c['stored_items']:,}",
           f"{_rpcs(c)}0 errors {_mark(ok)}"]
    raw_row = ["raw gRPC", c["producers"], c["channels"], f"{c['calls_per_producer']} x {raw['message_bytes']:,} B",
               "", f"{raw['wall_s']:.1f}", _f(raw["items_per_s"]), _f(raw["calls_per_s"]), _f(raw["latency_ms"]["p50"], 1),
               _f(raw["latency_ms"]["p99"], 1), raw["errors"], "", f"ratio {c['calls_per_s'] / raw['calls_per_s']:.0%}"]
    rows = [row, raw_row]
    b = c.get("batched")
    if b:
        ok_b = b["errors"] == 0 and b["stored_items"] == b["expected_items"]
        checks.append((f"{c['producers']:,} concurrent producers through InsertBatcher, 0 errors", ok_b,
                       f"{b['errors']} errors, {b['stored_items']:,}/{b['expected_items']:,} rows stored"))
        rows.insert(1, ["expstore batched", c["producers"], c["channels"],
                        f"{c['calls_per_producer']} x {c['rows_per_call']}", _f(c["arrow_bytes_per_row"]),
                        f"{b['wall_s']:.1f}", _f(b["items_per_s"]), _f(b["calls_per_s"]),
                        _f(b["latency_ms"]["p50"], 1), _f(b["latency_ms"]["p99"], 1), b["errors"],
                        f"{b['stored_items']:,}", f"{b['rpcs']:,} RPCs; ratio {b['calls_per_s'] / raw['calls_per_s']:.0%}"])
    ten = c.get("10k")
    if ten:
        lat10, raw10 = ten["latency_ms"], ten["raw"]
        ratio = ten["calls_per_s"] / raw10["calls_per_s"]
        ok10 = ten["errors"] == 0 and ten["stored_items"] == ten["expected_items"]
        checks.append((f"{ten['producers']:,} concurrent producers, 0 errors", ok10,
                       f"{ten['errors']} errors, {ten['stored_items']:,}/{ten['expected_items']:,} rows stored"))
        checks.append((f"{ten['producers']:,} producers >= 50% of raw calls/s", ratio >= 0.5, f"{ratio:.0%}"))
        rows += [["expstore", ten["producers"], ten["channels"], f"{ten['calls_per_producer']} x {ten['rows_per_call']}",
                  _f(ten["arrow_bytes_per_row"]), f"{ten['wall_s']:.1f}", _f(ten["items_per_s"]),
                  _f(ten["calls_per_s"]), _f(lat10["p50"], 1), _f(lat10["p99"], 1), ten["errors"],
                  f"{ten['stored_items']:,}", f"{_rpcs(ten)}0 errors {_mark(ok10)}"],
                 ["raw gRPC", ten["producers"], ten["channels"],
                  f"{ten['calls_per_producer']} x {raw10['message_bytes']:,} B", "", f"{raw10['wall_s']:.1f}",
                  _f(raw10["items_per_s"]), _f(raw10["calls_per_s"]), _f(raw10["latency_ms"]["p50"], 1),
                  _f(raw10["latency_ms"]["p99"], 1), raw10["errors"], "", f"ratio {ratio:.0%}"]]
        stream = ten.get("raw_stream")
        if stream:  # informational: the call shape of Insert, which gRPC moves with more work
            rows.append(["raw gRPC streaming", ten["producers"], ten["channels"],
                         f"{ten['calls_per_producer']} x {stream['message_bytes']:,} B", "", f"{stream['wall_s']:.1f}",
                         _f(stream["items_per_s"]), _f(stream["calls_per_s"]), _f(stream["latency_ms"]["p50"], 1),
                         _f(stream["latency_ms"]["p99"], 1), stream["errors"], "",
                         f"ratio {ten['calls_per_s'] / stream['calls_per_s']:.0%}"])
    paced = c.get("10k_paced")
    if paced:
        lat_p, raw_p = paced["latency_ms"], paced["raw"]
        ok_p = paced["errors"] == 0 and paced["stored_items"] == paced["expected_items"]
        checks.append((f"{paced['producers']:,} paced producers, 0 errors", ok_p,
                       f"{paced['errors']} errors, {paced['stored_items']:,}/{paced['expected_items']:,} rows stored"))
        checks.append((f"{paced['producers']:,} producers offering 50% of raw calls/s: p99 < 1 s",
                       lat_p["p99"] < 1000, f"{lat_p['p99']:,.0f} ms (raw {raw_p['latency_ms']['p99']:,.0f} ms)"))
        shape = f"1 x {paced['rows_per_call']} over {paced['spread_s']:.1f} s"
        rows += [["expstore paced", paced["producers"], paced["channels"], shape, _f(paced["arrow_bytes_per_row"]),
                  f"{paced['wall_s']:.1f}", _f(paced["items_per_s"]), _f(paced["calls_per_s"]), _f(lat_p["p50"], 1),
                  _f(lat_p["p99"], 1), paced["errors"], f"{paced['stored_items']:,}",
                  f"{_rpcs(paced)}p99 < 1 s {_mark(lat_p['p99'] < 1000)}"],
                 ["raw gRPC paced", paced["producers"], paced["channels"], shape, "", f"{raw_p['wall_s']:.1f}",
                  _f(raw_p["items_per_s"]), _f(raw_p["calls_per_s"]), _f(raw_p["latency_ms"]["p50"], 1),
                  _f(raw_p["latency_ms"]["p99"], 1), raw_p["errors"], "",
                  f"offered {paced['offered_calls_per_s']:,.0f} calls/s"]]
    out = ["6. Concurrent producers: asyncio tasks over AsyncClient channels, one event loop; the DEFAULT durable "
           "table (ssd tier, wal); 10,000 producers on a fresh server",
           _table(["server", "producers", "channels", "calls x rows", "B/row", "wall s", "items/s", "calls/s",
                   "p50 ms", "p99 ms", "errors", "stored", "target"], rows, align_left=1),
           "   expstore: the default AsyncClient, which sends the inserts tasks make while 4 of the table's "
           "are on the wire as one call, each still answered as its own (docs/rpc.md#merged-inserts); calls/s counts "
           "producer inserts, RPCs the Insert calls the server got",
           "   batched: each channel's producers share an InsertBatcher (5 ms linger); calls/s counts producer inserts",
           "   raw gRPC: the same producers, each call one unary Put of the batch's IPC size, as the client sends "
           "an insert of one message (InsertUnary): the ceiling",
           "   raw gRPC streaming: the 10,000 as client-streaming calls of that one message (Insert's shape, "
           "which gRPC moves with more work on both sides; the ceiling of earlier runs)",
           "   10,000 at once: every producer's insert starts together, so p99 is the time to drain the burst "
           "(producers / calls/s), for the raw server too",
           "   paced: each producer's insert at a uniformly random moment of a window that offers half the raw "
           "burst's calls/s (producers in the middle of an environment step): the latency at a load to sustain"]
    for errors in (c["error_samples"], (ten or {}).get("error_samples"), (paced or {}).get("error_samples")):
        if errors:
            out.append("   errors: " + "; ".join(errors))
    return "\n".join(out)


def render(results: dict) -> str:
    checks: list[tuple[str, bool, str]] = []
    meta = results["meta"]
    parts = [f"expstore benchmarks ({meta['mode']} run, {meta['started']}, {meta['cpus']} CPUs, "
             f"Python {meta['python']}, grpcio {meta['grpcio']}, pyarrow {meta['pyarrow']}, "
             f"numpy {meta['numpy']}; {meta['elapsed_s']:.0f} s)",
             "envs: " + "; ".join(f"{k} = {v or '(inherited)'}" for k, v in meta["envs"].items())]
    if "wire" in results:
        parts.append(wire_section(results["wire"], checks))
    if "engine" in results:
        parts.append(engine_section(results["engine"], checks))
    if "memory" in results:
        parts.append(memory_section(results["memory"], checks))
    if "concurrency" in results:
        parts.append(concurrency_section(results["concurrency"], checks))
    for name, err in results.get("failed", {}).items():
        checks.append((f"{name} ran", False, err.splitlines()[-1] if err else "failed"))
    width = max(len(c[0]) for c in checks) if checks else 0
    summary = [f"  {_mark(ok):4}  {name.ljust(width)}  {value}" for name, ok, value in checks]
    parts.append(f"Targets ({sum(ok for _, ok, _ in checks)}/{len(checks)} pass)\n" + "\n".join(summary))
    results["targets"] = [{"check": n, "pass": ok, "value": v} for n, ok, v in checks]
    return "\n\n".join(parts)


def write_json(results: dict, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(results, indent=1, sort_keys=True))
