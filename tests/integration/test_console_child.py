"""``expstore-server --http-port``: the console as the server's child process."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import urllib.error
import urllib.request

import pytest

pytest.importorskip("starlette")

from expstore.synthetic import trajectories  # noqa: E402
from expstore_client import Client  # noqa: E402

from ._util import unused_port, wait_until  # noqa: E402


def serve(tmp_path, *args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "expstore_server.main", "--port", "0", "--data-dir",
                             str(tmp_path / "data"), *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def child_pids(pid: int) -> list[int]:
    out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True, text=True).stdout
    return [int(p) for p in out.split()]


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return not open(f"/proc/{pid}/stat").read().split(")")[1].split()[0] == "Z"


def test_the_server_starts_its_console_and_stops_it(tmp_path):
    port = unused_port()
    (tmp_path / "c.toml").write_text(f"[server]\nhttp_port = {port}\n")
    proc = serve(tmp_path, "--config", str(tmp_path / "c.toml"))
    try:
        address = proc.stdout.readline().rsplit(" ", 1)[1].strip()
        assert proc.stdout.readline().strip() == f"expstore console on http://127.0.0.1:{port}"
        with Client(address) as c:
            c.create_table("rollouts")
            c.insert("rollouts", trajectories(5))
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/api/tables", timeout=30) as r:
            assert [t["num_items"] for t in json.load(r)["tables"]] == [5]
        [console] = child_pids(proc.pid)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
        assert wait_until(lambda: not alive(console), timeout=10)
    finally:
        proc.kill()
        proc.wait()


def test_a_killed_server_takes_its_console_along(tmp_path):
    port = unused_port()
    proc = serve(tmp_path, "--http-port", str(port))
    proc.stdout.readline()
    proc.stdout.readline()
    [console] = child_pids(proc.pid)
    proc.kill()
    proc.wait()
    assert wait_until(lambda: not alive(console), timeout=15)
    with pytest.raises(urllib.error.URLError):
        urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=5)


def test_a_console_port_in_use_stops_the_server_with_a_clear_error(tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        proc = serve(tmp_path, "--http-port", str(port))
        out, err = proc.communicate(timeout=120)
    assert proc.returncode == 1 and "listening" not in out
    assert f"cannot bind 127.0.0.1:{port}" in err
    assert f"expstore-server: cannot start the console on 127.0.0.1:{port}" in err
    again = serve(tmp_path)  # the data dir was released: a server starts on it
    try:
        assert again.stdout.readline().startswith("expstore-server listening on ")
    finally:
        again.kill()
        again.wait()
