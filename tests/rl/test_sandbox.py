"""The sandbox's limits. Every misbehaving command here is bounded by itself too (the
fork bomb forks at most 64 times), so a broken limit cannot hurt the machine."""

import os
import socket

import pytest

from expstore_rl import sandbox
from expstore_rl.sandbox import PYTHON, Limits, run


def py(code: str, **limits) -> sandbox.SandboxResult:
    return run([PYTHON, "-I", "-S", "-c", code], limits=Limits(**limits))


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
    bomb = ("import os, time\nn = 0\nfor _ in range(64):\n    try:\n        pid = os.fork()\n"
            "    except OSError:\n        break\n    if pid == 0:\n        os.close(1); os.close(2)\n"
            "        time.sleep(60); os._exit(0)\n    n += 1\nprint(n, os.getpgid(0))\n")
    r = py(bomb, nproc=8)
    assert r.status == "ok"
    forked, pgid = map(int, r.output.split())
    # The limit is nobody's task count at the start + 8: sandboxes of other processes that
    # end meanwhile free a few slots, so allow some slack; unbounded it would reach 64.
    assert forked < 16
    with pytest.raises(ProcessLookupError):  # no child outlived the call
        os.killpg(pgid, 0)


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
