"""Run one untrusted command (a tool call, a unit test) in a subprocess, confined.

Every call gets a fresh temporary working directory and a launcher
(``sandbox_launcher.py``, a separate interpreter) that confines itself, then runs the
command. Limits, everywhere:

- RLIMIT_CPU (seconds of CPU), RLIMIT_AS (address space), RLIMIT_FSIZE (largest file),
  RLIMIT_NPROC (processes and threads), no core dumps, no new privileges (setuid bits);
- as root, the command runs as a uid and gid of its own, ``UID_BASE`` + a host pid that
  the call holds until its last process is gone (root ignores RLIMIT_NPROC; two calls
  cannot signal each other or write each other's files, even without namespaces);
- a wall-clock timeout, after which the launcher's process group is killed (SIGKILL), as
  it also is when the command exits. This process makes itself a child subreaper (prctl
  PR_SET_CHILD_SUBREAPER) so that orphans are reparented here and reaped, instead of
  piling up as zombies (they count against RLIMIT_NPROC);
- stdout and stderr merged and truncated to ``output_bytes`` (the process is killed once
  it writes more).

Isolation (``GUARANTEES``), from Linux namespaces: a new mount, PID, network, IPC and UTS
namespace per call. As root they are made directly; without root, inside a user
namespace that maps only the caller's uid, where the kernel allows unprivileged user
namespaces (most distributions do; some disable them by sysctl or AppArmor, containers
often by seccomp). Then:

- "network": an empty network namespace (not even loopback is up);
- "processes": the command is PID 2 of its own PID namespace, under an init (PID 1) that
  reaps orphans; /proc is a fresh procfs of that namespace, so no host process (nor its
  command line, where secrets sometimes are) is visible. When the command exits, or the
  launcher is killed (timeout, output cap, this process dying), the init exits and the
  kernel kills every process left in the namespace, a ``setsid`` + double-forked daemon
  included, before ``run`` returns;
- "filesystem": the command sees a new root: ``READ_ONLY`` (the system's programs and
  libraries, this interpreter's installation) bound read-only, /dev/{null,zero,full,
  random,urandom}, a private tmpfs on /tmp and /dev/shm (``tmp_bytes`` each, gone with
  the call), its working dir (read-write, at the same path), a two-line /etc/passwd and
  /etc/group, and nothing else: not the project tree, not data dirs, not another call's
  files, whatever their permissions. ``/`` itself is read-only.

Once the namespaces exist, a failure to build that view ends the call with status
"error" (exit 126, the reason in the output): a call never runs half-confined. Where
namespaces are refused altogether, the command runs with the limits only (and network
isolation if that alone is allowed): calls then share /tmp, see host processes and can
read every world-readable file. ``isolation()`` probes which guarantees hold here (tests
skip what the machine cannot give). Not isolated anywhere: CPU time of the machine
(RLIMIT_CPU bounds each process, not their sum), RLIMIT_NPROC without root (it counts
every task of the caller's uid, sandboxes included), and the kernel itself (system calls
are not filtered).

A crash, hang or flood becomes a ``SandboxResult`` with a status, never an exception:
"ok" (exit 0), "error" (non-zero exit), "killed" (ended by a signal, e.g. the CPU
limit), "timeout" (wall clock), "output_truncated". The command may start ``nproc - 1``
more processes: as root exactly, as the call has a uid of its own; without root the
limit is the user's current task count plus ``nproc`` (fewer while other processes of
the user start).

Thread-safe (no ``preexec_fn``: the launcher is a separate interpreter); ``run_async``
runs ``run`` in a thread. Cost: two interpreter starts (launcher, command) and a few
mounts per call (docs/rl.md, "Sandbox", has the figures).
"""

from __future__ import annotations

import asyncio
import ctypes
import errno
import json
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

UID_BASE = 2_000_000_000
"""As root, a call runs as UID_BASE + a host pid: a uid of its own (pids < 2**22), far
above the ranges that distributions, systemd and container runtimes hand out."""


def _world_executable(path: str) -> bool:
    """Whether any user may run the file at path (every directory above it searchable)."""
    path = os.path.realpath(path)
    parts = [path] + [os.path.dirname(path)]
    while parts[-1] != "/":
        parts.append(os.path.dirname(parts[-1]))
    return os.path.exists(path) and all(os.stat(p).st_mode & 0o001 for p in parts) and \
        bool(os.stat(path).st_mode & 0o004)


def _python() -> str:
    exe = os.path.realpath(sys.executable)  # a venv's python is a link: its target, found in the view
    if os.geteuid() != 0 or _world_executable(exe):
        return exe
    return next((p for p in ("/usr/bin/python3", "/usr/local/bin/python3") if _world_executable(p)), exe)


PYTHON = _python()
"""An interpreter that commands in the sandbox can run (for the stdlib: ``-I -S``): this
one's base installation, not a venv (not in the filesystem view); as root, commands run
as another uid, which may not reach this process's interpreter (e.g. under /root) where
namespaces are refused: then the system one."""


def _read_only() -> tuple[str, ...]:
    system = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/etc/ld.so.cache", "/etc/alternatives")
    prefix = sys.base_prefix  # PYTHON's installation, when it is this interpreter (else under /usr)
    mine = os.path.realpath(PYTHON) == os.path.realpath(sys.executable)
    return system + ((prefix,) if mine and not any((prefix + "/").startswith(p + "/") for p in system) else ())


