"""Reward audits: recompute the reward of stored trajectories and diff it with what was stored.

A reward function takes one row as a dict (the table's columns as Python values, maps as
dicts: the signature of ``expstore_rl.rewards``) and returns a ``RewardResult``-like
object (``.value``, ``.components``), a ``(value, components)`` tuple or a number. It is
named ``MODULE:FUNC`` and imported in each worker; the sha256 of its module's source is
recorded with the results, so two audits can be told apart later.

Concurrency model: the caller's thread feeds rows to a ``ProcessPoolExecutor`` (spawned
workers, at most two rows in flight per worker) and collects results. Each row runs under
a SIGALRM timer in its worker (``timeout``: recorded as ``timeout``, the worker lives on);
a worker that ignores the alarm (stuck in C) is killed by the caller after ``timeout +
grace`` and the pool restarted: rows that were in flight on it run again, so a reward
function must be pure. A function that raises is recorded as ``error`` for that row. A
worker that dies (os._exit, a crash) marks the rows it had started as ``error``.

Statuses: ok (|delta| <= tolerance), mismatch, error, timeout, unscored (no stored
reward). delta = recomputed - stored, the recomputed value first rounded to float32 (the
stored type), so storage rounding is never a mismatch.
"""

from __future__ import annotations

import concurrent.futures as cf
import hashlib
import importlib
import inspect
import json
import multiprocessing
import os
import queue as queue_mod
import signal
import sys
import time
import uuid
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

STATUSES = ("ok", "mismatch", "error", "timeout", "unscored")
RESULT_SCHEMA = pa.schema([
    ("audit_id", pa.string()), ("reward_fn", pa.string()), ("reward_digest", pa.string()),
    ("source_item_id", pa.uint64()), ("traj_id", pa.string()), ("task", pa.string()),
    ("policy_version", pa.int64()), ("finish_reason", pa.string()),
    ("stored_reward", pa.float64()), ("recomputed_reward", pa.float64()), ("delta", pa.float64()),
    ("status", pa.string()), ("error", pa.string()), ("components_match", pa.bool_()),
    ("stored_components", pa.map_(pa.string(), pa.float64())),
    ("recomputed_components", pa.map_(pa.string(), pa.float64())),
])
"""One row per audited item (``source_item_id``: its item id; ``item_id`` is server-owned
in a store's tables); the audit's id, function and digest repeat on every row so that
several audits appended to one table stay apart."""


def load_reward(spec: str) -> Callable[[dict], Any]:
    """``MODULE:FUNC`` -> the function (ValueError naming what is wrong)."""
    module_name, _, name = spec.partition(":")
    if not module_name or not name:
        raise ValueError(f"reward {spec!r}: expected MODULE:FUNC, e.g. expstore_rl.rewards:exact_match")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ValueError(f"reward {spec!r}: cannot import {module_name}: {e}") from None
    fn = getattr(module, name, None)
    if not callable(fn):
        raise ValueError(f"reward {spec!r}: {module_name} has no function {name!r}")
    return fn


def source_digest(fn: Callable) -> str:
    """sha256 of the source of the function's module (of the function alone if the
    module has none); "unavailable" for code without source."""
    try:
        module = inspect.getmodule(fn)
        source = inspect.getsource(module) if module is not None else inspect.getsource(fn)
    except (OSError, TypeError):
        return "unavailable"
    return "sha256:" + hashlib.sha256(source.encode()).hexdigest()


def normalize(result: Any) -> tuple[float, dict[str, float] | None]:
    """A reward function's return value -> (value, components or None)."""
    if hasattr(result, "value"):
        value, comps = result.value, getattr(result, "components", None)
    elif isinstance(result, tuple) and len(result) == 2:
        value, comps = result
    else:
        value, comps = result, None
    if isinstance(value, bool) or not isinstance(value, (int, float, np.number)):
        raise TypeError(f"returned {type(value).__name__}; expected a number, (value, components) or RewardResult")
    value = float(value)
    if not np.isfinite(value):
        raise ValueError(f"returned {value}; expected a finite number")
    return value, None if comps is None else {str(k): float(v) for k, v in dict(comps).items()}


