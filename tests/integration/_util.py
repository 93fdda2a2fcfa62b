"""Helpers shared by the integration tests (no fixtures here)."""

from __future__ import annotations

import importlib.util
import json
import sys
import time
from pathlib import Path
from typing import Any, Callable

import grpc
import numpy as np
import pyarrow as pa
import pytest

from expstore_proto import arrow_ipc
from expstore_proto.v1 import expstore_pb2 as pb
from expstore_proto.v1 import expstore_pb2_grpc as pb_grpc
from expstore.synthetic import trajectories
from certs import self_signed

__all__ = ["pb", "pb_grpc", "arrow_ipc", "trajectories", "start_server", "restartable_port", "unused_port", "rpc_error",
           "raw_stub", "stored_traj_ids", "with_loss_mask", "num_items", "audit_lines", "wait_until", "insert_requests", "ipc_bytes", "self_signed"]


def _root_conftest():
    # tests/conftest.py, loaded under its own name (the module "conftest" is pytest's).
    path = Path(__file__).resolve().parent.parent / "conftest.py"
    spec = importlib.util.spec_from_file_location("_expstore_tests_root_conftest", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


_root = _root_conftest()
start_server, restartable_port, unused_port = _root.start_server, _root.restartable_port, _root.unused_port


def rpc_error(fn: Callable[[], Any], code: grpc.StatusCode | None = None) -> grpc.RpcError:
    """Run ``fn``; it must fail with an RpcError (of ``code`` when given). Returns it."""
    with pytest.raises(grpc.RpcError) as info:
        fn()
    err = info.value
    if code is not None:
        assert err.code() == code, f"expected {code}, got {err.code()}: {err.details()}"
    return err


def raw_stub(address: str, credentials: grpc.ChannelCredentials | None = None):
    """(channel, stub) without any client-side checks."""
    channel = grpc.secure_channel(address, credentials) if credentials else grpc.insecure_channel(address)
    return channel, pb_grpc.ExperienceStoreStub(channel)


def with_loss_mask(table: pa.Table, row: int, token: int, value: int) -> pa.Table:
    """``table`` with loss_mask[row][token] set to ``value`` (e.g. 2: invalid)."""
    masks = table.column("loss_mask").to_pylist()
    masks[row][token] = value
    i = table.schema.get_field_index("loss_mask")
    return table.set_column(i, table.schema.field(i), pa.array(masks, pa.list_(pa.uint8())))


def num_items(client, table: str) -> int:
    return client.describe(table).num_items


def audit_lines(data_dir: Path) -> list[dict]:
    path = data_dir / "audit.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def wait_until(predicate: Callable[[], bool], timeout: float = 5.0, interval: float = 0.02) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return predicate()


def ipc_bytes(data: pa.Table | pa.RecordBatch, compress: bool = False) -> bytes:
    """An Arrow IPC stream of ``data`` as plain bytes (what InsertRequest.arrow_ipc holds)."""
    sink = pa.BufferOutputStream()
    options = pa.ipc.IpcWriteOptions(compression="zstd" if compress else None)
    with pa.ipc.new_stream(sink, data.schema, options=options) as writer:
        writer.write(data)
    return sink.getvalue().to_pybytes()


def insert_requests(table: str, parts: list[pa.Table], **first: Any) -> list[pb.InsertRequest]:
    """Raw insert messages, one per part; ``first`` sets fields of the first message."""
    out = []
    for i, part in enumerate(parts):
        req = pb.InsertRequest(arrow_ipc=ipc_bytes(part))
        if i == 0:
            req.table = table
            for k, v in first.items():
                setattr(req, k, v)
        out.append(req)
    return out


def tokens_by_traj(table: pa.Table) -> dict[str, list[int]]:
    return dict(zip(table.column("traj_id").to_pylist(), table.column("tokens").to_pylist()))


def as_numpy_rows(values: np.ndarray, offsets: np.ndarray) -> list[list[int]]:
    return [values[offsets[i]:offsets[i + 1]].tolist() for i in range(len(offsets) - 1)]


def stored_traj_ids(client, table: str, group: str) -> list[str]:
    """Every stored trajectory's traj_id, read once through a fresh consumer group."""
    out: list[str] = []
    for batch in client.stream(table, group, 512, poll_timeout=0.5, idle_timeout=1.0):
        out += batch.column("traj_id").to_pylist()
    return out
