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
group never acks it: the group comes back to the producers after ``VISIBILITY_S``, and a
continuation inserted twice is stored once (its traj_ids are derived from the aborted
ones). Continued and superseded rows stay in the partial table, for audits, until
``max_size`` evicts them.

Calls are blocking (the producer makes them rarely: when it stores an aborted group and
when it looks for groups to continue).
"""

from __future__ import annotations

import json
import logging

import grpc
import numpy as np

log = logging.getLogger(__name__)
SUFFIX = "_partial"
VISIBILITY_S = 600.0
"""How long a producer has to continue a group it took before the others may take it."""


class Partials:
    def __init__(self, client, table: str, group: str) -> None:
        self.client, self.table, self.group = client, table + SUFFIX, group

    @classmethod
    def open(cls, target: str, token: str | None, table: str, group: str) -> "Partials | None":
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
        return cls(client, table, group)

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
                                        visibility_timeout=VISIBILITY_S), None)
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

    def done(self, first_id: int) -> None:
        """The group whose index-0 row is ``first_id`` was continued (stored again as a
        partial group, or in the training table)."""
        self.client.ack(self.table, self.group, [first_id])

    def close(self) -> None:
        self.client.close()
