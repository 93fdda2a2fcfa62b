"""The child side of ``sandbox.run``: a script (``python -I -S sandbox_launcher.py CONFIG
ARGV...``, stdlib only, never imported) that confines itself, then runs ARGV.

CONFIG is JSON: ``cpu``, ``memory``, ``fsize``, ``nproc`` (limits), ``uid_base`` (0: keep
this uid; else the command runs as uid_base + a host pid, see ``call_uid``), ``parent``
(the pid of the process that started this one), ``workdir`` (the call's directory),
``root`` (an empty directory to build the new root on), ``tmp_bytes`` and ``read_only``
(host paths the command may read).

Three processes, once namespaces are available:

    launcher (host PID namespace) -- waits, then exits as the command did
      └── init (PID 1 of a new PID namespace; builds the filesystem view, reaps orphans)
            └── the command (as its own uid, no new privileges, RLIMIT_NPROC)

The launcher unshares mount, PID, network, IPC and UTS namespaces (as root directly,
otherwise inside a new user namespace that maps only this uid) and forks the init. The
init makes every mount private, mounts a tmpfs on ``root`` and puts in it: ``read_only``
paths bound read-only (nosuid, nodev), /dev/{null,zero,full,random,urandom}, a fresh
tmpfs on /tmp and /dev/shm (``tmp_bytes`` each), a fresh procfs of the new PID namespace
(left empty where the kernel refuses one), ``workdir`` bound read-write at its own path,
and a minimal /etc/passwd and /etc/group; then ``pivot_root`` into it, detaches the old
root and makes ``/`` read-only. When the command exits, the init exits, and the kernel
kills whatever is left in the namespace (a ``setsid`` + double-forked daemon included)
before the init can be reaped. The launcher and the init die with their parents
(PR_SET_PDEATHSIG; the thread that started the launcher waits for it, so it cannot end
first): killing the caller or the launcher kills the init, hence the whole namespace.

Once namespaces exist, any failure to build the view ends the call (exit 126, reason on
stderr): it never runs half-confined. Where no namespace can be made at all, the command
runs with the limits alone (network isolation if only that is available); ``sandbox.
isolation()`` probes what holds.
"""

import ctypes
import json
import os
import re
import resource
import signal
import sys

CLONE_NEWNS, CLONE_NEWUTS, CLONE_NEWIPC = 0x00020000, 0x04000000, 0x08000000
CLONE_NEWUSER, CLONE_NEWPID, CLONE_NEWNET = 0x10000000, 0x20000000, 0x40000000
NAMESPACES = CLONE_NEWNS | CLONE_NEWPID | CLONE_NEWNET | CLONE_NEWIPC | CLONE_NEWUTS
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT = 1, 2, 4, 8, 32
MS_NOATIME, MS_NODIRATIME, MS_BIND, MS_REC, MS_PRIVATE, MS_RELATIME = 1024, 2048, 4096, 16384, 1 << 18, 1 << 21
MNT_DETACH = 2
PR_SET_PDEATHSIG, PR_SET_DUMPABLE, PR_SET_NO_NEW_PRIVS = 1, 4, 38
SYS_PIVOT_ROOT = {"x86_64": 155, "aarch64": 41, "riscv64": 41}
DEVICES = ("null", "zero", "full", "random", "urandom")
SETUP_FAILED = 126

libc = ctypes.CDLL(None, use_errno=True)


def _check(ret: int, what: str) -> None:
    if ret != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def _mount(source, target, fstype, flags, data=None) -> None:
    enc = lambda s: None if s is None else os.fsencode(s)  # noqa: E731
    _check(libc.mount(enc(source), enc(target), enc(fstype), ctypes.c_ulong(flags), enc(data)),
           f"mount {source or ''} on {target}")


def _die_with_parent() -> None:
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


# -- namespaces -----------------------------------------------------------------------


def enter_namespaces() -> str:
    """'full' (mount, PID, net, IPC, UTS), 'network' (net only) or 'none': what this
    machine allowed. Without root, a user namespace mapping only this uid and gid."""
    uid, gid = os.getuid(), os.getgid()
    if libc.unshare(NAMESPACES) == 0:
        return "full"
    if libc.unshare(CLONE_NEWUSER | NAMESPACES) == 0:
        for name, text in (("setgroups", "deny"), ("uid_map", f"{uid} {uid} 1"), ("gid_map", f"{gid} {gid} 1")):
            with open(f"/proc/self/{name}", "w") as f:
                f.write(text)
        return "full"
    if libc.unshare(CLONE_NEWNET) == 0 or libc.unshare(CLONE_NEWUSER | CLONE_NEWNET) == 0:
        return "network"
    return "none"


