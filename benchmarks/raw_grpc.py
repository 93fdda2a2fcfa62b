"""The raw gRPC ceiling: what grpcio alone moves on this machine, with no protobuf,
Arrow or engine in the way.

A tiny grpc.aio server (a subprocess on 127.0.0.1, port 0, the same channel options as
expstore-server) has two generic methods with identity (de)serializers, so messages
are opaque ``bytes``:

- ``Upload`` (client streaming): reads every message, answers the byte count.
- ``Put`` (unary): the same for a call of one message, as expstore's clients send an
  insert that fits one message (InsertUnary). gRPC moves a unary call in fewer steps than
  a client-streaming one of one message (measured here, 10,000 producers: ~4,300 calls/s
  against ~3,300, with less CPU a call on both sides).
- ``Download`` (server streaming): the request lists message sizes (uint64 LE); the
  server answers with prebuilt random messages of those sizes.

The client is a synchronous ``grpc.insecure_channel`` like expstore's ``Client``. One
call moves one batch split into the same messages expstore uses for it (see
``wire.batch_messages``), so expstore-vs-ceiling ratios compare the same bytes in the
same message sizes. Throughput = bytes of all calls / sum of call times.

The server sets glibc's malloc as expstore-server does by default (``tune_malloc``:
large freed buffers kept for reuse, two arenas). Left at glibc's defaults, it mapped every
~4.7 MB message buffer afresh and faulted it in: its upload of 256 rows of 36 KiB took
11.1-11.3 ms a call instead of 6.3-6.4 (same machine, alternating runs), a ceiling 1.75x
too low for the expstore server it is compared with, which keeps its buffers.

Run the server alone with ``python -m benchmarks.raw_grpc --serve``.
"""

from __future__ import annotations

import asyncio
import os
import sys
import time

import grpc
import numpy as np

from expstore_server.config import ServerConfig
from expstore_server.main import PENDING_CALLS, tune_malloc

from . import server as server_mod

SERVICE = "rawbench.Raw"
BANNER = "raw-grpc listening on "
MAX_MESSAGE_BYTES = 256 << 20
OPTIONS = [("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
           ("grpc.max_send_message_length", MAX_MESSAGE_BYTES)]


async def _serve() -> None:
    prebuilt: dict[int, bytes] = {}

    async def upload(request_iterator, context):
        total = 0
        async for message in request_iterator:
            total += len(message)
        return total.to_bytes(8, "little")

    async def put(message, context):
        return len(message).to_bytes(8, "little")

    async def download(request, context):
        for size in np.frombuffer(request, dtype="<u8").tolist():
            if size not in prebuilt:
                prebuilt[size] = os.urandom(size)
            yield prebuilt[size]

    handlers = {"Upload": grpc.stream_unary_rpc_method_handler(upload),
                "Put": grpc.unary_unary_rpc_method_handler(put),
                "Download": grpc.unary_stream_rpc_method_handler(download)}
    # expstore-server's PENDING_CALLS too: grpc's core refuses arrived calls at random past
    # 1,000 otherwise (a 10,000-call burst: ~3,700 errors), which is no ceiling to compare with
    server = grpc.aio.server(options=OPTIONS + PENDING_CALLS + [("grpc.so_reuseport", 0)])
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    print(f"{BANNER}127.0.0.1:{port}", flush=True)
    await server.wait_for_termination()


def start(env: dict[str, str] | None = None) -> server_mod.ServerProcess:
    return server_mod.start([sys.executable, "-m", "benchmarks.raw_grpc", "--serve"], BANNER, env)


class RawClient:
    def __init__(self, address: str) -> None:
        self._channel = grpc.insecure_channel(address, OPTIONS)
        self._upload = self._channel.stream_unary(f"/{SERVICE}/Upload")
        self._put = self._channel.unary_unary(f"/{SERVICE}/Put")
        self._download = self._channel.unary_stream(f"/{SERVICE}/Download")

    def upload(self, messages: list[bytes]) -> int:
        """One call of ``messages``: unary where there is one, as expstore's clients send
        an insert of one message (InsertUnary), else client streaming (Insert)."""
        if len(messages) == 1:
            return int.from_bytes(self._put(messages[0], timeout=60), "little")
        return int.from_bytes(self._upload(iter(messages), timeout=60), "little")

    def download(self, sizes: list[int]) -> int:
        request = np.asarray(sizes, dtype="<u8").tobytes()
        return sum(len(m) for m in self._download(request, timeout=60))

    def close(self) -> None:
        self._channel.close()


def rate(call, arg, batch_bytes: int, seconds: float, min_calls: int, *, rows: int | None = None) -> dict:
    """Repeat ``call(arg)`` (one batch) for ``seconds`` and at least ``min_calls`` times.
    ``call`` returns what it moved: the batch's bytes, or its ``rows`` where given (Flight)."""
    call(arg)  # warm-up
    expected = batch_bytes if rows is None else rows
    times = []
    start = time.perf_counter()
    while len(times) < min_calls or time.perf_counter() - start < seconds:
        t0 = time.perf_counter()
        moved = call(arg)
        times.append(time.perf_counter() - t0)
        assert moved == expected, (moved, expected)
    total = sum(times)
    out = {"calls": len(times), "batches_per_s": len(times) / total, "MB_per_s": batch_bytes * len(times) / total / 1e6}
    if rows is not None:
        out["items_per_s"] = rows * len(times) / total
    return out


def measure(client: RawClient, sizes: list[int], seconds: float, min_calls: int = 5) -> dict:
    """Upload and download throughput of batches made of messages of ``sizes`` bytes."""
    messages = [os.urandom(s) for s in sizes]
    return {"upload": rate(client.upload, messages, sum(sizes), seconds, min_calls),
            "download": rate(client.download, sizes, sum(sizes), seconds, min_calls)}


if __name__ == "__main__":
    if "--serve" in sys.argv:
        tune_malloc(ServerConfig())  # as expstore-server by default (module docstring)
        asyncio.run(_serve())
    else:
        import json
        with start() as srv:
            c = RawClient(srv.address)
            print(json.dumps({"8MiB+1MiB": measure(c, [8361128, 1112336], 3.0),
                              "77KB": measure(c, [77000], 3.0)}, indent=1))
            c.close()
