"""What a table accepts from a call, checked before its lock is taken: rows conformed to
its schema and validated (trajectory rules, routed experts, ingest checks within the
rows, keys, group sizes), priorities, item ids, durability, and a sample's size and data
version ranges.

Every refusal is InvalidArgument (or FailedPrecondition) naming the table, and the row
and column of the first problem; nothing is applied then. ``Intake.prepare`` returns a
``PreparedInsert``, which the table completes (references of the ingest checks across
inserts, the chunks it writes) and commits or abandons.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from . import group_timeouts, ingest_checks, pacing, routed
from . import schema as protocol
from .errors import FailedPrecondition, InvalidArgument
from .ingest_checks import Checks, References
from .pacing import Pacing
from .placement import Staged
from .spec import TableSpec

DURABILITIES = ("memory", "wal", "fsync")


@dataclass
class PreparedInsert:
    """Validated rows ready to commit: built outside the lock by ``Table.prepare_insert``.
    Not frozen: ``references`` and ``staged`` are filled as the table checks the rows
    against stored ones and writes their chunks, and ``staged`` is emptied once the insert
    is committed (the chunks are the table's) or abandoned (they are deleted)."""

    batches: list[pa.RecordBatch]
    keys: list[str] | None
    priorities: np.ndarray
    policy_versions: np.ndarray
    groups: pa.ChunkedArray | None  # group_id strings, for the group codebook
    group_sizes: np.ndarray
    tasks: pa.ChunkedArray | None
    rewards: np.ndarray
    durability: str = "memory"
    staged: list[Staged] = field(default_factory=list)  # one chunk per batch, until committed
    episodes: np.ndarray | None = None  # int64 episode hashes (ingest_checks.episode_hashes)
    data_versions: np.ndarray | None = None  # int64, the rows' data_version column
    references: References | None = None  # what the ingest checks compared the rows with
    reservations: np.ndarray | None = None  # uint64, the rows' reservation_id (pacing)

    @property
    def num_rows(self) -> int:
        return len(self.priorities)

    @property
    def nbytes(self) -> int:
        """What the rows cost the memory tier if all are stored."""
        return sum(b.get_total_buffer_size() for b in self.batches)

    def chunks(self, store: np.ndarray, *, keep_dead_rows: bool) -> tuple[list[tuple[int, int, Staged]], list[int]]:
        """The staged chunks to keep, as (first row, end row, chunk), and the ids of those
        none of whose rows is stored (``store``: bool per row). Each prepared batch is one
        chunk; rows not stored (duplicates, stale) are dead in it from the start, unless a
        volatile table drops them first (``keep_dead_rows`` false: its bytes are the budget)."""
        offsets = np.cumsum([0] + [b.num_rows for b in self.batches])
        chunks: list[tuple[int, int, Staged]] = []
        unused: list[int] = []
        for s, lo, hi in zip(self.staged, offsets[:-1].tolist(), offsets[1:].tolist()):
            keep = store[lo:hi]
            if not keep.any():
                unused.append(s.chunk_id)
            elif keep.all() or keep_dead_rows:
                chunks.append((lo, hi, s))
            else:
                chunks.append((lo, hi, Staged(s.chunk_id, s.batch.filter(pa.array(keep)))))
        return chunks, unused


def rows_in_chunks(chunks: list[tuple[int, int, Staged]], store: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(chunk, row within it) of each row of an insert that is stored (-1: not stored),
    for the index, given the chunks ``PreparedInsert.chunks`` kept."""
    chunk_of_row = np.full(len(store), -1, dtype=np.int64)
    row_in_chunk = np.zeros(len(store), dtype=np.int64)
    for lo, hi, s in chunks:
        keep = store[lo:hi]
        chunk_of_row[lo:hi][keep] = s.chunk_id
        row_in_chunk[lo:hi][keep] = np.flatnonzero(keep) if s.batch.num_rows == hi - lo \
            else np.arange(int(keep.sum()))
    return chunk_of_row, row_in_chunk


class Intake:
    """The checks of one table (its resolved spec and schema). ``server_filled``: the
    table fills ``group_released_partial`` on reads (group timeouts), so inserts may not."""

    def __init__(self, spec: TableSpec, schema: pa.Schema, checks: Checks | None, *,
                 durable: bool, server_filled: bool, versioned: bool, pace: Pacing | None = None,
                 group_size: int | None = None) -> None:
        self.spec, self.schema, self.checks, self.pace = spec, schema, checks, pace
        self.name = spec.name
        self._trajectory = spec.kind == "trajectory"
        self._durable, self._server_filled, self._versioned = durable, server_filled, versioned
        self._group_size = group_size  # the sampler's, when it samples whole groups

    def prepare(self, data: Sequence[pa.RecordBatch | pa.Table] | pa.RecordBatch | pa.Table,
                priorities, durability: str | None) -> tuple[PreparedInsert, pa.Table]:
        """The rows of an insert conformed and validated, and the whole of them as one table."""
        durability = self.durability(durability)
        parts = [data] if isinstance(data, (pa.RecordBatch, pa.Table)) else list(data)
        if not parts:
            raise InvalidArgument(f"table {self.name!r}: insert of no rows")
        batches: list[pa.RecordBatch] = []
        offset = 0
        for part in parts:
            self._check_routed_experts(part, offset)
            t = protocol.conform(part, self.schema, table=self.name)
            if self._trajectory:
                protocol.validate_trajectories(t, table=self.name, row_offset=offset,
                                               vocab_size=self.spec.vocab_size)
                self._check_server_filled(t, offset)
                if self.checks is not None:
                    self.checks.check_rows(t, offset)
            offset += t.num_rows
            batches.extend(b for b in t.to_batches() if b.num_rows)
        if offset == 0:
            raise InvalidArgument(f"table {self.name!r}: insert of no rows")
        n = offset
        whole = pa.Table.from_batches(batches, schema=self.schema)
        pr = self.priorities(priorities, n)
        keys = None
        if self.spec.key is not None:
            key_col = whole.column(self.spec.key)
            keys = key_col.cast(pa.string()).to_pylist()
            self._check_keys(keys)  # across all parts of the call, not only within each
        if not self._trajectory:
            return PreparedInsert(
                batches=batches, keys=keys, priorities=pr, policy_versions=np.zeros(n, np.int64),
                groups=None, group_sizes=np.zeros(n, np.int64), tasks=None,
                rewards=np.full(n, np.nan), durability=durability), whole
        group_sizes = whole.column("group_size").fill_null(0).to_numpy().astype(np.int64)
        self._check_group_sizes(group_sizes)
        return PreparedInsert(
            batches=batches, keys=keys, priorities=pr,
            policy_versions=whole.column("policy_version").to_numpy().astype(np.int64),
            groups=whole.column("group_id"), group_sizes=group_sizes, tasks=whole.column("task"),
            rewards=whole.column("reward").cast(pa.float64()).fill_null(np.nan).to_numpy(),
            durability=durability, episodes=ingest_checks.episode_hashes(whole),
            data_versions=self._data_versions(whole),
            reservations=None if self.pace is None else self.pace.check_rows(whole.column(pacing.COLUMN), 0)), whole

    def durability(self, durability: str | None) -> str:
        """A call's durability (None: the table's default)."""
        if durability is None:
            return self.spec.durability
        if durability not in DURABILITIES:
            raise InvalidArgument(f"table {self.name!r}: durability must be memory, wal or fsync, got {durability!r}")
        if durability != "memory" and not self._durable:
            raise FailedPrecondition(f"table {self.name!r}: durability {durability!r} needs the SSD "
                                     f"tier; this table is memory-only (tiers = \"memory\")")
        return durability

    def priorities(self, priorities, n: int, *, required: bool = False) -> np.ndarray:
        """Validated float64 priorities, one per row; None/empty means 1.0 each unless
        ``required`` (updates must say what to set)."""
        if not required and (priorities is None or np.size(priorities) == 0):
            return np.ones(n, dtype=np.float64)
        try:
            pr = np.asarray(priorities, dtype=np.float64)
        except (TypeError, ValueError):
            raise InvalidArgument(f"table {self.name!r}: priorities must be numbers") from None
        if pr.ndim != 1:
            raise InvalidArgument(f"table {self.name!r}: priorities must be a list, one per row")
        if len(pr) != n:
            raise InvalidArgument(f"table {self.name!r}: {len(pr)} priorities for {n} rows")
        bad = ~np.isfinite(pr) | (pr < 0)
        if bad.any():
            i = int(np.flatnonzero(bad)[0])
            raise InvalidArgument(f"table {self.name!r}: row {i}, column 'priority': must be a "
                                  f"finite number >= 0, got {pr[i]}")
        return pr

    def item_ids(self, item_ids) -> np.ndarray:
        """Item ids as uint64; ids are positive integers, anything else is INVALID_ARGUMENT."""
        ids = np.asarray(item_ids)
        if ids.size == 0:
            return np.zeros(0, dtype=np.uint64)
        if ids.dtype.kind not in "ui":  # e.g. a list mixing numpy uint64 and int
            try:
                ids = np.array([operator.index(x) for x in item_ids], dtype=object)
            except TypeError:
                ids = None
        if ids is None or ids.ndim != 1 or ids.min() < 1 or ids.max() >= 2**64:
            raise InvalidArgument(f"table {self.name!r}: item ids must be a list of positive integers")
        return ids.astype(np.uint64)

    def version_ranges(self, data_versions: dict | None) -> dict:
        """The sampler's keyword for a sample's data version restriction (none: {})."""
        if data_versions is None:
            return {}
        if not self.spec.sampler.mixed:
            raise InvalidArgument(f"table {self.name!r}: data_versions needs task mixing (sampler.task_weights "
                                  f"or sampler.task_quotas) and a data_version column")
        ranges = {}
        for task, bounds in data_versions.items():
            try:
                lo, hi = bounds
                ranges[str(task)] = (None if lo is None else int(lo), None if hi is None else int(hi))
            except (TypeError, ValueError):
                raise InvalidArgument(f"table {self.name!r}: data_versions[{task!r}] must be a (min, max) pair "
                                      f"of integers or None, got {bounds!r}") from None
            if None not in ranges[str(task)] and ranges[str(task)][0] > ranges[str(task)][1]:
                raise InvalidArgument(f"table {self.name!r}: data_versions[{task!r}]: min {lo} exceeds max {hi}")
        return {"versions": ranges}

    def sample_size(self, n: int, unit: int) -> None:
        """A sample's batch size: at most max_size, and whole units of the sampler (groups)."""
        if n > self.spec.max_size:
            raise InvalidArgument(f"table {self.name!r}: batch_size {n} exceeds max_size {self.spec.max_size}")
        if n % unit:
            raise InvalidArgument(f"table {self.name!r}: batch_size {n} is not a multiple of "
                                  f"group_size {unit}")

    def _check_routed_experts(self, part: pa.Table | pa.RecordBatch, offset: int) -> None:
        """Shapes and ids of ``routed_experts`` as sent, before the cast to its type
        (routed.py), so that errors name the row, token and layer."""
        spec = self.spec.routed_experts
        if spec is None or routed.COLUMN not in part.schema.names or "tokens" not in part.schema.names:
            return
        tokens = part.column("tokens")
        counts = pc.list_value_length(tokens).fill_null(0).to_numpy(zero_copy_only=False)
        routed.check(part.column(routed.COLUMN), counts.astype(np.int64), spec, table=self.name, row_offset=offset)

    def _check_server_filled(self, t: pa.Table, offset: int) -> None:
        """Columns the server fills on every read may not be written."""
        name = group_timeouts.COLUMN
        if self._server_filled and t.column(name).null_count != t.num_rows:
            row = int(np.argmax(t.column(name).is_valid().to_numpy(zero_copy_only=False)))
            raise InvalidArgument(f"table {self.name!r}: row {offset + row}, column {name!r}: set by the server "
                                  f"on every read (group timeouts); leave it out of inserts")

    def _data_versions(self, whole: pa.Table) -> np.ndarray | None:
        if not self._versioned:
            return None
        col = whole.column("data_version")
        return col.cast(pa.int64()).fill_null(0).to_numpy(zero_copy_only=False).astype(np.int64)

    def _check_keys(self, keys: list) -> None:
        if None in keys:  # (scans in C, as set() below does: no Python loop per row)
            raise InvalidArgument(f"table {self.name!r}: row {keys.index(None)}, column {self.spec.key!r}: "
                                  f"the key column must not be null")
        if len(set(keys)) != len(keys):
            seen: dict[str, int] = {}
            for i, k in enumerate(keys):
                if k in seen:
                    raise InvalidArgument(f"table {self.name!r}: row {i}, column {self.spec.key!r}: "
                                          f"duplicate of row {seen[k]}")
                seen[k] = i

    def _check_group_sizes(self, group_sizes: np.ndarray) -> None:
        if self._group_size is None:
            return
        want = self._group_size
        bad = (group_sizes != 0) & (group_sizes != want)
        if bad.any():
            i = int(np.flatnonzero(bad)[0])
            raise InvalidArgument(f"table {self.name!r}: row {i}, column 'group_size': "
                                  f"{int(group_sizes[i])} differs from the sampler's group_size {want}")
