"""The raw Arrow Flight ceiling: what ``pyarrow.flight`` alone moves on this machine, with
no engine in the way (the Flight counterpart of ``raw_grpc``).

A trivial Flight server (a subprocess on 127.0.0.1, port 0):

- ``DoPut``: reads every record batch of the upload and drops it.
- ``DoGet``: the ticket names a prebuilt table (uploaded once by ``DoPut`` with the
  descriptor path ``["keep", name]``) and streams it back.

The client uploads and downloads the same 256-row table expstore's wire benchmark
inserts and samples, as Flight moves it (record batches, no protobuf). Throughput =
batches of all calls / sum of call times, one call at a time. The server sets glibc's
malloc as expstore-server does by default (see ``raw_grpc``).

Run the server alone with ``python -m benchmarks.raw_flight --serve``.
"""

from __future__ import annotations

import sys

import pyarrow as pa
import pyarrow.flight as fl

from expstore_server.config import ServerConfig
from expstore_server.main import tune_malloc

from . import server as server_mod

BANNER = "raw-flight listening on "


class _Server(fl.FlightServerBase):
    def __init__(self) -> None:
        super().__init__("grpc://127.0.0.1:0")
        self.kept: dict[bytes, pa.Table] = {}

    def do_put(self, context, descriptor, reader, writer):
        table = reader.read_all()  # every batch received, as an expstore DoPut does
        if descriptor.path and descriptor.path[0] == b"keep":
            self.kept[descriptor.path[1]] = table

    def do_get(self, context, ticket):
        return fl.RecordBatchStream(self.kept[ticket.ticket])


def _serve() -> None:
    tune_malloc(ServerConfig())  # as expstore-server by default (raw_grpc's docstring)
    server = _Server()
    print(f"{BANNER}127.0.0.1:{server.port}", flush=True)
    server.serve()


def start(env: dict[str, str] | None = None) -> server_mod.ServerProcess:
    return server_mod.start([sys.executable, "-m", "benchmarks.raw_flight", "--serve"], BANNER, env)


class RawFlightClient:
    def __init__(self, address: str) -> None:
        self._client = fl.connect(f"grpc://{address}")

    def keep(self, name: str, table: pa.Table) -> None:
        """Store ``table`` on the server under ``name``, for ``download``."""
        writer, _ = self._client.do_put(fl.FlightDescriptor.for_path("keep", name), table.schema)
        writer.write_table(table)
        writer.close()

    def upload(self, table: pa.Table) -> int:
        writer, _ = self._client.do_put(fl.FlightDescriptor.for_path("drop"), table.schema)
        writer.write_table(table)
        writer.close()
        return table.num_rows

    def download(self, name: str) -> int:
        return self._client.do_get(fl.Ticket(name.encode())).read_all().num_rows

    def close(self) -> None:
        self._client.close()


if __name__ == "__main__":
    if "--serve" in sys.argv:
        _serve()
