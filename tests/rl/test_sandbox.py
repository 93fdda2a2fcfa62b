"""The sandbox's limits and isolation. Every misbehaving command here is bounded by itself
too (the fork bomb forks at most 64 times, a daemon sleeps 30 s), so a broken limit cannot
hurt the machine. Isolation tests skip only where ``sandbox.isolation()`` finds that this
machine cannot give the guarantee (CI runs as root, where every one holds)."""

import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

import pytest

from expstore_rl import sandbox
from expstore_rl.sandbox import PYTHON, Limits, run


def py(code: str, **limits) -> sandbox.SandboxResult:
    return run([PYTHON, "-I", "-S", "-c", code], limits=Limits(**limits))


def needs(guarantee: str) -> None:
    if guarantee not in sandbox.isolation():
        pytest.skip(f"this machine cannot isolate {guarantee}; the sandbox documents it as not enforced")


def host_processes_with(marker: str) -> list[int]:
    """Host pids whose command line contains marker."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if marker.encode() in cmdline:
            found.append(int(pid))
    return found


def test_ok_with_stdin_and_a_temporary_working_dir():
    r = run([PYTHON, "-I", "-S", "-c", "import os, sys; print(sys.stdin.read()[::-1], os.getcwd())"], stdin="abc")
    assert r.status == "ok" and r.returncode == 0
    out, cwd = r.output.split()
    assert out == "cba" and "expstore-sandbox-" in cwd
    assert not os.path.exists(cwd)  # removed afterwards


def test_error_exit():
    r = py("raise SystemExit(3)")
    assert (r.status, r.returncode) == ("error", 3)


def test_wall_clock_timeout_kills_a_sleeper():
    r = py("import time\nprint('started', flush=True)\ntime.sleep(60)", wall_s=0.5)
    assert r.status == "timeout" and r.output == "started\n"


def test_cpu_limit_kills_a_spinner():
    r = py("while True: pass", cpu_s=1, wall_s=30)
    assert r.status == "killed" and r.returncode < 0


def test_memory_limit():
    r = py("x = bytearray(1 << 30)\nprint('allocated')", memory_bytes=256 << 20)
    assert r.status == "error" and "MemoryError" in r.output and "allocated" not in r.output


def test_file_size_limit():
    r = py("open('big', 'w').write('x' * (2 << 20))", file_bytes=1 << 20)
    assert r.status == "error" and "File too large" in r.output


def test_fork_bomb_is_bounded_by_the_process_limit_and_killed_with_its_group():
    marker = f"bomb-{uuid.uuid4().hex}"  # in the code, hence in every child's command line
    bomb = (f"# {marker}\nimport os, time\nn = 0\nfor _ in range(64):\n    try:\n        pid = os.fork()\n"
            "    except OSError:\n        break\n    if pid == 0:\n        os.close(1); os.close(2)\n"
            "        time.sleep(60); os._exit(0)\n    n += 1\nprint(n)\n")
    r = py(bomb, nproc=8)
    assert r.status == "ok"
    # As root the call has a uid of its own: exactly 8 tasks. Otherwise the limit is the
    # user's task count at the start + 8, and processes of the user that end meanwhile free
    # a few slots, so allow some slack; unbounded it would reach 64.
    assert int(r.output) < 16
    assert host_processes_with(marker) == []  # no child outlived the call


def daemon_then(marker: str, then: str) -> str:
    """Python code that starts a detached daemon (setsid + double fork, stdio closed,
    sleeping 30 s), prints 'detached' and then runs ``then``."""
    return (f"# {marker}\nimport os, time\nif os.fork() == 0:\n    os.setsid()\n    if os.fork() == 0:\n"
            "        os.close(0); os.close(1); os.close(2)\n        time.sleep(30)\n    os._exit(0)\n"
            f"os.wait()\nprint('detached', flush=True)\n{then}\n")


@pytest.mark.parametrize("then, status", [
    ("", "ok"),
    ("time.sleep(60)", "timeout"),
    ("while True: print('x' * 1000)", "output_truncated"),
    ("os.kill(os.getpid(), 9)", "killed"),
])
def test_a_setsid_double_forked_daemon_dies_with_the_call(then, status):
    needs("processes")
    marker = f"daemon-{uuid.uuid4().hex}"
    r = py(daemon_then(marker, then))
    assert r.status == status and r.output.startswith("detached\n")
    assert host_processes_with(marker) == []  # gone before run returned


def test_the_call_tree_dies_with_the_process_that_called_run():
    needs("processes")
    marker = f"daemon-{uuid.uuid4().hex}"
    caller = subprocess.Popen([sys.executable, "-c", "import sys\nfrom expstore_rl.sandbox import PYTHON, Limits, run\n"
                               "run([PYTHON, '-I', '-S', '-c', sys.argv[1]], limits=Limits(wall_s=120))",
                               daemon_then(marker, "time.sleep(60)")])
    try:
        deadline = time.monotonic() + 60
        while len(host_processes_with(marker)) < 2:  # the command and its daemon
            assert time.monotonic() < deadline and caller.poll() is None
            time.sleep(0.05)
    finally:
        caller.kill()  # a producer killed mid-call
        caller.wait()
        for box in Path(tempfile.gettempdir()).glob(f"expstore-sandbox-{caller.pid}-*"):
            shutil.rmtree(box)  # a killed caller cannot remove its call's dir; the dir's name says whose it is
    deadline = time.monotonic() + 10  # the kernel tears the namespace down, asynchronously (the
    # daemon sleeps 30 s, the command 60 s: unkilled, either would outlive this wait)
    while host_processes_with(marker) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert host_processes_with(marker) == []


def test_proc_shows_only_the_calls_own_processes():
    needs("processes")
    secret = f"--token=secret-{uuid.uuid4().hex}"
    host = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)", secret])
    try:
        r = py("import os\npids = sorted(p for p in os.listdir('/proc') if p.isdigit())\nseen = b''\n"
               "for p in pids:\n    try:\n        seen += open(f'/proc/{p}/cmdline', 'rb').read()\n"
               "    except OSError:\n        pass\n"
               f"print(pids, {secret[::-1]!r}[::-1].encode() in seen)")  # not in its own command line
    finally:
        host.kill()
        host.wait()
    assert (r.status, r.output) == ("ok", "['1', '2'] False\n")  # the init (1) and the command itself (2)


def test_tmp_and_dev_shm_are_private_to_the_call():
    needs("filesystem")
    name = f"expstore-test-{uuid.uuid4().hex}"
    leaked = [Path("/tmp") / name, Path("/dev/shm") / name]
    try:
        r = py(f"for d in ('/tmp', '/dev/shm'):\n    open(f'{{d}}/{name}', 'w').write('x')\nprint('wrote')")
        assert (r.status, r.output) == ("ok", "wrote\n")
        assert [p.exists() for p in leaked] == [False, False]  # not on the host
        again = py(f"import os\nprint([os.path.exists(f'{{d}}/{name}') for d in ('/tmp', '/dev/shm')])")
        assert again.output == "[False, False]\n"  # nor in the next call
    finally:
        for p in leaked:
            p.unlink(missing_ok=True)


def test_concurrent_calls_cannot_see_or_rewrite_each_others_files():
    needs("filesystem")
    mark = f"mark-{uuid.uuid4().hex}"
    # the victim leaves a file in its working dir and in /tmp, then watches both for 3 s
    victim = (f"import os, time\nfor p in ('{mark}', '/tmp/{mark}'):\n    open(p, 'w').write('mine')\n"
              "    os.chmod(p, 0o666)\nend = time.time() + 3\nwhile time.time() < end:\n"
              f"    if {{open(p).read() for p in ('{mark}', '/tmp/{mark}')}} != {{'mine'}}:\n"
              "        print('rewritten'); break\n    time.sleep(0.05)\nelse:\n    print('intact')\n")
    # the attacker looks for them for 3 s, wherever a call's files may be, and rewrites them
    attacker = (f"import glob, time\nend = time.time() + 3\nfound = []\nwhile not found and time.time() < end:\n"
                f"    found = glob.glob('/tmp/{mark}') + glob.glob('/tmp/**/{mark}', recursive=True)"
                f" + glob.glob('/var/tmp/**/{mark}', recursive=True)\n    time.sleep(0.05)\n"
                "for p in found:\n    open(p, 'w').write('theirs')\nprint(len(found))\n")
    results = {}
    threads = [threading.Thread(target=lambda k=k, c=c: results.__setitem__(k, py(c, wall_s=10)))
               for k, c in (("victim", victim), ("attacker", attacker))]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        Path("/tmp", mark).unlink(missing_ok=True)
    assert (results["victim"].status, results["victim"].output) == ("ok", "intact\n")
    assert (results["attacker"].status, results["attacker"].output) == ("ok", "0\n")


def test_world_readable_host_files_are_invisible():
    needs("filesystem")
    with tempfile.TemporaryDirectory() as d:
        os.chmod(d, 0o755)
        host_file = Path(d) / "data.txt"
        host_file.write_text("host data")
        host_file.chmod(0o644)
        project_file = Path(__file__).resolve()  # the project tree
        checks = "".join(f"print(os.path.exists({str(p)!r}), flush=True)\n" for p in (host_file, project_file))
        r = py("import os\n" + checks + "open('/escape', 'w')\n")
    assert r.status == "error" and r.output.startswith("False\nFalse\n")
    assert "Read-only file system" in r.output  # / is read-only; only the working dir is writable


def test_output_flood_is_truncated():
    r = py("while True: print('x' * 1000)", output_bytes=4096)
    assert r.status == "output_truncated" and len(r.output) == 4096


def test_no_writes_outside_the_working_dir(tmp_path):
    target = tmp_path / "escape"
    r = py(f"open({str(target)!r}, 'w').write('x')")
    assert r.status == "error" and not target.exists()


def test_no_network():
    if not sandbox.network_isolated():
        pytest.skip("this machine does not allow network namespaces; the sandbox documents it as not enforced")
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        port = server.getsockname()[1]
        r = py(f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=2)\nprint('connected')")
    assert r.status == "error" and "connected" not in r.output


def test_a_command_that_cannot_start_is_a_result_not_an_exception():
    r = run(["/nonexistent/tool"])
    assert r.status == "error" and r.returncode != 0


AS_A_USER = """
import os, sys
sys.path.insert(0, sys.argv[1])
from expstore_rl import sandbox
print(sorted(sandbox.isolation()))
daemon = ("# " + sys.argv[2] + "\\nimport os, time\\nif os.fork() == 0:\\n    os.setsid()\\n    if os.fork() == 0:\\n"
          "        os.close(0); os.close(1); os.close(2)\\n        time.sleep(30)\\n    os._exit(0)\\n")
