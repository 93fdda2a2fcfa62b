"""The console's side of gRPC: a session per bearer token, with its caches.

A session wraps the CLI's ``Online`` backend (``expstore_client.connect`` with the user's
token), so the console calls the store exactly as ``expstore`` does. Sessions are keyed
by the SHA-256 of the token (a cached figure or result is never shown to another token)
and the least recently used ones are closed past ``max_sessions``.

What a session caches, to keep browsers polling from multiplying the store's work:
stats for ``STATS_TTL_S`` (several tabs polling share one Stats RPC), the last
``HISTORY`` stats snapshots (the live rates and their plot), the results of the last
``RESULTS`` SQL statements for the paged grid (at most ``GRID_ROWS`` rows and
``GRID_BYTES`` bytes each), and the reward-hacking views for ``VIEWS_TTL_S`` (computed
once for all the tabs that ask at the same time).
"""

from __future__ import annotations

import hashlib
import threading
import time
import uuid
from collections import OrderedDict, deque
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any, Callable

import pyarrow as pa

from .. import cli, watch

STATS_TTL_S = 1.0
HISTORY = 300          # stats snapshots kept (10 minutes at the pages' 2 s)
MIN_RATE_SPAN_S = 0.5  # rates are computed against a snapshot at least this old
RESULTS = 4
GRID_ROWS = 10_000
GRID_BYTES = 64 << 20
VIEWS_TTL_S = 20.0
VIEWS = 64  # cached views kept per session


@dataclass
class QueryResult:
    """A statement's first GRID_ROWS rows, kept for paging."""

    id: str
    sql: str
    table: pa.Table
    truncated: bool  # more rows exist than were kept


class Session:
    """One token's view of the store. Thread-safe."""

    def __init__(self, backend: cli.Online) -> None:
        self.backend = backend
        self._lock = threading.Lock()
        self._stats: deque[tuple[float, dict]] = deque(maxlen=HISTORY)
        self._results: OrderedDict[str, QueryResult] = OrderedDict()
        self._views: dict[Any, tuple[float, Any]] = {}
        self._flights: dict[Any, threading.Lock] = {}

    @property
    def client(self):
        return self.backend.client

    def query(self, sql: str, max_rows: int = 0) -> pa.RecordBatchReader:
        return self.backend.query(sql, max_rows)

    def query_rows(self, sql: str, max_rows: int = 0) -> list[dict]:
        return self.backend.query(sql, max_rows).read_all().to_pylist()

    # -- stats ----------------------------------------------------------------------------

    def stats(self, now: Callable[[], float] = time.monotonic) -> tuple[dict, tuple[dict, float] | None, list]:
        """(the current stats of every table, (earlier stats, seconds between) or None,
        the history as [(time, stats)]), with one Stats RPC per STATS_TTL_S at most."""
        with self._lock:
            fresh = self._stats and now() - self._stats[-1][0] < STATS_TTL_S
        if not fresh:
            stats = self.backend.stats(None)
            with self._lock:
                self._stats.append((now(), stats))
        with self._lock:
            history = list(self._stats)
        t, current = history[-1]
        before = next(((s, t - t0) for t0, s in reversed(history[:-1]) if t - t0 >= MIN_RATE_SPAN_S), None)
        return current, before, history

    def tables(self) -> list[dict]:
        """Every table: its config, columns, size and the figures of ``stats --watch``."""
        infos = self.client.list_tables()
        current, before, history = self.stats()
        out = []
        for info in sorted(infos, key=lambda i: i.name):
            s = current.get(info.name)
            prev = None if before is None or info.name not in before[0] else (before[0][info.name], before[1])
            out.append({"name": info.name, "config": info.config, "num_items": info.num_items,
                        "policy_version": info.policy_version,
                        "columns": [{"name": f.name, "type": str(f.type)} for f in info.schema],
                        "figures": watch.figures(s, prev) if s is not None else None,
                        "rates": _rate_history(info.name, history)})
        return out

    # -- SQL ------------------------------------------------------------------------------

    def run_query(self, sql: str) -> QueryResult:
        """Run ``sql`` and keep its first GRID_ROWS rows (and GRID_BYTES) for paging."""
        reader = self.backend.query(sql, GRID_ROWS + 1)
        batches, rows, nbytes, truncated = [], 0, 0, False
        for batch in reader:
            if rows + batch.num_rows > GRID_ROWS or nbytes + batch.nbytes > GRID_BYTES:
                keep = min(GRID_ROWS - rows, batch.num_rows)
                while keep > 0 and nbytes + batch.slice(0, keep).nbytes > GRID_BYTES:
                    keep //= 2
                batches.append(batch.slice(0, keep))
                truncated = True
                break
            batches.append(batch)
            rows, nbytes = rows + batch.num_rows, nbytes + batch.nbytes
        result = QueryResult(uuid.uuid4().hex[:16], sql, pa.Table.from_batches(batches, reader.schema), truncated)
        with self._lock:
            self._results[result.id] = result
            while len(self._results) > RESULTS:
                self._results.popitem(last=False)
        return result

    def result(self, result_id: str) -> QueryResult | None:
        with self._lock:
            return self._results.get(result_id)

    def stream(self, sql: str) -> pa.RecordBatchReader:
        """Every row of ``sql``, batch by batch (downloads: no GRID_ROWS bound)."""
        return self.backend.query(sql, 0)

    # -- cached views ---------------------------------------------------------------------

    def cached(self, key: Any, compute: Callable[[], Any], ttl: float = VIEWS_TTL_S) -> Any:
        """``compute()``, or its result from less than ``ttl`` seconds ago. Concurrent
        callers of one key wait for the one computing it (one query for many tabs)."""
        with self._lock:
            flight = self._flights.setdefault(key, threading.Lock())
        with flight:
            with self._lock:
                hit = self._views.get(key)
            if hit is not None and time.monotonic() - hit[0] < ttl:
                return hit[1]
            value = compute()
            with self._lock:
                self._views[key] = (time.monotonic(), value)
                while len(self._views) > VIEWS:
                    old = next(iter(self._views))
                    del self._views[old]
                    self._flights.pop(old, None)
            return value

    def close(self) -> None:
        self.backend.close()


