"""The store: the set of tables one server owns.

A registry lock guards the name -> table map only; each table has its own lock, so work
on one table never waits for another.
"""

from __future__ import annotations

import threading

from .errors import AlreadyExists, NotFound
from .spec import TableSpec
from .table import Table


class Store:
    def __init__(self, *, seed: int | None = None) -> None:
        self._tables: dict[str, Table] = {}
        self._lock = threading.Lock()
        self._seed = seed

    def create_table(self, spec: TableSpec, *, if_not_exists: bool = False) -> Table:
        """Create a table. With ``if_not_exists``, an existing table of the same spec is
        returned; one with a different spec is still ALREADY_EXISTS."""
        with self._lock:
            existing = self._tables.get(spec.name)
            if existing is not None:
                if if_not_exists and existing.spec == spec:
                    return existing
                detail = "with a different config" if if_not_exists else "already"
                raise AlreadyExists(f"table {spec.name!r} exists {detail}; drop it first or use another name")
            table = Table(spec, seed=None if self._seed is None else self._seed + len(self._tables))
            self._tables[spec.name] = table
            return table

    def drop_table(self, name: str) -> None:
        with self._lock:
            table = self._tables.pop(name, None)
        if table is None:
            raise NotFound(self._unknown(name))
        table.close()

    def table(self, name: str) -> Table:
        table = self._tables.get(name)
        if table is None:
            raise NotFound(self._unknown(name))
        return table

    def tables(self) -> list[Table]:
        with self._lock:
            return sorted(self._tables.values(), key=lambda t: t.name)

    def close(self) -> None:
        for table in self.tables():
            table.close()

    def _unknown(self, name: str) -> str:
        known = sorted(self._tables)
        return f"no table {name!r} (tables: {', '.join(known) if known else 'none'})"
