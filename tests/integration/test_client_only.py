"""A training environment with only the client: ``pip install ./client`` into a fresh
virtualenv (no system site-packages), then the README's trainer-side example and a
create/insert/sample/stream/query round trip against a real server run from that venv.

The venv installs the same grpcio, protobuf, pyarrow and numpy versions as this
environment, so pip takes them from its wheel cache (or the package index CI can reach).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from importlib import metadata
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
SERVER_ONLY = ["rocksdict", "lance", "duckdb", "torch", "expstore", "expstore_server", "expstore_rl"]

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def client_venv(tmp_path_factory) -> Iterator[Path]:
    """A fresh venv holding expstore-client and its dependencies, nothing else."""
    venv = tmp_path_factory.mktemp("client-venv") / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    pins = [f"{name}=={metadata.version(name)}" for name in ("grpcio", "protobuf", "pyarrow", "numpy")]
    p = subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "install", "-q", "--disable-pip-version-check",
                        str(ROOT / "client"), *pins], capture_output=True, text=True, timeout=900, env=_bare_env())
    assert p.returncode == 0, p.stdout + p.stderr
    yield venv / "bin" / "python"
    shutil.rmtree(venv)  # ~300 MB: not kept until the session ends


def _bare_env() -> dict[str, str]:
    """This process's environment without the source paths of the checkout."""
    return {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}


def run_in(python: Path, code: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([str(python), "-c", code], capture_output=True, text=True, timeout=300, cwd=cwd,
                          env=_bare_env())


def test_the_client_venv_holds_no_server_dependency(client_venv, tmp_path):
    code = textwrap.dedent(f"""
        import importlib.util, json
        print(json.dumps({{m: importlib.util.find_spec(m) is not None for m in {SERVER_ONLY!r}}}))
    """)
    p = run_in(client_venv, code, tmp_path)
    assert p.returncode == 0, p.stderr
    assert json.loads(p.stdout) == {m: False for m in SERVER_ONLY}
    p = run_in(client_venv, "import expstore_client, expstore_proto; print(expstore_client.__file__)", tmp_path)
    assert p.returncode == 0, p.stderr
    assert "site-packages" in p.stdout  # the installed distribution, not the checkout


def test_the_readme_trainer_example_runs_with_the_client_only(client_venv, server_factory, tmp_path):
    server = server_factory()
    section = README.read_text().split("## In a training environment: the client only", 1)[1]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    p = run_in(client_venv, code.replace("127.0.0.1:50051", server.address), tmp_path)
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip() == "['t-0'] [11 12 13 14]"


def test_create_insert_sample_stream_query_from_the_client_venv(client_venv, server_factory, tmp_path):
    server = server_factory()
    code = textwrap.dedent(f"""
        import json
        from expstore_client import Client

        c = Client({server.address!r})
        rows = [{{"traj_id": f"t-{{i}}", "prompt_id": "p", "group_id": "g", "group_size": 4, "task": "math",
                  "policy_version": 0, "tokens": [1, 2, 3 + i], "loss_mask": [0, 1, 1],
                  "logprobs": [0.0, -0.5, -0.25], "reward": float(i), "finish_reason": "stop"}} for i in range(4)]
        c.create_table("groups", sampler={{"type": "group", "group_size": 4}})
        c.create_table("queue", sampler="fifo")
        out = {{"inserted": c.insert("groups", rows).num_inserted}}
        c.insert("queue", rows)
        batch = c.sample("groups", 4)
        out["sampled"] = sorted(batch.column("traj_id").to_pylist())
        streamed = []
        for b in c.stream("queue", group="trainer", batch_size=3, idle_timeout=1.0):
            streamed += b.column("traj_id").to_pylist()
            b.ack()
        out["streamed"] = streamed
        q = c.query_table("SELECT count(*) AS n, sum(reward) AS r FROM groups")
        out["query"] = [q.column("n")[0].as_py(), q.column("r")[0].as_py()]
        try:
            batch.to_torch()
        except ImportError as e:
            out["to_torch"] = "ImportError"
        from expstore_client.sharded import ShardedClient
        try:  # reward audits run expstore.audit, which ships with the server
            ShardedClient.audit(object.__new__(ShardedClient), "groups", "m:f")
        except ImportError as e:
            out["audit"] = "expstore distribution" in str(e)
        print(json.dumps(out))
    """)
    p = run_in(client_venv, code, tmp_path)
    assert p.returncode == 0, p.stderr
    assert json.loads(p.stdout) == {"inserted": 4, "sampled": ["t-0", "t-1", "t-2", "t-3"],
                                    "streamed": ["t-0", "t-1", "t-2", "t-3"], "query": [4, 6.0],
                                    "to_torch": "ImportError", "audit": True}