READ_ONLY = _read_only()
"""The host paths a command sees (read-only) when the filesystem is isolated: the system's
programs and libraries, and the installation of ``PYTHON``. Nothing else of the host."""

LAUNCHER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "sandbox_launcher.py")


@dataclass(frozen=True)
class Limits:
    cpu_s: int = 2
    memory_bytes: int = 512 << 20
    file_bytes: int = 1 << 20
    nproc: int = 16
    wall_s: float = 5.0
    output_bytes: int = 4096
    tmp_bytes: int = 16 << 20
    """size of the call's private /tmp, and of its /dev/shm (memory, not disk)"""


@dataclass(frozen=True)
class SandboxResult:
    status: str  # ok | error | killed | timeout | output_truncated
    output: str  # stdout + stderr, at most Limits.output_bytes (decoded, errors replaced)
    returncode: int | None
    latency_ms: float


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


def _end_call(proc: subprocess.Popen) -> int:
    """SIGKILL the launcher's process group, reap it and every orphan of it reparented to
    this subreaper, and return the launcher's exit code. With a PID namespace, the init
    is such an orphan when the launcher was killed first; it is reapable only once the
    kernel has killed everything in its namespace, so this returns after all of it."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    code = proc.wait()
    while True:
        try:
            os.waitpid(-proc.pid, 0)
        except ChildProcessError:
            return code


def run(argv: list[str], *, stdin: str = "", limits: Limits = Limits(),
        files: dict[str, str] | None = None) -> SandboxResult:
    """Run ``argv`` in a fresh temporary directory holding ``files`` (name -> text)."""
    start = time.monotonic()
    root = os.geteuid() == 0
    _become_subreaper()
    nproc = limits.nproc if root else _user_processes(os.getuid()) + limits.nproc  # root: a uid of its own
    box = tempfile.mkdtemp(prefix=f"expstore-sandbox-{os.getpid()}-")  # work/: the call's dir; root/: its new /
    workdir, new_root = os.path.join(box, "work"), os.path.join(box, "root")
    try:
        os.mkdir(workdir)
        os.mkdir(new_root)
        for name, text in (files or {}).items():
            with open(os.path.join(workdir, name), "w") as f:
                f.write(text)
        if root:
            os.chmod(box, 0o711)  # where namespaces are refused, the call's uid must reach work/
        config = {"cpu": limits.cpu_s, "memory": limits.memory_bytes, "fsize": limits.file_bytes, "nproc": nproc,
                  "uid_base": UID_BASE if root else 0, "parent": os.getpid(), "workdir": workdir, "root": new_root,
                  "tmp_bytes": limits.tmp_bytes, "read_only": list(READ_ONLY)}
        cmd = [sys.executable, "-I", "-S", LAUNCHER, json.dumps(config), *argv]
        env = {"PATH": "/usr/bin:/bin", "HOME": workdir, "TMPDIR": workdir, "LANG": "C.UTF-8"}
        try:
            proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                    cwd=workdir, env=env, start_new_session=True)
        except OSError as e:
            return SandboxResult("error", f"cannot start: {e}", None, (time.monotonic() - start) * 1e3)
        status, out = _collect(proc, stdin, start + limits.wall_s, limits.output_bytes)
        code = _end_call(proc)
        if status is None:
            status = "ok" if code == 0 else "killed" if code < 0 else "error"
        text = out[:limits.output_bytes].decode(errors="replace")
        return SandboxResult(status, text, code, (time.monotonic() - start) * 1e3)
    finally:
        shutil.rmtree(box, ignore_errors=True)


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


GUARANTEES = ("network", "processes", "filesystem")
"""What namespaces add to the limits: no network; only the call's own processes, all
killed with it; only ``READ_ONLY`` of the host's files, plus a private working dir,
/tmp and /dev/shm."""


@lru_cache(maxsize=1)
def isolation() -> frozenset[str]:
    """Which ``GUARANTEES`` sandboxed commands really get on this machine, probed once by
    running one: it must fail to reach loopback, see itself as PID 2 next to the init and
    nothing else in /proc, and not see a file that every user may read."""
    with tempfile.TemporaryDirectory(prefix="expstore-sandbox-probe-") as d:
        os.chmod(d, 0o755)
        visible = os.path.join(d, "visible")
        with open(visible, "w") as f:
            f.write("host")
        os.chmod(visible, 0o644)
        probe = ("import os, socket\ns = socket.socket()\ns.settimeout(1)\n"
                 "try:\n    s.connect(('127.0.0.1', 9))\n    net = False\n"
                 f"except OSError as e:\n    net = e.errno == {errno.ENETUNREACH}\n"
                 "procs = os.getpid() == 2 and sorted(p for p in os.listdir('/proc') if p.isdigit()) == ['1', '2']\n"
                 f"files = not os.path.exists({visible!r})\n"
                 "print(*(name for name, held in (('network', net), ('processes', procs), ('filesystem', files))"
                 " if held))\n")
        r = run([PYTHON, "-I", "-S", "-c", probe])
    return frozenset(r.output.split()) & frozenset(GUARANTEES) if r.status == "ok" else frozenset()


def network_isolated() -> bool:
    """Whether sandboxed commands really run without network here (probed once)."""
    return "network" in isolation()
