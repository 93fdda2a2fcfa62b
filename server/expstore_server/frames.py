"""RowsResponse messages with their rows: the small fields, then the Arrow IPC stream as
the length-delimited ``arrow_ipc`` field (``expstore_proto.framing``'s layout).

A large stream is joined into the message's bytes from the rows' own buffers
(``arrow_ipc.encode_pieces``): the rows are copied once. A module in C++ that wrote the
stream straight into the message did no better (a gRPC sample of 256 rows of 36 KiB:
server CPU 7.40-7.93 ms a call against 7.27-8.13 ms, three alternating runs each).
"""

from __future__ import annotations

import pyarrow as pa

from expstore_proto import arrow_ipc, framing
from expstore_proto.service import ROWS_PAYLOAD
from expstore_proto.v1 import expstore_pb2 as pb


def rows_message(meta: pb.RowsResponse, data: pa.RecordBatch | pa.Table, *, compress: bool = False) -> bytes:
    """``meta`` with ``data`` as its IPC stream (zstd-compressed buffers if ``compress``)."""
    return framing.encode(meta, ROWS_PAYLOAD, *arrow_ipc.encode_pieces(data, compress=compress))
