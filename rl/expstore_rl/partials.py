"""Partial rollouts in the store: groups a producer interrupted (it was stopped, or a new
policy version interrupted the generations running) wait in ``<table>_partial`` until a
producer continues them.

A partial group is inserted whole, in group order, into the partial table (its rows get
contiguous ids): the aborted rows with their tokens, logprobs and per-token versions as
generated, the rows that had finished as they are, each with ``metadata.partial.index``,
its place in the group. The producers share one consumer group on the table. A group
belongs to whoever receives its index-0 row: that producer reads the whole group by id
(``get``, ids ``first .. first + group_size - 1``) and acks the index-0 row once the
continued group is in the training table; any other row is acked as soon as it is
received, as it travels with its index-0 row. A producer that dies while it continues a
group never acks it: the group comes back to the producers after the visibility timeout
(``VISIBILITY_S`` by default), and a continuation inserted twice is stored once (its
traj_ids are derived from the aborted ones). Continued and superseded rows stay in the
partial table, for audits, until ``max_size`` evicts them.

Scheduling (``claim``): a producer claims up to a window of waiting groups in one read
and continues them oldest policy version first (the oldest version among a group's
aborted rows; ties in store order). Groups whose continuation is already stored
("completed": a producer died after storing it and before its ack) are found by one SQL
query over both tables and acked without being generated again.

Calls are blocking (the producer makes them rarely: when it stores an aborted group and
when it looks for groups to continue).
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass

import grpc
import numpy as np

from .agent import continuation_id

log = logging.getLogger(__name__)
SUFFIX = "_partial"
VISIBILITY_S = 600.0
"""How long a producer has to continue a group it took before the others may take it."""


@dataclass(frozen=True)
class Claimed:
    """A partial group this producer owns: its rows in group order, the id of its index-0
    row (what ``done`` acks), and the oldest version among its aborted rows."""
    rows: list[dict]
    first: int

    @property
    def oldest_version(self) -> int:
        return min(r["policy_version"] for r in self.rows if r["finish_reason"] == "aborted")


class Partials:
    def __init__(self, client, table: str, group: str, visibility_s: float = VISIBILITY_S) -> None:
        self.client, self.trained, self.table, self.group = client, table, table + SUFFIX, group
        self.visibility_s = visibility_s

    @classmethod
    def open(cls, target: str, token: str | None, table: str, group: str,
             visibility_s: float = VISIBILITY_S) -> "Partials | None":
        """The partial table of ``table`` (created if missing), or None with a warning when
        it is missing and cannot be made (this token may not create tables, or the name
        would be too long): then the producer finishes its groups instead."""
        from expstore_client import connect

        client = connect(target, token)
        try:
            client.create_table(table + SUFFIX, sampler="fifo", if_not_exists=True)
        except grpc.RpcError as e:
            if e.code() not in (grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.INVALID_ARGUMENT,
                                grpc.StatusCode.ALREADY_EXISTS):
                client.close()
                raise
            try:
                client.describe(table + SUFFIX)  # made by someone else (an admin, another config)
            except grpc.RpcError:
                log.warning("table %r: no partial table, and it cannot be created (%s: %s): interrupted "
                            "groups are finished, not stored", table, e.code().name, e.details())
                client.close()
                return None
        return cls(client, table, group, visibility_s)

    def put(self, rows: list[dict]) -> None:
        """Store an interrupted group (all its rows, in group order)."""
        out = []
        for i, row in enumerate(rows):
            meta = json.loads(row["metadata"])
            meta["partial"] = {**meta.get("partial", {"open_turn": False}), "index": i}
            out.append({**row, "metadata": json.dumps(meta)})
        self.client.insert(self.table, out)

    def take(self, max_rows: int) -> list[tuple[list[dict], int]]:
        """Groups this producer now owns, read from what is waiting (one read of at most
        ``max_rows`` rows, no wait): (rows in group order, id of the index-0 row)."""
        batch = next(self.client.stream(self.table, self.group, max_rows, poll_timeout=0.0, idle_timeout=0.0,
                                        visibility_timeout=self.visibility_s), None)
        if batch is None:
            return []
        rows = batch.data.to_pylist()
        index = np.array([json.loads(r["metadata"])["partial"]["index"] for r in rows])
        if (index != 0).any():
            self.client.ack(self.table, self.group, batch.ids[index != 0])
        groups = []
        for first, row in zip(batch.ids[index == 0], (r for r, i in zip(rows, index) if i == 0)):
            n = row["group_size"] or 1
            try:
                group = self.client.get(self.table, np.arange(n, dtype=np.uint64) + first).data.to_pylist()
            except grpc.RpcError as e:  # e.g. evicted by max_size
                if e.code() != grpc.StatusCode.NOT_FOUND:
                    raise
                group = []
            if [r["group_id"] for r in group] != [row["group_id"]] * n:
                log.error("table %r: partial group %r from item %d is incomplete; dropped",
                          self.table, row["group_id"], first)
                self.done(int(first))
                continue
            groups.append((group, int(first)))
        return groups

    def claim(self, max_groups: int, group_size: int) -> tuple[list[Claimed], int]:
        """Claim what waits (one read of up to ``max_groups`` groups of ``group_size``):
        the groups to continue, oldest version first, and how many were completed already
        (acked here)."""
        claimed = [Claimed(rows, first) for rows, first in self.take(max(1, max_groups * group_size))]
        stored = self._stored({continuation_id(r["traj_id"]) for c in claimed for r in c.rows
                               if r["finish_reason"] == "aborted"})
        todo = []
        for c in claimed:
            if any(continuation_id(r["traj_id"]) in stored for r in c.rows if r["finish_reason"] == "aborted"):
                self.done(c.first)
            else:
                todo.append(c)
        return sorted(todo, key=lambda c: (c.oldest_version, c.first)), len(claimed) - len(todo)

    def _stored(self, traj_ids: set[str]) -> set[str]:
        """Which of ``traj_ids`` the trainer's table or the partial table holds (empty, with
        a warning, when the query fails: continuing again is safe, only wasted work)."""
        if not traj_ids:
            return set()
        ids = ", ".join(f"'{t}'" for t in sorted(traj_ids))  # hex digests: nothing to escape
        sql = " UNION ALL ".join(f'SELECT traj_id FROM "{t}" WHERE traj_id IN ({ids})'
                                 for t in (self.trained, self.table))
        try:
            return set(self.client.query_table(sql).column("traj_id").to_pylist())
        except grpc.RpcError as e:
            log.warning("table %r: cannot look for stored continuations (%s: %s); continuing them again",
                        self.table, e.code().name, e.details())
            return set()

    def done(self, first_id: int) -> None:
        """The group whose index-0 row is ``first_id`` was continued (stored again as a
        partial group, or in the training table)."""
        self.client.ack(self.table, self.group, [first_id])

    def close(self) -> None:
        self.client.close()