# -- the filesystem view (in the init, before the command starts) ------------------------


def _mount_points_under(path: str) -> list[str]:
    """path and every mount point below it, parents first (field 5 of mountinfo)."""
    with open("/proc/self/mountinfo") as f:
        points = [re.sub(r"\\([0-7]{3})", lambda m: chr(int(m[1], 8)), ln.split()[4]) for ln in f]
    return [p for p in points if p == path or p.startswith(path.rstrip("/") + "/")]


def _kept_flags(path: str) -> int:
    """Flags a remount must repeat: a user namespace may not clear them."""
    f = os.statvfs(path).f_flag
    kept = MS_NOEXEC if f & os.ST_NOEXEC else 0
    kept |= MS_NOATIME if f & os.ST_NOATIME else 0
    kept |= MS_NODIRATIME if f & os.ST_NODIRATIME else 0
    return kept | (MS_RELATIME if f & os.ST_RELATIME else 0)


def _bind(source: str, target: str, read_only: bool) -> None:
    _mount(source, target, None, MS_BIND | MS_REC)
    for point in _mount_points_under(target):
        flags = MS_BIND | MS_REMOUNT | MS_NOSUID | MS_NODEV | (MS_RDONLY if read_only else 0)
        _mount(None, point, None, flags | _kept_flags(point))


def _expose(path: str, root: str) -> None:
    """Make host ``path`` visible, read-only, at the same place under root: a symlink as
    a symlink (/bin -> usr/bin), a directory or a file as a read-only bind mount."""
    inside = root + path
    os.makedirs(os.path.dirname(inside), exist_ok=True)
    if os.path.islink(path):
        os.symlink(os.readlink(path), inside)
    elif os.path.isdir(path):
        os.makedirs(inside, exist_ok=True)
        _bind(path, inside, read_only=True)
    elif os.path.exists(path):
        open(inside, "w").close()
        _bind(path, inside, read_only=True)


def _tmpfs(target: str, size: int, mode: str) -> None:
    os.makedirs(target, exist_ok=True)
    _mount("tmpfs", target, "tmpfs", MS_NOSUID | MS_NODEV, f"mode={mode},size={size},nr_inodes=16384")


def _pivot_root(root: str) -> None:
    """Make root the new ``/`` and detach the old one (pivot_root(".", "."), as in
    pivot_root(2)); chroot where the syscall number is unknown."""
    os.chdir(root)
    number = SYS_PIVOT_ROOT.get(os.uname().machine)
    if number is None:
        _mount(".", "/", None, 1 << 13)  # MS_MOVE
        os.chroot(".")
    else:
        _check(libc.syscall(number, b".", b"."), "pivot_root")
        _check(libc.umount2(b".", MNT_DETACH), "detach the old root")
    os.chdir("/")


def build_root(cfg: dict) -> None:
    root, workdir = cfg["root"], cfg["workdir"]
    _mount(None, "/", None, MS_REC | MS_PRIVATE)  # nothing below propagates to the host
    _mount("tmpfs", root, "tmpfs", MS_NOSUID | MS_NODEV, "mode=0755,size=1m")
    for path in cfg["read_only"]:
        _expose(path, root)
    os.makedirs(root + "/dev")
    for name in DEVICES:
        open(f"{root}/dev/{name}", "w").close()
        _mount(f"/dev/{name}", f"{root}/dev/{name}", None, MS_BIND)
    for i, name in enumerate(("stdin", "stdout", "stderr")):
        os.symlink(f"/proc/self/fd/{i}", f"{root}/dev/{name}")
    os.symlink("/proc/self/fd", f"{root}/dev/fd")
    _tmpfs(root + "/dev/shm", cfg["tmp_bytes"], "1777")
    _tmpfs(root + "/tmp", cfg["tmp_bytes"], "1777")
    os.makedirs(root + "/proc")
    try:
        _mount("proc", root + "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
    except OSError:
        pass  # a user namespace under a masked /proc may not mount one: then none at all
    os.makedirs(root + workdir, exist_ok=True)
    _bind(workdir, root + workdir, read_only=False)
    os.makedirs(root + "/etc", exist_ok=True)
    uid = cfg["uid"] or os.getuid()  # what the command will be
    with open(root + "/etc/passwd", "w") as f:
        f.write(f"root:x:0:0::/:/usr/sbin/nologin\nsandbox:x:{uid}:{uid}::{workdir}:/usr/sbin/nologin\n")
    with open(root + "/etc/group", "w") as f:
        f.write(f"root:x:0:\nsandbox:x:{uid}:\n")
    _pivot_root(root)
    _mount(None, "/", None, MS_BIND | MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV)
    os.chdir(workdir)


# -- the command ----------------------------------------------------------------------


def call_uid(cfg: dict, host_pid: int) -> int:
    """The uid the command runs as, 0 to keep this one. As root: uid_base + the host pid
    of the process that outlives every other of the call (the init; the command itself
    without namespaces). No other process has that uid while the call runs, so calls
    cannot signal or write to each other, and RLIMIT_NPROC counts this call alone."""
    return cfg["uid_base"] + host_pid if cfg["uid_base"] else 0


def exec_command(cfg: dict, argv: list[str]) -> None:
    """Become the command: own the working dir and its files, drop to ``cfg["uid"]``,
    no new privileges, RLIMIT_NPROC, exec."""
    try:
        uid = cfg["uid"]
        if uid:
            for entry in [cfg["workdir"], *(e.path for e in os.scandir(cfg["workdir"]))]:
                os.chown(entry, uid, uid, follow_symlinks=False)
            os.chmod(cfg["workdir"], 0o700)
            os.setgroups([])
            os.setgid(uid)
            os.setuid(uid)
        libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0)
        resource.setrlimit(resource.RLIMIT_NPROC, (cfg["nproc"], cfg["nproc"]))
        for sig in (signal.SIGPIPE, signal.SIGXFSZ):  # ignored by Python; an exec keeps that
            signal.signal(sig, signal.SIG_DFL)
        os.execvp(argv[0], argv)
    except OSError as e:
        print(f"sandbox: cannot run {argv[0]}: {e.strerror}", file=sys.stderr, flush=True)
    os._exit(127)


