"""A producer's side of a paced table (docs/semantics.md, "Paced admission").

A table created with ``pacing`` admits a rollout only once the producer has reserved it:
the producer reserves a group's rows before it starts generating (waiting while the
trainer is too far behind), and every row it inserts names the reservation in
``reservation_id``. A group interrupted and stored in the partial table gives its
reservation back (the partial table has no such column); whoever continues it reserves
again when the continued group is finished. For an unpaced table ``Pace.open`` returns
None and the producer does none of this.

Calls are blocking (one per group); the producer runs them on a thread.
"""

from __future__ import annotations

import logging
import threading

import grpc

log = logging.getLogger(__name__)
COLUMN = "reservation_id"
WAIT_S = 30.0  # one Reserve call's wait; repeated until granted or the producer stops


class Pace:
    def __init__(self, client, table: str, stopped: threading.Event | None = None) -> None:
        self.client, self.table, self.stopped = client, table, stopped
        self._sharded = type(client).__name__ == "ShardedClient"
        self._held: dict[str, int] = {}  # group_id -> its reservation, while the group runs

    @classmethod
    def open(cls, target: str, token: str | None, table: str, stopped: threading.Event | None = None) -> "Pace | None":
        """The pace of ``table`` if it is paced, else None (also when the table does not
        exist yet: the producer's inserts say so then, as they did)."""
        from expstore_client import connect

        client = connect(target, token)
        try:
            paced = bool(client.describe(table).config.get("pacing"))
        except grpc.RpcError as e:
            if e.code() != grpc.StatusCode.NOT_FOUND:
                client.close()
                raise
            paced = False
        if not paced:
            client.close()
            return None
        return cls(client, table, stopped)

    def reserve(self, group_id: str, rows: int) -> None:
        """Reserve a group's rows before it starts; waits for as long as the trainer
        needs (in calls of WAIT_S), or until the producer stops (then raises)."""
        while True:
            try:
                r = self.client.reserve(self.table, rows, timeout=WAIT_S, **self._key(group_id))
                self._held[group_id] = r.id
                return
            except grpc.RpcError as e:
                if e.code() != grpc.StatusCode.DEADLINE_EXCEEDED or (self.stopped and self.stopped.is_set()):
                    raise
                log.info("table %r: waiting for the trainer to admit a group (%s)", self.table, e.details())

    def stamp(self, rows: list[dict]) -> list[dict]:
        """The group's rows with its reservation (reserved now for a continued group,
        whose first reservation was given back when it was interrupted)."""
        group_id = rows[0]["group_id"]
        if group_id not in self._held:
            self.reserve(group_id, len(rows))
        rid = self._held.pop(group_id)
        return [{**row, COLUMN: rid} for row in rows]

    def give_back(self, group_id: str) -> None:
        """The group will not be inserted by this producer (interrupted, failed)."""
        rid = self._held.pop(group_id, None)
        if rid is not None:
            self.client.release(self.table, rid, **self._key(group_id))

    def _key(self, group_id: str) -> dict:
        return {"key": group_id} if self._sharded else {}

    def close(self) -> None:
        self.client.close()
