"""Which call an insert goes in: an insert of one message as a unary InsertUnary, one of
several as a streaming Insert (``_codec.only_message``), its messages encoded lazily."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from expstore.synthetic import trajectories
from expstore_client import AsyncClient, _codec
from expstore_proto.service import METHODS, SERVICE
from expstore_proto.v1 import expstore_pb2 as pb


def counted(messages: list[bytes], taken: list[int]):
    for m in messages:
        taken.append(1)
        yield m


def test_one_message_goes_alone_and_several_go_as_a_stream_in_order():
    only, rest = _codec.only_message(iter([b"a"]))
    assert (only, list(rest)) == (b"a", [])
    taken: list[int] = []
    only, rest = _codec.only_message(counted([b"a", b"b", b"c", b"d"], taken))
    assert only is None and len(taken) == 2  # the rest are encoded as gRPC sends them
    assert list(rest) == [b"a", b"b", b"c", b"d"]
    only, rest = _codec.only_message(iter(()))
    assert only is None and list(rest) == []  # the server's error: no message


async def _insert_into_a_server_serving_only(method: str, message_bytes: int) -> list[int]:
    """An AsyncClient's insert of 8 rows into a scripted server that serves ``method``
    alone (any other is UNIMPLEMENTED); the number of messages each call brought."""
    seen: list[int] = []

    async def unary(request, context):
        seen.append(1)
        return pb.InsertResponse(item_ids=[1], num_inserted=1)

    async def stream(request_iterator, context):
        seen.append(len([m async for m in request_iterator]))
        return pb.InsertResponse(item_ids=[1], num_inserted=1)

    m = METHODS[method]
    make = grpc.unary_unary_rpc_method_handler if method == "InsertUnary" else grpc.stream_unary_rpc_method_handler
    handler = make(unary if method == "InsertUnary" else stream, request_deserializer=m.deserialize_request,
                   response_serializer=m.serialize_response)
    server = grpc.aio.server()
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, {method: handler}),))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        client = AsyncClient(f"127.0.0.1:{port}", flight=False, message_bytes=message_bytes)
        try:
            await client.insert("t", trajectories(8))
        finally:
            await client.close()
    finally:
        await server.stop(None)
    return seen


@pytest.mark.parametrize("method, message_bytes", [("InsertUnary", 8 << 20), ("Insert", 4096)])
def test_a_client_sends_an_insert_of_one_message_unary_and_one_of_several_as_a_stream(method, message_bytes):
    seen = asyncio.run(_insert_into_a_server_serving_only(method, message_bytes))
    assert len(seen) == 1, seen  # one call, which the scripted server served
    assert seen[0] == 1 if method == "InsertUnary" else seen[0] > 1, seen
