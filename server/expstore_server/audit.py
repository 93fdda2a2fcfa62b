"""Audit log: one JSON line per admin or mutating call (who, what, which table, when, outcome).

Tokens are never written, only the name of the token that authenticated the call.
Appends are serialised by a lock and flushed per line, so a crash loses at most the line
being written.
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path


class AuditLog:
    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(path, "a", encoding="utf-8")
        self._lock = threading.Lock()

    def record(self, *, who: str, method: str, table: str | None, outcome: str,
               detail: str | None = None) -> None:
        entry = {"ts": time.time(), "who": who, "method": method, "table": table, "outcome": outcome}
        if detail:
            entry["detail"] = detail
        line = json.dumps(entry, separators=(",", ":")) + "\n"
        with self._lock:
            self._file.write(line)
            self._file.flush()

    def close(self) -> None:
        with self._lock:
            self._file.close()
