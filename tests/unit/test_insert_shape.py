"""Which call an insert goes in: an insert of one message as a unary InsertUnary where the
server takes it (``ServerInfo.insert_unary``), one of several as a streaming Insert
(``_codec.only_message``), its messages encoded lazily."""

from __future__ import annotations

import asyncio
import contextlib

import grpc
import pytest

from expstore.synthetic import trajectories
from expstore_client import AsyncClient, _codec, merge
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


@contextlib.asynccontextmanager
async def _scripted_server(behaviours: dict):
    """A grpc.aio server of the ExperienceStore service that serves the methods named in
    ``behaviours`` by those coroutines (any other is UNIMPLEMENTED); its address."""
    handlers = {}
    for name, behaviour in behaviours.items():
        make = grpc.stream_unary_rpc_method_handler if name == "Insert" else grpc.unary_unary_rpc_method_handler
        handlers[name] = make(behaviour, request_deserializer=METHODS[name].deserialize_request,
                              response_serializer=METHODS[name].serialize_response)
    server = grpc.aio.server()
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        yield f"127.0.0.1:{port}"
    finally:
        await server.stop(None)


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

    behaviours = {"InsertUnary": unary, "Insert": stream, "GetServerInfo": server_info}
    served = methods + (["GetServerInfo"] if info is not None else [])
    async with _scripted_server({name: behaviours[name] for name in served}) as address:
        async with AsyncClient(address, flight=False, message_bytes=message_bytes) as client:
            await client.insert("t", trajectories(8))
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


def crowd(n: int) -> list:
    return [trajectories(8, seed=i, id_prefix=f"c{i}") for i in range(n)]


async def _concurrent_inserts(info: pb.ServerInfo, batches: list) -> tuple[list[list[int]], list]:
    """A warm-up insert, then ``batches`` at once, of one AsyncClient into a scripted
    server that says ``info``; the parts of each call it served (``[]``: a plain insert),
    and each insert's answer. The server numbers rows 1, 2, ... as it gets them."""
    served: list[list[int]] = []

    async def insert(message, context):
        request, _ = message  # (InsertRequest, its rows' payload)
        rows = sum(request.parts) if request.parts else 8
        first = 1 + sum(sum(p) if p else 8 for p in served)
        served.append(list(request.parts))
        response = pb.InsertResponse(item_ids=range(first, first + rows), num_inserted=rows)
        for p in request.parts:
            response.parts.add(num_inserted=p)
        return response

    async def server_info(request, context):
        return info

    async with _scripted_server({"InsertUnary": insert, "GetServerInfo": server_info}) as address:
        async with AsyncClient(address, flight=False) as client:
            await client.insert("t", trajectories(8))
            answers = await asyncio.gather(*(client.insert("t", b) for b in batches))
    return served, answers


def test_inserts_made_while_one_is_on_the_wire_go_as_one_call_of_parts_each_answered_with_its_own_ids():
    n = merge.WINDOW + 5
    served, answers = asyncio.run(_concurrent_inserts(pb.ServerInfo(insert_unary=True, insert_parts=True), crowd(n)))
    # the warm-up; the first WINDOW of the crowd alone; the rest behind them, merged
    assert served == [[]] * (1 + merge.WINDOW) + [[8] * 5]
    assert [a.item_ids.tolist() for a in answers] == [list(range(9 + 8 * i, 17 + 8 * i)) for i in range(n)]
    assert all((a.num_inserted, a.num_duplicates) == (8, 0) for a in answers)


def test_a_server_that_takes_no_parts_gets_the_merged_inserts_one_call_each_in_order():
    n = merge.WINDOW + 5
    served, answers = asyncio.run(_concurrent_inserts(pb.ServerInfo(insert_unary=True), crowd(n)))
    assert served == [[]] * (1 + n)
    assert [a.item_ids.tolist() for a in answers] == [list(range(9 + 8 * i, 17 + 8 * i)) for i in range(n)]


def test_each_insert_of_a_merged_call_gets_its_own_answer_or_error():
    response = pb.InsertResponse(item_ids=[5, 6, 0, 0, 0, 9], num_inserted=2, num_duplicates=1)
    response.parts.add(num_inserted=2)
    response.parts.add(code=grpc.StatusCode.INVALID_ARGUMENT.value[0], message="table 't': row 1 ...")
    response.parts.add(num_duplicates=1)
    ok, bad, again = merge.answers(response, [2, 3, 1])
    assert ok.item_ids.tolist() == [5, 6] and (ok.num_inserted, ok.num_duplicates) == (2, 0)
    assert bad.code() == grpc.StatusCode.INVALID_ARGUMENT and bad.details() == "table 't': row 1 ..."
    assert again.item_ids.tolist() == [9] and (again.num_inserted, again.num_duplicates) == (0, 1)
    with pytest.raises(ValueError):
        merge.answers(response, [2, 4])


def test_an_insert_that_shares_a_traj_id_with_a_group_starts_the_next_group():
    """A retry of a member's rows in the same call would make the server take the call's
    inserts one by one; it goes in the next call instead."""
    a, b, c = crowd(merge.WINDOW + 3)[merge.WINDOW:]
    batches = crowd(merge.WINDOW) + [a, b, a, c]
    served, _ = asyncio.run(_concurrent_inserts(pb.ServerInfo(insert_unary=True, insert_parts=True), batches))
    assert served[1 + merge.WINDOW:] == [[8, 8], [8, 8]]
