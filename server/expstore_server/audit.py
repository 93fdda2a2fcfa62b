"""Audit log: one JSON line per admin or mutating call (who, what, which table, when, outcome).

Tokens are never written, only the name of the token that authenticated the call. The
event loop only enqueues a line; a writer thread appends whatever is queued and flushes
once per batch, so a busy server pays one flush per burst, not per call, and a crash
loses at most the lines queued in the last moments. ``close`` drains the queue.
"""

from __future__ import annotations

import json
import queue
import threading
import time
from pathlib import Path

_STOP = None


class AuditLog:
    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(path, "a", encoding="utf-8")
        self._queue: queue.SimpleQueue[str | None] = queue.SimpleQueue()
        self._writer = threading.Thread(target=self._write, name="audit-log", daemon=True)
        self._writer.start()

    def record(self, *, who: str, method: str, table: str | None, outcome: str,
               detail: str | None = None) -> None:
        entry = {"ts": time.time(), "who": who, "method": method, "table": table, "outcome": outcome}
        if detail:
            entry["detail"] = detail
        self._queue.put(json.dumps(entry, separators=(",", ":")) + "\n")

    def close(self) -> None:
        self._queue.put(_STOP)
        self._writer.join()
        self._file.close()

    def _write(self) -> None:
        while True:
            line = self._queue.get()
            while line is not _STOP:
                self._file.write(line)
                try:
                    line = self._queue.get_nowait()
                except queue.Empty:
                    break
            self._file.flush()
            if line is _STOP:
                return