def init(cfg: dict, argv: list[str], status_fd: int, lifeline: int) -> None:
    """PID 1 of the namespace: build the view, start the command, reap every orphan until
    the command exits, report its wait status on status_fd, exit (ending the namespace)."""
    _die_with_parent()
    os.set_blocking(lifeline, False)
    try:
        if os.read(lifeline, 1) == b"":  # the launcher died before PR_SET_PDEATHSIG held
            os._exit(SETUP_FAILED)
    except BlockingIOError:
        pass
    try:
        cfg["uid"] = call_uid(cfg, int(os.readlink("/proc/self")))  # the host's procfs, still
        build_root(cfg)
    except OSError as e:
        print(f"sandbox: cannot isolate the call: {e}", file=sys.stderr, flush=True)
        os._exit(SETUP_FAILED)
    command = os.fork()
    if command == 0:
        os.close(status_fd)
        os.close(lifeline)
        exec_command(cfg, argv)
    while True:
        pid, status = os.wait()
        if pid == command:
            break
    os.write(status_fd, str(status).encode())
    os._exit(0)


def exit_as(status: int) -> None:
    """End this process the way the wait status says the command ended."""
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        if sig not in (signal.SIGKILL, signal.SIGSTOP):
            signal.signal(sig, signal.SIG_DFL)
        libc.prctl(PR_SET_DUMPABLE, 0, 0, 0, 0)  # SIGXCPU, SIGSEGV, ...: no core of this process
        os.kill(os.getpid(), sig)
        os._exit(128 + sig)  # a signal whose default is not to terminate
    os._exit(os.waitstatus_to_exitcode(status))


def main() -> None:
    cfg, argv = json.loads(sys.argv[1]), sys.argv[2:]
    _die_with_parent()
    if os.getppid() != cfg["parent"]:  # the caller died before PR_SET_PDEATHSIG held
        os._exit(SETUP_FAILED)
    for lim, v in ((resource.RLIMIT_CPU, cfg["cpu"]), (resource.RLIMIT_AS, cfg["memory"]),
                   (resource.RLIMIT_FSIZE, cfg["fsize"]), (resource.RLIMIT_CORE, 0)):
        resource.setrlimit(lim, (v, v))
    try:
        mode = enter_namespaces()
    except OSError as e:
        print(f"sandbox: cannot isolate the call: {e}", file=sys.stderr, flush=True)
        os._exit(SETUP_FAILED)
    if mode != "full":
        cfg["uid"] = call_uid(cfg, os.getpid())
        exec_command(cfg, argv)
    status_r, status_w = os.pipe()
    lifeline_r, lifeline_w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(status_r)
        os.close(lifeline_w)
        init(cfg, argv, status_w, lifeline_r)
    os.close(status_w)
    os.close(lifeline_r)
    _, status = os.waitpid(pid, 0)
    reported = os.read(status_r, 32)
    exit_as(int(reported) if reported else status)


if __name__ == "__main__":
    main()