def rows_of(batch: pa.RecordBatch) -> list[dict]:
    """Python rows, map columns as dicts (what reward functions take)."""
    rows = batch.to_pylist()
    maps = [f.name for f in batch.schema if pa.types.is_map(f.type)]
    for r in rows:
        for m in maps:
            if r[m] is not None:
                r[m] = dict(r[m])
    return rows


# -- workers -----------------------------------------------------------------------------

_fn: Callable | None = None
_started: Any = None
_timeout = 0.0


class _Timeout(BaseException):
    pass


def _alarm(signum, frame):
    raise _Timeout()


def _init(spec: str, started, timeout: float, path: list[str]) -> None:
    global _fn, _started, _timeout
    sys.path[:] = path
    _fn, _started, _timeout = load_reward(spec), started, timeout
    signal.signal(signal.SIGALRM, _alarm)


def _score(index: int, row: dict) -> tuple[int, str, float | None, dict | None, str | None]:
    _started.put((index, os.getpid(), time.monotonic()))
    signal.setitimer(signal.ITIMER_REAL, _timeout)
    try:
        value, comps = normalize(_fn(row))
        return index, "scored", value, comps, None
    except _Timeout:
        return index, "timeout", None, None, f"no result after {_timeout:g} s"
    except Exception as e:
        return index, "error", None, None, f"{type(e).__name__}: {e}"[:500]
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)


# -- the audit ---------------------------------------------------------------------------

@dataclass
class AuditReport:
    results: pa.Table
    reward_fn: str
    digest: str
    tolerance: float

    def counts(self) -> dict[str, int]:
        status = self.results.column("status").to_pylist()
        return {s: status.count(s) for s in STATUSES}

    @property
    def failures(self) -> int:
        """Items that did not reproduce their stored reward: mismatch, error or timeout."""
        c = self.counts()
        return c["mismatch"] + c["error"] + c["timeout"]

    def summary(self, top: int = 10, bins: int = 10) -> dict[str, Any]:
        t = self.results
        delta = t.column("delta").to_numpy(zero_copy_only=False).astype(np.float64)
        finite = delta[np.isfinite(delta)]
        absd = np.abs(finite)
        hist = []
        if len(finite):
            counts, edges = np.histogram(finite, bins=bins if absd.max() > 0 else 1)
            hist = [(float(lo), float(hi), int(k)) for lo, hi, k in zip(edges[:-1], edges[1:], counts)]
        order = np.argsort(-np.nan_to_num(np.abs(delta), nan=-1.0), kind="stable")[:top]
        offenders = [r for r in t.take(pa.array(order)).select(
            ["source_item_id", "traj_id", "stored_reward", "recomputed_reward", "delta", "status"]).to_pylist()
            if r["status"] == "mismatch"]
        errors = t.filter(pc.is_in(t.column("status"), pa.array(["error", "timeout"]))).select(
            ["source_item_id", "status", "error"]).slice(0, top).to_pylist()
        return {
            "audit_id": t.column("audit_id")[0].as_py() if t.num_rows else None,
            "reward_fn": self.reward_fn, "reward_digest": self.digest, "tolerance": self.tolerance,
            "count": t.num_rows, **self.counts(),
            "component_mismatches": int(pc.sum(pc.invert(pc.fill_null(t.column("components_match"), True))).as_py() or 0),
            "mean_abs_delta": float(absd.mean()) if len(absd) else None,
            "max_abs_delta": float(absd.max()) if len(absd) else None,
            "histogram": hist, "top_offenders": offenders, "errors": errors,
            "by": {key: self._split(key) for key in ("task", "policy_version", "finish_reason")},
        }

    def _split(self, key: str) -> list[dict]:
        t = self.results
        bad = pc.is_in(t.column("status"), pa.array(["mismatch", "error", "timeout"]))
        g = pa.table({key: t.column(key), "bad": pc.cast(bad, pa.int64()), "abs": pc.abs(t.column("delta"))})
        out = g.group_by(key).aggregate([("bad", "count"), ("bad", "sum"), ("abs", "mean")]).sort_by(key)
        return [{key: r[key], "count": r["bad_count"], "failures": r["bad_sum"], "mean_abs_delta": r["abs_mean"]}
                for r in out.to_pylist()]

    def format(self) -> str:
        """The report as text (what ``expstore audit`` prints)."""
        s = self.summary()
        lines = [f"audit {s['audit_id']}  reward {s['reward_fn']}  digest {s['reward_digest']}",
                 f"items {s['count']}: " + ", ".join(f"{k} {s[k]}" for k in STATUSES)
                 + f"; components differ {s['component_mismatches']}  (tolerance {s['tolerance']:g})"]
        if s["mean_abs_delta"] is not None:
            lines.append(f"|delta|: mean {s['mean_abs_delta']:.6g}  max {s['max_abs_delta']:.6g}")
        if s["histogram"]:
            lines.append("delta histogram:")
            peak = max(k for _, _, k in s["histogram"]) or 1
            lines += [f"  [{lo:+.4g}, {hi:+.4g}) {k:>8}  {'#' * max(k and 1, round(40 * k / peak))}"
                      for lo, hi, k in s["histogram"]]
        if s["top_offenders"]:
            lines.append("top offenders (item_id, traj_id, stored, recomputed, delta):")
            lines += [f"  {r['source_item_id']}  {r['traj_id']}  {r['stored_reward']:.6g}  {r['recomputed_reward']:.6g}  "
                      f"{r['delta']:+.6g}" for r in s["top_offenders"]]
        if s["errors"]:
            lines.append("errors and timeouts (item_id, status, error):")
            lines += [f"  {r['source_item_id']}  {r['status']}  {r['error']}" for r in s["errors"]]
        for key, rows in s["by"].items():
            lines.append(f"by {key} ({key}: items, failures, mean |delta|):")
            lines += [f"  {r[key]}: {r['count']}, {r['failures']}, "
                      f"{'-' if r['mean_abs_delta'] is None else format(r['mean_abs_delta'], '.4g')}" for r in rows]
        return "\n".join(lines)

    def write_parquet(self, path: str) -> None:
        meta = {"expstore.audit": json.dumps({"reward_fn": self.reward_fn, "reward_digest": self.digest,
                                              "tolerance": self.tolerance})}
        import pyarrow.parquet as pq
        pq.write_table(self.results.replace_schema_metadata(meta), path)


