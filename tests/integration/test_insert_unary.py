"""InsertUnary: an insert of one message as a unary call, which clients send for every
insert that fits one message. It is Insert in all but the call's shape: the same
validation, answers, errors, audit and metrics (docs/rpc.md)."""

from __future__ import annotations

import grpc
import pytest

from ._util import (audit_lines, insert_requests, num_items, pb, rpc_error, trajectories,
                    wait_until)

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
