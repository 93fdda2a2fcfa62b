"""Shared fixtures: a real expstore-server in a subprocess on loopback."""

from __future__ import annotations

import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
import threading
from dataclasses import dataclass
from pathlib import Path

import pytest

# Every Ray cluster a test starts (TransferQueue's, the launcher's, verl's) takes 127.0.0.1
# as its node address, not the machine's other one: Ray reads this once, at `import ray`,
# and test modules import ray when they are collected.
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")


@dataclass
class ServerProcess:
    proc: subprocess.Popen
    address: str
    data_dir: Path
    stderr_lines: list[str]

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        return self.proc.wait(timeout)

    @property
    def log(self) -> str:
        return "".join(self.stderr_lines)


def unused_port(span: int = 1) -> int:
    """A port, and the ``span - 1`` after it, free now and below the kernel's ephemeral
    range, for a server told which port to bind. A port taken from the ephemeral range
    (bind to 0, close) may be handed to another socket before the server binds it: a
    connection's local port, or a listener on port 0 of a suite running beside this one
    (seen: "cannot bind metrics ...: Address already in use")."""
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    rng = random.Random()
    while True:
        port = rng.randrange(max(1024, low - 12000), low - span)
        try:
            for p in range(port, port + span):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", p))
        except OSError:
            continue
        return port


def restartable_port() -> str:
    """A port for a server that a test kills and starts again at the same address: its
    gRPC port and Flight's (the next one). A server on ``--port 0`` gets an ephemeral
    port; killed, its two ports went back to that range, and a process of a suite running
    beside this one took one before the restart (seen: "Address already in use" for the
    Flight port)."""
    return str(unused_port(2))


def start_server(data_dir: Path, config: str | None = None, *args: str, env: dict | None = None) -> ServerProcess:
    """Start expstore-server on a free port; return once it prints its address."""
    cmd = [sys.executable, "-m", "expstore_server.main", "--port", "0", "--data-dir", str(data_dir), *args]
    if config is not None:
        path = data_dir.parent / f"{data_dir.name}.toml"
        path.write_text(textwrap.dedent(config))
        cmd += ["--config", str(path)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, **(env or {})})
    stderr_lines: list[str] = []
    threading.Thread(target=lambda: stderr_lines.extend(proc.stderr), daemon=True).start()
    line = proc.stdout.readline()
    if not line.startswith("expstore-server listening on "):
        proc.kill()
        proc.wait()
        raise RuntimeError(f"server did not start: {line!r} {''.join(stderr_lines)}")
    threading.Thread(target=proc.stdout.read, daemon=True).start()
    return ServerProcess(proc, line.rsplit(" ", 1)[1].strip(), data_dir, stderr_lines)


@pytest.fixture
def server_factory(tmp_path):
    started: list[ServerProcess] = []

    def make(config: str | None = None, *args: str, env: dict | None = None) -> ServerProcess:
        s = start_server(tmp_path / f"data{len(started)}", config, *args, env=env)
        started.append(s)
        return s

    yield make
    for s in started:
        if s.proc.poll() is None:
            s.proc.kill()
            s.proc.wait()


@pytest.fixture(scope="session")
def shared_server():
    """One server for the many tests that only need an empty table of their own."""
    with tempfile.TemporaryDirectory() as tmp:
        s = start_server(Path(tmp) / "data")
        yield s
        s.stop(signal.SIGKILL)


@pytest.fixture
def client(shared_server):
    from expstore_client import Client

    c = Client(shared_server.address)
    yield c
    c.close()


@pytest.fixture
def stub(shared_server):
    """A raw gRPC stub of the shared server: requests go as written, without the client's checks."""
    import grpc

    from expstore_proto.v1 import expstore_pb2_grpc

    channel = grpc.insecure_channel(shared_server.address)
    yield expstore_pb2_grpc.ExperienceStoreStub(channel)
    channel.close()


@pytest.fixture
def table_name(request):
    """A table name unique to the test (tables live on the shared server)."""
    return "t_" + "".join(ch if ch.isalnum() else "_" for ch in request.node.name)[:100]


@pytest.fixture
def drop(client):
    """Tables to drop when the test ends: ``drop(name)`` after creating one."""
    names = []
    yield names.append
    for name in names:
        client.drop_table(name)


@pytest.fixture
def small_disk(tmp_path):
    """``small_disk(mib)``: a directory on a tmpfs of that size (a real filesystem that
    fills up: ENOSPC, statvfs), unmounted after the test. Needs root (mount); skips
    without it."""
    mounts: list[Path] = []

    def make(mib: int) -> Path:
        path = tmp_path / f"disk{len(mounts)}"
        path.mkdir()
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={mib}m", "tmpfs", str(path)],
                              capture_output=True, text=True)
        if done.returncode != 0:
            pytest.skip(f"a small disk needs mount -t tmpfs (root): {done.stderr.strip()}")
        mounts.append(path)
        return path

    yield make
    for path in mounts:
        subprocess.run(["umount", "-l", str(path)], check=False)


# --- S3: a moto server on loopback for the remote tier (tests/s3server.py) -------------------

@pytest.fixture(scope="session")
def s3_server():
    """A moto S3 server for the session: ``.endpoint``, ``.bucket()`` (a fresh bucket's name),
    ``.lance_options`` and ``.fsspec_options`` (storage options for Lance and s3fs), ``.config``."""
    import s3server  # tests/ is on sys.path (conftest rootdir, prepend import mode)

    s = s3server.start()
    yield s
    s.stop()

# --- end S3 ----------------------------------------------------------------------------------