def audit(batches: Iterable[pa.RecordBatch], reward: str, *, tolerance: float = 1e-6,
          workers: int | None = None, timeout: float = 30.0, grace: float = 5.0,
          total: int | None = None, progress: bool | None = None) -> AuditReport:
    """Recompute ``reward`` (MODULE:FUNC) for every row of ``batches`` (trajectory rows
    with their ``item_id``) and compare. ``progress``: a bar on stderr (None: if it is a
    terminal)."""
    digest = source_digest(load_reward(reward))  # fails here, before any worker starts
    workers = workers or min(os.cpu_count() or 1, 8)
    rows = _numbered(batches)
    facts: dict[int, dict] = {}
    outcome: dict[int, tuple] = {}
    bar = _Progress(total, sys.stderr.isatty() if progress is None else progress)
    ctx = multiprocessing.get_context("spawn")
    started = ctx.Queue()
    pending: deque = deque()

    def pool():
        return cf.ProcessPoolExecutor(workers, mp_context=ctx, initializer=_init,
                                      initargs=(reward, started, timeout, list(sys.path)))

    def record(i: int, result: tuple) -> None:
        outcome[i] = result
        facts[i].pop("row", None)
        bar.step()

    executor = pool()
    inflight: dict[cf.Future, int] = {}
    running: dict[int, tuple[int, float]] = {}
    exhausted = False
    try:
        while True:
            while not exhausted and len(pending) < 4 * workers:
                nxt = next(rows, None)
                if nxt is None:
                    exhausted = True
                    break
                facts[nxt[0]] = _facts(nxt[1])
                pending.append(nxt)
            while pending and len(inflight) < 2 * workers:
                index, row = pending.popleft()
                inflight[executor.submit(_score, index, row)] = index
            if not inflight:
                break
            done, _ = cf.wait(inflight, timeout=0.05, return_when=cf.FIRST_COMPLETED)
            _drain(started, running)
            broken = False
            for f in done:
                index = inflight.pop(f)
                try:
                    result = f.result()
                except cf.process.BrokenProcessPool:
                    broken = True
                    inflight[f] = index  # handled with the rest below
                    continue
                record(index, result[1:])
                running.pop(index, None)
            now = time.monotonic()
            hung = [i for i, (pid, t) in running.items() if i not in outcome and now - t > timeout + grace]
            for i in hung:
                record(i, ("timeout", None, None, f"no result after {timeout + grace:g} s; worker killed"))
            if hung or broken:
                for i in (i for i in inflight.values() if i not in outcome):
                    if broken and not hung and i in running:
                        record(i, ("error", None, None, "the worker process died"))
                    else:
                        pending.appendleft((i, facts[i]["row"]))
                _kill(executor)
                _drain(started, {})  # start stamps of the killed pool are void
                executor, inflight, running = pool(), {}, {}
    finally:
        _kill(executor)
        bar.close()
    return AuditReport(_results(facts, outcome, reward, digest, tolerance), reward, digest, tolerance)