print(sandbox.run([sandbox.PYTHON, "-I", "-S", "-c", daemon]).status)
"""


AS_NOBODY = [PYTHON, "-I", "-S", "-c", "import os, sys; os.setgroups([]); os.setgid(65534); os.setuid(65534); "
             "os.execv(sys.argv[1], sys.argv[1:])"]
"""A prefix that runs a command as nobody. The uid is changed by a fresh interpreter, not by
``subprocess``'s ``user=``: that forks this process (no vfork when the uid changes), and a
fork of a process whose gRPC threads are live can leave the child with a broken epoll fd."""


def test_without_root_a_user_namespace_gives_the_same_isolation():
    """What an unprivileged user gets, where the kernel allows user namespaces: the same
    guarantees (checked here as nobody, started by root)."""
    if os.geteuid() != 0:
        pytest.skip("needs root to start a process as another user")
    rl_dir = Path(sandbox.__file__).resolve().parent.parent
    as_nobody = dict(cwd="/", env={"PATH": "/usr/bin:/bin"})
    unshare = "import ctypes; print(ctypes.CDLL(None).unshare(0x10000000))"
    userns = subprocess.run(AS_NOBODY + [PYTHON, "-I", "-S", "-c", unshare], capture_output=True, text=True,
                            **as_nobody)
    readable = all(os.stat(p).st_mode & 0o001 for p in (rl_dir, *rl_dir.parents))
    if userns.stdout.strip() != "0" or not readable:
        pytest.skip("no unprivileged user namespaces here, or this checkout is not readable by nobody")
    marker = f"daemon-{uuid.uuid4().hex}"
    r = subprocess.run(AS_NOBODY + [PYTHON, "-I", "-c", AS_A_USER, str(rl_dir), marker], capture_output=True,
                       text=True, timeout=60, **as_nobody)
    assert r.stdout == "['filesystem', 'network', 'processes']\nok\n", r.stderr
    assert host_processes_with(marker) == []