def _rate_history(table: str, history: list[tuple[float, dict]]) -> dict[str, list]:
    """Rates of ``table`` between consecutive snapshots: {"t": seconds ago, label: rate}."""
    out: dict[str, list] = {"t": []} | {label: [] for label, _ in watch.RATES}
    if not history:
        return out
    last = history[-1][0]
    for (t0, s0), (t1, s1) in zip(history, history[1:]):
        if table not in s0 or table not in s1 or t1 - t0 < MIN_RATE_SPAN_S:
            continue
        out["t"].append(round(t1 - last, 3))
        for label, key in watch.RATES:
            out[label].append((s1[table][key] - s0[table].get(key, 0)) / (t1 - t0))
    return out


class Gateway:
    """Sessions by token, for one store (``server``: HOST:PORT)."""

    def __init__(self, server: str, *, tls_ca: str | None = None, timeout: float = 60.0,
                 max_sessions: int = 32) -> None:
        from expstore_client import names_shards

        if names_shards(server):
            raise cli.CliError(f"the console shows one server, not shards ({server}): start one per shard")
        self.server, self.tls_ca, self.timeout, self.max_sessions = server, tls_ca, timeout, max_sessions
        self._lock = threading.Lock()
        self._sessions: OrderedDict[bytes, Session] = OrderedDict()

    def session(self, token: str | None) -> Session:
        key = hashlib.sha256((token or "").encode("utf-8", "surrogateescape")).digest()
        with self._lock:
            s = self._sessions.get(key)
            if s is None:
                args = SimpleNamespace(server=self.server, token=token or None, tls_ca=self.tls_ca,
                                       timeout=self.timeout)
                s = self._sessions[key] = Session(cli.Online(args))
            self._sessions.move_to_end(key)
            evicted = []
            while len(self._sessions) > self.max_sessions:
                evicted.append(self._sessions.popitem(last=False)[1])
        for old in evicted:
            old.close()
        return s

    def close(self) -> None:
        with self._lock:
            sessions, self._sessions = list(self._sessions.values()), OrderedDict()
        for s in sessions:
            s.close()
