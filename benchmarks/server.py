"""Start and stop server subprocesses for the benchmarks.

``start`` runs ``python -m expstore_server.main --port 0 --data-dir D`` (or any module
that, like it, prints ``<banner> HOST:PORT`` as its first stdout line) and returns once the
address is known, the way tests/conftest.py starts its servers. ``rss_bytes`` reads the
process's resident set (VmRSS) from /proc; ``audited_calls`` counts an expstore server's
calls in its audit log.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field

EXPSTORE_BANNER = "expstore-server listening on "


@dataclass
class ServerProcess:
    proc: subprocess.Popen
    address: str
    stderr_lines: list[str] = field(default_factory=list)
    tmp: tempfile.TemporaryDirectory | None = None

    @property
    def pid(self) -> int:
        return self.proc.pid

    def rss_bytes(self) -> int:
        return rss_bytes(self.proc.pid)

    def audited_calls(self, method: str, table: str) -> int:
        """Calls of ``method`` on ``table`` in an expstore server's audit log (the writer
        appends within ~10 ms: read after the calls have ended)."""
        time.sleep(0.2)
        path = os.path.join(self.tmp.name, "data", "audit.jsonl")
        with open(path) as f:
            return sum(1 for line in f if (e := json.loads(line))["method"] == method and e["table"] == table)

    def stop(self, timeout: float = 30.0) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.tmp is not None:
            self.tmp.cleanup()

    def __enter__(self) -> "ServerProcess":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def start(cmd: list[str], banner: str, env: dict[str, str] | None = None,
          tmp: tempfile.TemporaryDirectory | None = None) -> ServerProcess:
    """Run ``cmd``; wait for its first stdout line, which must start with ``banner``."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, **(env or {})})
    stderr_lines: list[str] = []
    threading.Thread(target=lambda: stderr_lines.extend(proc.stderr), daemon=True).start()
    line = proc.stdout.readline()
    if not line.startswith(banner):
        proc.kill()
        proc.wait()
        raise RuntimeError(f"{cmd[2]} did not start: {line!r} {''.join(stderr_lines)[-2000:]}")
    threading.Thread(target=proc.stdout.read, daemon=True).start()
    return ServerProcess(proc, line.rsplit(" ", 1)[1].strip(), stderr_lines, tmp)


def start_expstore(env: dict[str, str] | None = None, *args: str) -> ServerProcess:
    """An expstore server on 127.0.0.1, a free port and a temporary data directory."""
    tmp = tempfile.TemporaryDirectory(prefix="expstore-bench-")
    cmd = [sys.executable, "-m", "expstore_server.main", "--port", "0", "--data-dir",
           os.path.join(tmp.name, "data"), "--log-level", "warning", *args]
    return start(cmd, EXPSTORE_BANNER, env, tmp)


def rss_bytes(pid: int) -> int:
    """VmRSS of a process, in bytes."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")
