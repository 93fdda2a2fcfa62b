"""InsertUnary: an insert of one message as a unary call, which clients send for every
insert that fits one message. It is Insert in all but the call's shape: the same
validation, answers, errors, audit and metrics (docs/rpc.md)."""

from __future__ import annotations

import grpc
import pyarrow as pa
import pytest

from ._util import (audit_lines, insert_requests, num_items, pb, rpc_error, trajectories,
                    wait_until, with_loss_mask)

IA = grpc.StatusCode.INVALID_ARGUMENT


@pytest.fixture
def table(client, table_name):
    client.create_table(table_name, sampler="fifo")
    yield table_name
    client.drop_table(table_name)


def test_the_server_says_it_takes_insert_unary(stub):
    """Clients send one-message inserts unary only to servers that say so (older ones get
    a stream of one: tests/unit/test_insert_shape.py)."""
    assert stub.GetServerInfo(pb.GetServerInfoRequest(), timeout=10).insert_unary


def test_an_insert_unary_call_stores_rows_and_is_audited_as_an_insert(shared_server, client, stub, table):
    rows = trajectories(3, id_prefix="u")
    first = stub.InsertUnary(insert_requests(table, [rows])[0], timeout=10)
    assert (first.num_inserted, first.num_duplicates, len(first.item_ids)) == (3, 0, 3)
    again = stub.InsertUnary(insert_requests(table, [rows])[0], timeout=10)  # a retry: nothing stored twice
    assert (again.num_inserted, again.num_duplicates, list(again.item_ids)) == (0, 3, list(first.item_ids))
    batch = client.sample(table, 3)
    assert batch.ids.tolist() == list(first.item_ids)
    assert batch.data.column("traj_id").to_pylist() == rows.column("traj_id").to_pylist()

    def audited():
        return [(x["method"], x.get("detail")) for x in audit_lines(shared_server.data_dir) if x["table"] == table]

    assert wait_until(lambda: len(audited()) >= 3)
    assert audited() == [("CreateTable", None), ("Insert", "rows=3 inserted=3 duplicates=0"),
                         ("Insert", "rows=3 inserted=0 duplicates=3")]


def test_insert_unary_refuses_what_insert_refuses_and_stores_nothing(client, stub, table):
    garbage = pb.InsertRequest(table=table, arrow_ipc=b"garbage")
    err = rpc_error(lambda: stub.InsertUnary(garbage, timeout=5), IA)
    assert table in err.details() and "Arrow IPC" in err.details(), err.details()
    short = insert_requests(table, [trajectories(3)])[0]
    short.priorities.extend([1.0, 2.0])
    err = rpc_error(lambda: stub.InsertUnary(short, timeout=5), IA)
    assert "2 priorities for 3 rows" in err.details() and table in err.details(), err.details()
    unknown = insert_requests("no_such_table", [trajectories(1)])[0]
    err = rpc_error(lambda: stub.InsertUnary(unknown, timeout=5), grpc.StatusCode.NOT_FOUND)
    assert "no_such_table" in err.details(), err.details()
    assert num_items(client, table) == 0


def test_a_call_of_several_inserts_answers_each_as_if_sent_alone(client, stub, table):
    """InsertRequest.parts (a client's merged inserts): each part is an insert of its own,
    in order: its own ids and duplicates, its own error; the others are stored."""
    one, two = trajectories(2, id_prefix="one"), trajectories(3, id_prefix="two")
    bad = with_loss_mask(trajectories(2, id_prefix="bad"), row=1, token=3, value=2)
    rows = pa.concat_tables([one, bad, two, one])  # the last part: a retry of the first
    request = insert_requests(table, [rows])[0]
    request.parts.extend([2, 2, 3, 2])
    response = stub.InsertUnary(request, timeout=10)
    codes = [p.code for p in response.parts]
    assert codes == [0, IA.value[0], 0, 0], response
    assert "row 1" in response.parts[1].message and "'loss_mask'" in response.parts[1].message  # its own row 1
    assert [(p.num_inserted, p.num_duplicates) for p in response.parts] == [(2, 0), (0, 0), (3, 0), (0, 2)]
    ids = list(response.item_ids)
    assert ids[2:4] == [0, 0] and ids[7:] == ids[:2] and len(set(ids[:2] + ids[4:7])) == 5
    assert ids[:2] < ids[4:7]  # in the order of the parts
    assert (response.num_inserted, response.num_duplicates) == (5, 2)
    assert num_items(client, table) == 5


def test_parts_that_do_not_split_the_rows_are_refused(client, stub, table):
    for parts in ([2, 1], [3, 0, 1], [5]):  # 4 rows
        request = insert_requests(table, [trajectories(4)])[0]
        request.parts.extend(parts)
        err = rpc_error(lambda: stub.InsertUnary(request, timeout=5), IA)
        assert table in err.details() and "parts" in err.details(), err.details()
    many = insert_requests(table, [trajectories(4097, tokens=2)])[0]
    many.parts.extend([1] * 4097)
    err = rpc_error(lambda: stub.InsertUnary(many, timeout=10), IA)
    assert "at most 4096 inserts" in err.details(), err.details()
    assert num_items(client, table) == 0
