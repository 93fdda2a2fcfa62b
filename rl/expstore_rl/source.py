"""The store as the trainer's data source: each step's batch comes in, and what the step
trained goes back as the store's record of the run.

Two modes (``TrainConfig.stream``):

- *sample* (the default): step N samples its batch with ``step=N`` (GRPO: whole groups
  from the group sampler, newest, oldest or any first: ``sample_order``), so the store
  records the step's manifest. The table lets each row be sampled once and drops it
  then, so the rows of a step lost in a crash (the trainer restarts from an earlier
  checkpoint, or a response never arrived) are not trained again: **at most once**.
  After a restart from checkpoint C, the manifests of steps C+1.. list what every
  attempt sampled.
- *stream*: a consumer group reads the table in insertion order. Step N takes the next
  ``batch_size`` rows (GRPO: the next whole groups; rows of a group still incomplete
  wait, in flight, for a later step) and, once trained, commits them with the training
  cut N (acked and recorded as step N's manifest, in one write). A fresh run commits cut
  0 before its first read and checkpoints step 0; a run restarting from its step-C
  checkpoint resumes the group at cut C; a trainer whose server went away mid-step
  retries and, if a read was lost, resumes at its last cut. Every row is trained
  **exactly once**, and the manifests of steps 1..N list each row once, whichever of
  trainer and server was killed.

Rows with ``finish_reason = "aborted"`` (partial rollouts a producer will continue) are
never trained unless ``train_aborted``; in stream mode they, and rows that went stale
while they waited in flight (``max_staleness``, as the store drops the rows it still
holds), are acked without training and are in no manifest.

A call that fails with UNAVAILABLE (a server restarting) is retried for up to
``store_retry_s`` seconds. Concurrency: one thread; only rank 0 has a client.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, TypeVar

import grpc
import numpy as np
import pyarrow as pa
from expstore_client.retry import retry_unavailable

from .batching import Rollouts, from_sample_batch
from .distributed import Dist

if TYPE_CHECKING:
    from expstore_client import SampleBatch

    from .trainer import TrainConfig

log = logging.getLogger(__name__)
T = TypeVar("T")
VISIBILITY_S = 3600.0
"""Visibility timeout of streamed rows: rows wait in flight across steps (a group still
incomplete); a crashed trainer gets them back by resuming, not by the timeout."""
TOKENIZER = "expstore_rl.tokenizer:CharTokenizer"  # the table metadata that tells the console how to decode tokens
RECONNECT = [("grpc.initial_reconnect_backoff_ms", 100), ("grpc.max_reconnect_backoff_ms", 1000)]
"""A restarted server is found again within a second (gRPC's default backoff grows to 120 s)."""


@dataclass
class Sampled:
    rollouts: Rollouts
    seconds: float  # waiting for and decoding the batch
    commit: Callable[[], Any] | None = None  # stream: commits the step's cut once trained


class StoreSource:
    """Batches of ``batch_size`` rows from ``cfg.table`` (see the module docstring);
    ``group_size``: a stream takes whole groups of that size."""

    def __init__(self, cfg: TrainConfig, d: Dist, batch_size: int, group_size: int | None = None) -> None:
        from expstore_client import connect, names_shards

        if cfg.stream and cfg.samples_per_insert > 0:
            raise ValueError("--stream needs --samples-per-insert 0: streams bypass the rate limiter, "
                             "which would then hold the producers back for good")
        self.cfg, self.d, self.batch_size, self.group_size = cfg, d, batch_size, group_size
        self.stream, self.group = cfg.stream, cfg.stream_group
        options = {} if names_shards(cfg.target) else {"channel_options": RECONNECT}
        self.client = connect(cfg.target, cfg.token or None, timeout=cfg.sample_timeout, **options) \
            if d.main else None
        self.version = 0
        self._reader = None  # the stream's iterator
        self._pending: SampleBatch | None = None  # streamed rows not trained yet, in delivery order
        self._dropped: list[int] = []  # streamed rows acked without training at the next commit
        self._cut = 0  # the last cut committed or resumed

    # -- the trainer's calls ------------------------------------------------------------

    def start(self, step: int, resumed: bool) -> None:
        """Stream: resume the consumer group at cut ``step`` (the checkpoint the trainer
        restored), or, for a fresh run, commit cut 0 where the group stands."""
        if not (self.stream and self.d.main):
            return
        if resumed:
            try:
                self._retry("resume", lambda: self.client.resume(self.cfg.table, self.group, step))
            except grpc.RpcError as e:
                if e.code() != grpc.StatusCode.NOT_FOUND:
                    raise
                log.warning("table %r: consumer group %r has no cut at step %d (%s); continuing where the "
                            "group stands: rows trained since that checkpoint are not trained again",
                            self.cfg.table, self.group, step, e.details())
                self._commit(step, [])
        else:
            self._commit(step, [])
        self._cut = step

    def next(self, step: int) -> Sampled:
        """The batch of training step ``step``, the same on every rank."""
        out = None
        if self.d.main:
            t0 = time.perf_counter()
            batch, commit = self._streamed(step) if self.stream else (self._sampled(step), None)
            out = Sampled(from_sample_batch(batch), time.perf_counter() - t0, commit)
        got = self.d.broadcast(None if out is None else (out.rollouts, out.seconds))
        return out if self.d.main else Sampled(*got)

    def set_policy_version(self, version: int) -> None:
        self.version = version
        if self.d.main:
            self._retry("set_policy_version", lambda: self.client.set_policy_version(self.cfg.table, version))

    # -- sample mode --------------------------------------------------------------------

    def _sampled(self, step: int) -> SampleBatch:
        while True:
            batch = self._retry("sample", lambda: self.client.sample(
                self.cfg.table, self.batch_size, timeout=self.cfg.sample_timeout, step=step))
            keep = np.flatnonzero(~self._aborted(batch))
            if len(keep):
                return take(batch, keep)

    # -- stream mode --------------------------------------------------------------------

    def _streamed(self, step: int) -> tuple[SampleBatch, Callable[[], None]]:
        while True:
            while (index := self._ready()) is None:
                self._read()
            batch = take(self._pending, index)
            self._pending = take(self._pending, np.setdiff1d(np.arange(len(self._pending)), index))
            aborted = self._aborted(batch)
            self._dropped += batch.ids[aborted].tolist()
            if not aborted.all():
                batch = take(batch, np.flatnonzero(~aborted))
                ids = batch.ids.copy()
                return batch, lambda: self._commit(step, ids)

    def _ready(self) -> np.ndarray | None:
        """Indices into the pending rows of the next step's batch, or None if they are
        not there yet. Rows that went stale while pending are dropped first."""
        p = self._pending
        if p is None or not len(p):
            return None
        stale = p.policy_versions < self.version - self.cfg.max_staleness
        if stale.any():
            self._dropped += p.ids[stale].tolist()
            p = self._pending = take(p, np.flatnonzero(~stale))
        if self.group_size is None:
            return np.arange(self.batch_size) if len(p) >= self.batch_size else None
        groups = [g if g is not None else f"\0{i}" for g, i in zip(p.column("group_id").to_pylist(), p.ids)]
        _, first, inverse, counts = np.unique(np.array(groups, dtype=object), return_index=True,
                                              return_inverse=True, return_counts=True)
        complete = np.flatnonzero(counts >= self.group_size)
        need = self.batch_size // self.group_size
        if len(complete) < need:
            return None
        chosen = complete[np.argsort(first[complete], kind="stable")][:need]  # the first to arrive
        rank = np.full(len(counts), len(counts))
        rank[chosen] = np.arange(need)
        rows = np.flatnonzero(rank[inverse] < need)
        return rows[np.argsort(rank[inverse][rows], kind="stable")]  # members together, in arrival order

    def _read(self) -> None:
        """One stream read into the pending rows. After a read lost to an unavailable
        server (the store may have delivered it), the group is resumed at the last cut."""
        if self._reader is None:
            self._reader = self.client.stream(self.cfg.table, self.group, self.batch_size,
                                              idle_timeout=self.cfg.sample_timeout, visibility_timeout=VISIBILITY_S)
        try:
            batch = next(self._reader)
        except StopIteration:
            raise TimeoutError(f"table {self.cfg.table!r}: consumer group {self.group!r} got no rows in "
                               f"{self.cfg.sample_timeout} s") from None
        except grpc.RpcError as e:
            self._reader = None
            if e.code() != grpc.StatusCode.UNAVAILABLE:
                raise
            log.warning("table %r: stream read failed (%s); resuming at cut %d", self.cfg.table, e.code(), self._cut)
            self._retry("resume", lambda: self.client.resume(self.cfg.table, self.group, self._cut))
            self._pending, self._dropped = None, []
            return
        if self._pending is not None:  # a redelivery of a row already pending (never expected)
            batch = take(batch, np.flatnonzero(~np.isin(batch.ids, self._pending.ids)))
        self._pending = batch if self._pending is None else concat(self._pending, batch)

    def _commit(self, step: int, ids) -> None:
        """Cut ``step``: ack the dropped rows, then commit the trained ones."""
        table, group = self.cfg.table, self.group
        if self._dropped:
            dropped = self._dropped
            self._retry("ack", lambda: self.client.ack(table, group, dropped))
            self._dropped = []
        self._retry("commit_cut", lambda: self.client.commit_cut(table, group, step, ids, tag=f"step_{step}"))
        self._cut = step

    # -- helpers ------------------------------------------------------------------------

    def _aborted(self, batch: SampleBatch) -> np.ndarray:
        if self.cfg.train_aborted:
            return np.zeros(len(batch), dtype=bool)
        return np.asarray(batch.column("finish_reason").to_pylist(), dtype=object) == "aborted"

    def _retry(self, what: str, call: Callable[[], T]) -> T:
        """``call()``, retried while the store answers UNAVAILABLE, up to store_retry_s."""
        return retry_unavailable(call, self.cfg.store_retry_s, lambda e: log.warning(
            "table %r: %s: the store is unavailable; retrying", self.cfg.table, what))


def take(batch: SampleBatch, index: np.ndarray) -> SampleBatch:
    """Rows ``index`` of a batch (stream batches: no probabilities or weights)."""
    from expstore_client import SampleBatch

    index = np.asarray(index, dtype=np.int64)
    pick = (lambda a: None if a is None else a[index])
    return SampleBatch(batch.ids[index], batch.data.take(pa.array(index)), batch.priorities[index],
                       batch.times_sampled[index], batch.policy_versions[index],
                       pick(batch.probabilities), pick(batch.weights))


def concat(a: SampleBatch, b: SampleBatch) -> SampleBatch:
    from expstore_client import SampleBatch

    return SampleBatch(np.concatenate([a.ids, b.ids]), pa.concat_tables([a.data, b.data]),
                       np.concatenate([a.priorities, b.priorities]),
                       np.concatenate([a.times_sampled, b.times_sampled]),
                       np.concatenate([a.policy_versions, b.policy_versions]))


def tokenizer_spec(cfg: TrainConfig) -> str:
    """What the table's metadata names as its tokenizer (for the console): the toy
    model's CharTokenizer, or ``hf:DIR`` of ``--model`` (absolute)."""
    return f"hf:{os.path.abspath(cfg.model)}" if cfg.model else TOKENIZER


def create_table(client, cfg: TrainConfig, batch_size: int, group_size: int | None, insert_size: int = 8) -> None:
    """The rollouts table, if missing: whole groups from the group sampler for GRPO, else
    single rows; newest first, oldest first or uniform (``sample_order``); each row
    sampled once; rows older than max_staleness versions dropped. With
    samples_per_insert > 0, a rate limiter keeps producers about one batch
    ahead of the trainer (staleness stays near 1 instead of piling up at the gate): the
    window spi * batch/2 +- (batch + insert_size)/2 is the narrowest in which neither
    side can stall the other (docs/semantics.md). Streams bypass the limiter, so a
    streaming trainer needs samples_per_insert 0."""
    if cfg.sample_order not in ("lifo", "fifo", "uniform"):
        raise ValueError(f"sample_order must be 'lifo', 'fifo' or 'uniform', got {cfg.sample_order!r}")
    sampler = ({"type": "group", "group_size": group_size, "group_order": cfg.sample_order} if group_size
               else cfg.sample_order)
    limiter = None
    if cfg.samples_per_insert > 0:
        spi, insert_size = cfg.samples_per_insert, group_size or insert_size
        limiter = {"type": "sample_to_insert_ratio", "samples_per_insert": spi,
                   "min_size_to_sample": max(1, batch_size // 2),
                   "error_buffer": (batch_size + insert_size * max(1.0, spi)) / 2 + 1}
    kept = {"tiers": "remote", "archive": True} if cfg.archive else {}
    client.create_table(cfg.table, sampler=sampler, max_times_sampled=1, max_staleness=cfg.max_staleness,
                        rate_limiter=limiter, if_not_exists=True, metadata={"tokenizer": tokenizer_spec(cfg)}, **kept)
