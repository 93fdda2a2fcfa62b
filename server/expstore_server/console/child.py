"""``expstore-server --http-port N``: the console as a child process of the server.

The server starts ``expstore console`` against itself on loopback (the console is a
client, in its own process: its work never runs on the server's threads), waits for the
console's first line (its URL) and stops it when the server stops. The child asks the
kernel for SIGTERM when its parent dies (Linux ``PR_SET_PDEATHSIG``, ``exit_with_parent``),
so a server killed with SIGKILL does not leave it behind. With TLS, the console serves HTTPS with the
server's certificate and trusts it as the root for its gRPC connection (a self-signed
certificate naming the loopback address); a certificate from a CA needs a console of its
own, ``expstore console --tls-ca CA.pem``.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import threading

from .serve import BANNER

START_TIMEOUT_S = 60.0
WILDCARDS = {"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}


class ConsoleError(Exception):
    pass


PARENT_ENV = "EXPSTORE_CONSOLE_PARENT"  # the server's pid, set for the child


def exit_with_parent() -> None:
    """In the child: SIGTERM when the server (pid in PARENT_ENV) dies, or exit now if it
    already has. Done by the child itself: a preexec_fn would run Python between fork and
    exec in a server full of threads."""
    parent = os.environ.get(PARENT_ENV)
    if not parent:
        return
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass
    if os.getppid() != int(parent):  # died before prctl
        sys.exit(0)


def command(host: str, grpc_port: int, http_port: int, tls_cert: str | None, tls_key: str | None) -> list[str]:
    target = WILDCARDS.get(host, host)
    target = f"[{target}]" if ":" in target else target
    cmd = [sys.executable, "-m", "expstore_server.cli", "--server", f"{target}:{grpc_port}"]
    if tls_cert:
        cmd += ["--tls-ca", tls_cert]
    cmd += ["console", "--http-host", host, "--http-port", str(http_port)]
    if tls_cert:
        cmd += ["--tls-cert", tls_cert, "--tls-key", tls_key]
    return cmd


class ConsoleProcess:
    """The running child; ``url`` is what it serves."""

    def __init__(self, cmd: list[str]) -> None:
        # spawned from the caller's (long-lived) thread: PR_SET_PDEATHSIG follows the thread that forked
        self.proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=None, text=True,
                                     env={**os.environ, PARENT_ENV: str(os.getpid())})
        self.url: str | None = None

    def wait_ready(self, timeout: float = START_TIMEOUT_S) -> str:
        """Block until the console prints its URL (ConsoleError if it exits first)."""
        line: list[str] = []
        reader = threading.Thread(target=lambda: line.append(self.proc.stdout.readline()), daemon=True)
        reader.start()
        reader.join(timeout)
        text = line[0] if line else ""
        if not text.startswith(BANNER):
            self.stop()
            raise ConsoleError(f"the console did not start (exit code {self.proc.returncode}); "
                               f"its error is on stderr above" if text == "" else f"the console said {text.strip()!r}")
        self.url = text[len(BANNER):].strip()
        threading.Thread(target=self.proc.stdout.read, daemon=True).start()  # never blocks on a full pipe
        return self.url

    def stop(self, timeout: float = 10.0) -> int | None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode
