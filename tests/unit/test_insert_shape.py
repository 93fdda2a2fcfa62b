"""Which call an insert goes in: an insert of one message as a unary InsertUnary where the
server takes it (``ServerInfo.insert_unary``), one of several as a streaming Insert
(``_codec.only_message``), its messages encoded lazily."""

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


async def _insert_into_a_server_serving(methods: list[str], message_bytes: int,
                                        info: pb.ServerInfo | None = None) -> list[tuple[str, int]]:
    """An AsyncClient's insert of 8 rows into a scripted server that serves ``methods``
    alone (any other is UNIMPLEMENTED), and ``GetServerInfo`` with ``info`` where given;
    the method and the number of messages of each insert call it served."""
    seen: list[tuple[str, int]] = []

    async def unary(request, context):
        seen.append(("InsertUnary", 1))
        return pb.InsertResponse(item_ids=[1], num_inserted=1)

    async def stream(request_iterator, context):
        seen.append(("Insert", len([m async for m in request_iterator])))
        return pb.InsertResponse(item_ids=[1], num_inserted=1)

    async def server_info(request, context):
        return info

    behaviours = {"InsertUnary": (grpc.unary_unary_rpc_method_handler, unary),
                  "Insert": (grpc.stream_unary_rpc_method_handler, stream),
                  "GetServerInfo": (grpc.unary_unary_rpc_method_handler, server_info)}
    served = methods + (["GetServerInfo"] if info is not None else [])
    handlers = {}
    for name in served:
        make, behaviour = behaviours[name]
        handlers[name] = make(behaviour, request_deserializer=METHODS[name].deserialize_request,
                              response_serializer=METHODS[name].serialize_response)
    server = grpc.aio.server()
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),))
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


CURRENT = pb.ServerInfo(insert_unary=True)


@pytest.mark.parametrize("methods, message_bytes, info, expected", [
    (["InsertUnary"], 8 << 20, CURRENT, ("InsertUnary", 1)),  # one message: unary
    (["Insert"], 4096, CURRENT, ("Insert", "several")),  # several: one stream
    # servers older than InsertUnary: a stream of one, whether or not they have GetServerInfo
    (["Insert"], 8 << 20, pb.ServerInfo(), ("Insert", 1)),
    (["Insert"], 8 << 20, None, ("Insert", 1)),
])
def test_a_client_sends_an_insert_of_one_message_unary_where_the_server_takes_it(methods, message_bytes, info,
                                                                                  expected):
    seen = asyncio.run(_insert_into_a_server_serving(methods, message_bytes, info))
    assert len(seen) == 1, seen  # one call, which the scripted server served
    method, messages = seen[0]
    assert method == expected[0] and (messages > 1 if expected[1] == "several" else messages == expected[1]), seen
