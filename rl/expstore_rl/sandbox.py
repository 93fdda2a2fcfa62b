"""Run one untrusted command (a tool call, a unit test) in a subprocess under limits.

Every call gets a fresh temporary working directory and a launcher (a few lines of Python,
``_LAUNCHER``) that applies the limits in the child, then execs the command:

- RLIMIT_CPU (seconds of CPU), RLIMIT_AS (address space), RLIMIT_FSIZE (largest file),
  RLIMIT_NPROC (processes and threads);
- no network: ``unshare(CLONE_NEWNET)`` puts the command in an empty network namespace
  (not even loopback is up). On Linux this needs root or unprivileged user namespaces;
  the launcher tries CLONE_NEWNET, then CLONE_NEWUSER | CLONE_NEWNET, and otherwise runs
  without network isolation (``network_isolated()`` says which holds here);
- as root, the command runs as ``nobody`` (uid/gid 65534): root ignores RLIMIT_NPROC, and
  nobody can write only its working directory;
- a wall-clock timeout, after which the whole process group is killed (SIGKILL), as it
  also is when the command exits, so no child outlives a call. This process makes itself
  a child subreaper (prctl PR_SET_CHILD_SUBREAPER) so that the orphans of a command are
  reparented here and reaped, instead of piling up as zombies under an init that may not
  reap them (zombies count against RLIMIT_NPROC);
- stdout and stderr merged and truncated to ``output_bytes`` (the process is killed once
  it writes more).

A crash, hang or flood becomes a ``SandboxResult`` with a status, never an exception:
"ok" (exit 0), "error" (non-zero exit), "killed" (ended by a signal, e.g. the CPU
limit), "timeout" (wall clock), "output_truncated". RLIMIT_NPROC counts all tasks of the
user the command runs as, so the limit is set to that user's current count plus
``nproc``: the command may start ``nproc - 1`` more processes (fewer while other
sandboxes run at once).

Thread-safe (no ``preexec_fn``: the launcher is a separate interpreter); ``run_async``
runs ``run`` in a thread.
"""

from __future__ import annotations

import asyncio
import ctypes
import errno
import os
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from functools import lru_cache

NOBODY = 65534


def _world_executable(path: str) -> bool:
    """Whether any user may run the file at path (every directory above it searchable)."""
    path = os.path.realpath(path)
    parts = [path] + [os.path.dirname(path)]
    while parts[-1] != "/":
        parts.append(os.path.dirname(parts[-1]))
    return os.path.exists(path) and all(os.stat(p).st_mode & 0o001 for p in parts) and \
        bool(os.stat(path).st_mode & 0o004)


def _python() -> str:
    if os.geteuid() != 0 or _world_executable(sys.executable):
        return sys.executable
    return next((p for p in ("/usr/bin/python3", "/usr/local/bin/python3") if _world_executable(p)), sys.executable)


PYTHON = _python()
"""An interpreter that commands in the sandbox can run: as root, commands run as nobody,
who may not reach this process's interpreter (e.g. under /root); then the system one."""


@dataclass(frozen=True)
class Limits:
    cpu_s: int = 2
    memory_bytes: int = 512 << 20
    file_bytes: int = 1 << 20
    nproc: int = 16
    wall_s: float = 5.0
    output_bytes: int = 4096


@dataclass(frozen=True)
class SandboxResult:
    status: str  # ok | error | killed | timeout | output_truncated
    output: str  # stdout + stderr, at most Limits.output_bytes (decoded, errors replaced)
    returncode: int | None
    latency_ms: float


_LAUNCHER = r"""
import ctypes, os, resource, sys
cpu, mem, fsize, nproc, drop = map(int, sys.argv[1:6])
for lim, v in ((resource.RLIMIT_CPU, cpu), (resource.RLIMIT_AS, mem), (resource.RLIMIT_FSIZE, fsize)):
    resource.setrlimit(lim, (v, v))
libc = ctypes.CDLL(None, use_errno=True)
if libc.unshare(0x40000000) != 0:  # CLONE_NEWNET
    libc.unshare(0x10000000 | 0x40000000)  # CLONE_NEWUSER | CLONE_NEWNET; else not isolated
if drop:
    os.setgroups([]); os.setgid(drop); os.setuid(drop)
resource.setrlimit(resource.RLIMIT_NPROC, (nproc, nproc))
os.execvp(sys.argv[6], sys.argv[6:])
"""


