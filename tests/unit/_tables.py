"""Helpers shared by the table tests (test_table*.py): tables, rows, a worker thread."""

from __future__ import annotations

import threading
import time

import pyarrow as pa

from expstore.errors import NotFound
from expstore.spec import RateLimiterSpec, TableSpec
from expstore.synthetic import trajectories
from expstore.table import Table

TOKENS = 16


def make(name: str = "t", seed: int = 0, **kw) -> Table:
    return Table(TableSpec(name, **kw), seed=seed)


def traj(n: int, prefix: str = "traj", **kw) -> pa.Table:
    kw.setdefault("tokens", TOKENS)
    return trajectories(n, id_prefix=prefix, **kw)


def traj_ids(rows) -> list[str]:
    return rows.data.column("traj_id").to_pylist()


def with_column(t: pa.Table, name: str, values, type_=None) -> pa.Table:
    i = t.schema.get_field_index(name)
    return t.set_column(i, t.schema.field(name), pa.array(values, type=type_ or t.schema.field(name).type))


def live_ids(table: Table, ids) -> list[int]:
    """The ids among ``ids`` that ``get`` still finds."""
    out = []
    for i in ids:
        try:
            table.get([i])
            out.append(int(i))
        except NotFound:
            pass
    return out


def assert_blocked(w: "Worker", settle: float = 0.05) -> None:
    """The worker has had time to reach its wait and is still in it."""
    time.sleep(settle)
    assert w.is_alive() and w.error is None, w.error


class Worker(threading.Thread):
    """Runs ``fn`` in a thread, keeping its result or exception."""

    def __init__(self, fn):
        super().__init__(daemon=True)
        self.fn, self.result, self.error = fn, None, None

    def run(self):
        try:
            self.result = self.fn()
        except BaseException as e:  # noqa: BLE001 - reported by the test
            self.error = e

    def finish(self, timeout: float = 2.0):
        self.join(timeout)
        assert not self.is_alive(), "worker still blocked"
        return self


RATIO = RateLimiterSpec(type="sample_to_insert_ratio", samples_per_insert=1.0,
                        min_size_to_sample=1, error_buffer=1.0)  # diff window [0, 2]