def _numbered(batches: Iterable[pa.RecordBatch]) -> Iterator[tuple[int, dict]]:
    i = 0
    for batch in batches:
        for row in rows_of(batch):
            yield i, row
            i += 1


def _facts(row: dict) -> dict:
    return {"row": row, **{k: row.get(k) for k in ("item_id", "traj_id", "task", "policy_version", "finish_reason",
                                                    "reward", "reward_components")}}


def _drain(started, running: dict) -> None:
    while True:
        try:
            index, pid, t = started.get_nowait()
        except queue_mod.Empty:
            return
        running[index] = (pid, t)


def _kill(executor: cf.ProcessPoolExecutor) -> None:
    """Stop a pool now, hung workers included."""
    processes = list((executor._processes or {}).values())
    executor.shutdown(wait=False, cancel_futures=True)
    for p in processes:
        p.kill()
    for p in processes:
        p.join()


def _results(facts: dict, outcome: dict, reward: str, digest: str, tolerance: float) -> pa.Table:
    audit_id = uuid.uuid4().hex[:12]
    cols: dict[str, list] = {name: [] for name in RESULT_SCHEMA.names}
    for i in sorted(facts):
        f = facts[i]
        kind, value, comps, error = outcome[i]
        stored = f["reward"]
        delta, match, status = None, None, kind
        if kind == "scored":
            if stored is None:
                status = "unscored"
            else:
                delta = float(np.float32(value)) - float(stored)
                status = "ok" if abs(delta) <= tolerance else "mismatch"
            sc = f["reward_components"]
            if sc is not None and comps is not None:
                match = set(sc) == set(comps) and all(
                    abs(float(np.float32(comps[k])) - sc[k]) <= tolerance for k in sc)
        row = dict(audit_id=audit_id, reward_fn=reward, reward_digest=digest, source_item_id=f["item_id"],
                   traj_id=f["traj_id"], task=f["task"], policy_version=f["policy_version"],
                   finish_reason=f["finish_reason"], stored_reward=stored, recomputed_reward=value, delta=delta,
                   status=status, error=error, components_match=match,
                   stored_components=None if f["reward_components"] is None else list(f["reward_components"].items()),
                   recomputed_components=None if comps is None else list(comps.items()))
        for k, v in row.items():
            cols[k].append(v)
    return pa.table(cols, schema=RESULT_SCHEMA)


class _Progress:
    """A plain progress bar on stderr, redrawn at most ten times a second."""

    def __init__(self, total: int | None, enabled: bool) -> None:
        self.total, self.enabled, self.done = total, enabled, 0
        self.t0 = self.last = time.monotonic()

    def step(self) -> None:
        self.done += 1
        now = time.monotonic()
        if self.enabled and (now - self.last >= 0.1 or self.done == self.total):
            self.last = now
            rate = self.done / max(now - self.t0, 1e-9)
            if self.total:
                filled = int(30 * self.done / self.total)
                head = f"[{'=' * filled}{' ' * (30 - filled)}] {self.done}/{self.total}"
            else:
                head = f"{self.done}"
            sys.stderr.write(f"\raudit {head}  {rate:.0f} rows/s")
            sys.stderr.flush()

    def close(self) -> None:
        if self.enabled and self.done:
            sys.stderr.write("\n")
