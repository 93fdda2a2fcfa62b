"""Errors of calls that went to several shards: a ``grpc.RpcError`` like any other (so
``e.code()`` checks keep working), whose details name every shard that failed."""

from __future__ import annotations

from typing import Any, Mapping

import grpc
import numpy as np


class ShardError(grpc.RpcError):
    """Some shards failed a call. ``failures``: shard name -> its RpcError; ``code()`` is
    the first failing shard's status code (in name order), ``details()`` names them all."""

    def __init__(self, what: str, failures: Mapping[str, grpc.RpcError]) -> None:
        self.failures = dict(sorted(failures.items()))
        self._code = next(iter(self.failures.values())).code()
        self._details = f"{what}: " + "; ".join(
            f"shard {name}: {_code_name(e)}: {_details(e)}" for name, e in self.failures.items())
        super().__init__(self._details)

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details

    def __str__(self) -> str:
        return f"{self._code.name}: {self._details}"


class ShardedInsertError(ShardError):
    """An insert whose parts failed on some shards. Each part is all or none on its shard:
    ``stored`` holds the InsertResult of every part that was stored (sharded ids), and
    ``failed_rows`` the row numbers (of the whole insert) that were not. Retrying the whole
    insert is safe: the stored rows come back as duplicates."""

    def __init__(self, table: str, failures: Mapping[str, grpc.RpcError], rows: Mapping[str, int],
                 stored: Mapping[str, Any], failed_rows: np.ndarray) -> None:
        named = {f"{name} ({rows[name]} row{'s' if rows[name] != 1 else ''})": e for name, e in failures.items()}
        super().__init__(f"table {table!r}: insert failed on {len(failures)} shard(s)", named)
        self.failures = dict(sorted(failures.items()))
        self.stored = dict(stored)
        self.failed_rows = failed_rows


def _code_name(e: grpc.RpcError) -> str:
    code = e.code() if callable(getattr(e, "code", None)) else None
    return code.name if code is not None else type(e).__name__


def _details(e: grpc.RpcError) -> str:
    details = e.details() if callable(getattr(e, "details", None)) else None
    return details or str(e)