def _user_processes(uid: int) -> int:
    """Tasks (processes and threads) of uid: what RLIMIT_NPROC counts."""
    n = 0
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/status") as f:
                status = f.read()
        except OSError:
            continue
        uid_line = next((ln for ln in status.splitlines() if ln.startswith("Uid:")), "")
        threads = next((ln for ln in status.splitlines() if ln.startswith("Threads:")), "Threads: 1")
        if uid_line.split()[1:2] == [str(uid)]:
            n += int(threads.split()[1])
    return n


@lru_cache(maxsize=1)
def _become_subreaper() -> bool:
    return ctypes.CDLL(None, use_errno=True).prctl(36, 1, 0, 0, 0) == 0  # PR_SET_CHILD_SUBREAPER


def _kill_group(proc: subprocess.Popen) -> int:
    """SIGKILL the command's process group, reap it (orphans included) and return the
    command's exit code."""
    for _ in range(10):  # a forking group may need more than one round
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            break
        time.sleep(0.01)
    code = proc.wait()
    while True:
        try:
            os.waitpid(-proc.pid, 0)  # the orphans reparented to this subreaper
        except ChildProcessError:
            return code


def run(argv: list[str], *, stdin: str = "", limits: Limits = Limits(),
        files: dict[str, str] | None = None) -> SandboxResult:
    """Run ``argv`` in a fresh temporary directory holding ``files`` (name -> text)."""
    start = time.monotonic()
    root = os.geteuid() == 0
    _become_subreaper()
    nproc = _user_processes(NOBODY if root else os.getuid()) + limits.nproc
    workdir = tempfile.mkdtemp(prefix="expstore-sandbox-")
    try:
        for name, text in (files or {}).items():
            with open(os.path.join(workdir, name), "w") as f:
                f.write(text)
        if root:
            for path in [workdir, *(os.path.join(workdir, n) for n in files or {})]:
                os.chown(path, NOBODY, NOBODY)
        cmd = [sys.executable, "-I", "-S", "-c", _LAUNCHER, str(limits.cpu_s), str(limits.memory_bytes),
               str(limits.file_bytes), str(nproc), str(NOBODY if root else 0), *argv]
        env = {"PATH": "/usr/bin:/bin", "HOME": workdir, "TMPDIR": workdir, "LANG": "C.UTF-8"}
        try:
            proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                    cwd=workdir, env=env, start_new_session=True)
        except OSError as e:
            return SandboxResult("error", f"cannot start: {e}", None, (time.monotonic() - start) * 1e3)
        status, out = _collect(proc, stdin, start + limits.wall_s, limits.output_bytes)
        code = _kill_group(proc)
        if status is None:
            status = "ok" if code == 0 else "killed" if code < 0 else "error"
        text = out[:limits.output_bytes].decode(errors="replace")
        return SandboxResult(status, text, code, (time.monotonic() - start) * 1e3)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def _collect(proc: subprocess.Popen, stdin: str, deadline: float, cap: int) -> tuple[str | None, bytes]:
    """Read the merged output until EOF, the deadline, or more than cap bytes."""
    try:
        proc.stdin.write(stdin.encode())
        proc.stdin.close()
    except BrokenPipeError:
        pass
    out = bytearray()
    with selectors.DefaultSelector() as sel:
        sel.register(proc.stdout, selectors.EVENT_READ)
        try:
            while True:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return "timeout", bytes(out)
                if not sel.select(remaining):
                    continue
                chunk = os.read(proc.stdout.fileno(), 65536)
                if not chunk:
                    return None, bytes(out)
                out += chunk
                if len(out) > cap:
                    return "output_truncated", bytes(out)
        finally:
            proc.stdout.close()


async def run_async(argv: list[str], **kwargs) -> SandboxResult:
    return await asyncio.to_thread(run, argv, **kwargs)


@lru_cache(maxsize=1)
def network_isolated() -> bool:
    """Whether sandboxed commands really run without network here (probed once)."""
    probe = ("import socket\ns = socket.socket()\ns.settimeout(1)\n"
             "try:\n    s.connect(('127.0.0.1', 9))\nexcept OSError as e:\n    print(e.errno)\n")
    r = run([PYTHON, "-I", "-S", "-c", probe])
    return r.status == "ok" and r.output.strip() == str(errno.ENETUNREACH)
