"""Every error code over the wire, with a message naming what is at fault, and nothing
half-applied afterwards (docs/architecture.md#wire)."""

from __future__ import annotations

import math
import time

import grpc
import numpy as np
import pyarrow as pa
import pytest

from expstore_client import Client

from ._util import (arrow_ipc, insert_requests, num_items, pb, raw_stub, rpc_error, trajectories,
                    with_loss_mask)

IA = grpc.StatusCode.INVALID_ARGUMENT
NF = grpc.StatusCode.NOT_FOUND


@pytest.fixture
def table(client, table_name):
    client.create_table(table_name)
    yield table_name
    client.drop_table(table_name)


def assert_still_serving(client, table: str, expected_items: int) -> None:
    """The server answers, and the failed request left the table as it was."""
    assert num_items(client, table) == expected_items
    assert client.stats(table)[table]["items"] == expected_items


# -- INVALID_ARGUMENT: rows --------------------------------------------------------------

def test_bad_loss_mask_names_row_and_column(client, table):
    client.insert(table, trajectories(3, id_prefix="ok"))
    bad = with_loss_mask(trajectories(6, id_prefix="bad"), row=4, token=10, value=2)
    err = rpc_error(lambda: client.insert(table, bad), IA)
    msg = err.details()
    assert table in msg and "row 4" in msg and "'loss_mask'" in msg and "2" in msg, msg
    assert_still_serving(client, table, 3)


def test_bad_row_in_list_of_dicts(client, table):
    rows = trajectories(4).to_pylist()
    rows[2]["logprobs"][-1] = 0.5  # positive logprob on a generated token
    err = rpc_error(lambda: client.insert(table, rows), IA)
    assert "row 2" in err.details() and "'logprobs'" in err.details(), err.details()
    assert_still_serving(client, table, 0)


@pytest.mark.parametrize("column, values, what", [
    ("tokens", lambda n: pa.array([["a", "b"]] * n), "string"),
    ("tokens", lambda n: pa.array([[1.5, 2.0]] * n), "double"),
    ("traj_id", lambda n: pa.array(np.arange(n)), "int64"),
    ("policy_version", lambda n: pa.array(["1"] * n), "string"),
])
def test_uncastable_column_type(client, table, column, values, what):
    data = trajectories(3)
    i = data.schema.get_field_index(column)
    data = data.set_column(i, column, values(3))
    err = rpc_error(lambda: client.insert(table, data), IA)
    msg = err.details()
    assert table in msg and repr(column) in msg and what in msg, msg
    assert_still_serving(client, table, 0)


def test_unknown_column(client, table):
    data = trajectories(2).append_column("surprise", pa.array([1, 2]))
    err = rpc_error(lambda: client.insert(table, data), IA)
    assert table in err.details() and "surprise" in err.details(), err.details()
    assert_still_serving(client, table, 0)


@pytest.mark.parametrize("column", ["priority", "item_id", "times_sampled"])
def test_reserved_column(client, table, column):
    data = trajectories(2).append_column(column, pa.array([1.0, 2.0]))
    err = rpc_error(lambda: client.insert(table, data), IA)
    assert column in err.details() and "server-owned" in err.details(), err.details()
    assert_still_serving(client, table, 0)


def test_missing_required_column(client, table):
    data = trajectories(2).drop_columns(["prompt_id"])
    err = rpc_error(lambda: client.insert(table, data), IA)
    assert "'prompt_id'" in err.details() and "missing" in err.details(), err.details()


def test_duplicate_traj_id_within_batch(client, table):
    rows = trajectories(3).to_pylist()
    rows[2]["traj_id"] = rows[0]["traj_id"]
    err = rpc_error(lambda: client.insert(table, rows), IA)
    assert "row 2" in err.details() and "traj_id" in err.details(), err.details()
    assert_still_serving(client, table, 0)


def test_bad_priority_values(client, table):
    for bad in (math.nan, math.inf, -1.0):
        err = rpc_error(lambda: client.insert(table, trajectories(3), priorities=[1.0, bad, 1.0]), IA)
        assert "row 1" in err.details() and "priority" in err.details(), err.details()
    assert_still_serving(client, table, 0)


def test_client_priorities_length_mismatch_raises_locally(client, table):
    with pytest.raises(ValueError):
        client.insert(table, trajectories(3), priorities=[1.0, 2.0])


def test_priorities_length_mismatch(client, stub, table):
    # Raw messages: the server refuses them itself.
    reqs = insert_requests(table, [trajectories(3)])
    reqs[0].priorities.extend([1.0, 2.0])
    err = rpc_error(lambda: stub.Insert(iter(reqs), timeout=5), IA)
    assert "2 priorities for 3 rows" in err.details() and table in err.details(), err.details()
    assert_still_serving(client, table, 0)


@pytest.mark.parametrize("payload", [b"garbage", b"", b"\xff\xff\xff\xff" + b"\x00" * 64,
                                     bytes(range(256)) * 4])
def test_garbage_arrow_ipc(client, stub, table, payload):
    client.insert(table, trajectories(2))
    req = pb.InsertRequest(table=table, arrow_ipc=payload)
    err = rpc_error(lambda: stub.Insert(iter([req]), timeout=5), IA)
    assert table in err.details() and "Arrow IPC" in err.details(), err.details()
    assert_still_serving(client, table, 2)


def test_insert_with_no_messages(stub):
    err = rpc_error(lambda: stub.Insert(iter([]), timeout=5), IA)
    assert "at least one message" in err.details()


def test_insert_of_zero_rows(client, stub, table):
    empty = trajectories(1).slice(0, 0)
    err = rpc_error(lambda: stub.Insert(iter(insert_requests(table, [empty])), timeout=5), IA)
    assert "no rows" in err.details() and table in err.details()


def test_later_message_names_other_table(client, stub, table):
    reqs = insert_requests(table, [trajectories(2, id_prefix="a"), trajectories(2, id_prefix="b")])
    reqs[1].table = "some_other_table"
    err = rpc_error(lambda: stub.Insert(iter(reqs), timeout=5), IA)
    assert "some_other_table" in err.details() and table in err.details()
    assert_still_serving(client, table, 0)


@pytest.mark.parametrize("order", ["no-numbers", "c:1:5", "c:-1:0", "x" * 200 + ":0:0"])
def test_bad_call_order_metadata(client, stub, table, order):
    client.insert(table, trajectories(2))
    metadata = (("expstore-order", order),)
    err = rpc_error(lambda: stub.Insert(iter(insert_requests(table, [trajectories(1, id_prefix="z")])),
                                        timeout=5, metadata=metadata), IA)
    assert "expstore-order" in err.details() and "ORIGIN:SEQ:LOW" in err.details(), err.details()
    err = rpc_error(lambda: list(stub.Sample(pb.SampleRequest(table=table, batch_size=1), timeout=5,
                                             metadata=metadata)), IA)
    assert "expstore-order" in err.details(), err.details()
    assert_still_serving(client, table, 2)


@pytest.mark.parametrize("call", ["sample", "stream"])
@pytest.mark.parametrize("batch_size", [0, -3])
def test_batch_size_not_positive(client, table, call, batch_size):
    client.insert(table, trajectories(2))
    if call == "sample":
        err = rpc_error(lambda: client.sample(table, batch_size, timeout=0.1), IA)
    else:
        err = rpc_error(lambda: next(client.stream(table, "g", batch_size, poll_timeout=0.1)), IA)
    assert "batch_size" in err.details() and table in err.details(), err.details()
    assert_still_serving(client, table, 2)
    assert client.stats(table)[table]["samples"] == 0


def test_stream_bad_start_and_empty_group(client, stub, table):
    err = rpc_error(lambda: list(stub.Stream(pb.StreamRequest(table=table, group="g", batch_size=1,
                                                              start="middle"), timeout=5)), IA)
    assert "start" in err.details() and "middle" in err.details()
    err = rpc_error(lambda: list(stub.Stream(pb.StreamRequest(table=table, group="", batch_size=1),
                                             timeout=5)), IA)
    assert "consumer group" in err.details()


def test_update_priorities_length_mismatch(client, stub, table):
    ids = client.insert(table, trajectories(3)).item_ids
    req = pb.UpdatePrioritiesRequest(table=table, item_ids=list(map(int, ids)), priorities=[1.0])
    err = rpc_error(lambda: stub.UpdatePriorities(req, timeout=5), IA)
    assert "3 ids" in err.details() and "1 priorities" in err.details()
    err = rpc_error(lambda: client.update_priorities(table, ids[:1], [math.nan]), IA)
    assert "priority" in err.details()
    assert client.get(table, ids).priorities.tolist() == [1.0, 1.0, 1.0]


def test_negative_policy_version(client, table):
    err = rpc_error(lambda: client.set_policy_version(table, -1), IA)
    assert "policy version" in err.details() and table in err.details()
    assert client.describe(table).policy_version == 0


# -- INVALID_ARGUMENT: table configs -----------------------------------------------------

@pytest.mark.parametrize("kwargs, fragment", [
    (dict(sampler="nope"), "sampler.type"),
    (dict(sampler={"type": "group"}), "group_size"),
    (dict(sampler={"type": "prioritized", "alpha": -1.0}), "alpha"),
    (dict(remover="oldest"), "remover"),
    (dict(kind="document"), "kind"),
    (dict(kind="generic"), "schema"),
    (dict(max_size=0), "max_size"),
    (dict(rate_limiter={"type": "queue"}), "size"),
    (dict(rate_limiter={"type": "sample_to_insert_ratio", "samples_per_insert": 1.0,
                        "min_size_to_sample": 1, "error_buffer": 0.1}), "error_buffer"),
    (dict(schema=pa.schema([("priority", pa.float64())])), "priority"),
    (dict(schema=pa.schema([("tokens", pa.list_(pa.int64()))])), "tokens"),
])
def test_bad_table_config(client, table_name, kwargs, fragment):
    err = rpc_error(lambda: client.create_table(table_name, **kwargs), IA)
    assert fragment in err.details(), err.details()
    rpc_error(lambda: client.describe(table_name), NF)  # nothing was created


def test_bad_table_name(client):
    err = rpc_error(lambda: client.create_table("has space"), IA)
    assert "has space" in err.details()


def test_garbage_schema_bytes(stub, table_name, client):
    config = pb.TableConfig(name=table_name, schema=b"\x01\x02garbage")
    err = rpc_error(lambda: stub.CreateTable(pb.CreateTableRequest(config=config), timeout=5), IA)
    assert table_name in err.details() and "schema" in err.details()
    rpc_error(lambda: client.describe(table_name), NF)


# -- NOT_FOUND -----------------------------------------------------------------------------

def test_unknown_table_everywhere(client, stub):
    name = "no_such_table_anywhere"
    calls = {
        "describe": lambda: client.describe(name),
        "insert": lambda: client.insert(name, trajectories(1)),
        "sample": lambda: client.sample(name, 1, timeout=0.1),
        "stream": lambda: next(client.stream(name, "g", 1, poll_timeout=0.1)),
        "ack": lambda: client.ack(name, "g", [1]),
        "get": lambda: client.get(name, [1]),
        "update_priorities": lambda: client.update_priorities(name, [1], [1.0]),
        "set_policy_version": lambda: client.set_policy_version(name, 1),
        "stats": lambda: client.stats(name),
        "drop": lambda: client.drop_table(name),
    }
    for what, call in calls.items():
        err = rpc_error(call, NF)
        assert repr(name) in err.details(), (what, err.details())


def test_unknown_item_id(client, table):
    ids = client.insert(table, trajectories(3)).item_ids
    unknown = int(ids.max()) + 1000
    err = rpc_error(lambda: client.get(table, [int(ids[0]), unknown]), NF)
    assert str(unknown) in err.details() and table in err.details()
    # update_priorities ignores ids that name no live item (as Reverb does) and says which.
    done = client.update_priorities(table, [int(ids[0]), unknown], [5.0, 5.0])
    assert done.num_updated == 1 and done.unknown_item_ids.tolist() == [unknown]
    assert client.get(table, ids[:1]).priorities.tolist() == [5.0]
    assert_still_serving(client, table, 3)


def test_ack_never_delivered_and_unknown_group(client, table):
    ids = client.insert(table, trajectories(4)).item_ids
    batch = next(client.stream(table, "readers", 2, poll_timeout=1))
    delivered = batch.ids.tolist()
    assert delivered == ids[:2].tolist()
    never = int(ids[3])
    err = rpc_error(lambda: client.ack(table, "readers", delivered + [never]), NF)
    assert str(never) in err.details() and "readers" in err.details()
    err = rpc_error(lambda: client.ack(table, "nobody", delivered), NF)
    assert "nobody" in err.details() and table in err.details()
    # The failed ack acked nothing: both delivered ids are still in flight.
    assert client.stats(table)[table]["group.readers.inflight"] == 2
    assert client.ack(table, "readers", delivered) == 2


# -- ALREADY_EXISTS, FAILED_PRECONDITION, RESOURCE_EXHAUSTED ------------------------------

def test_already_exists(client, table):
    client.insert(table, trajectories(2))
    err = rpc_error(lambda: client.create_table(table), grpc.StatusCode.ALREADY_EXISTS)
    assert table in err.details()
    # Same config with if_not_exists is fine; a different one is still ALREADY_EXISTS.
    client.create_table(table, if_not_exists=True)
    err = rpc_error(lambda: client.create_table(table, sampler="fifo", if_not_exists=True),
                    grpc.StatusCode.ALREADY_EXISTS)
    assert "different config" in err.details()
    assert_still_serving(client, table, 2)


def test_policy_version_must_not_decrease(client, table):
    client.set_policy_version(table, 5)
    err = rpc_error(lambda: client.set_policy_version(table, 4), grpc.StatusCode.FAILED_PRECONDITION)
    assert table in err.details() and "5" in err.details() and "4" in err.details()
    assert client.describe(table).policy_version == 5
    client.set_policy_version(table, 5)  # equal is fine


def test_memory_budget_exhausted(client, table_name):
    client.create_table(table_name, memory_bytes=20_000, tiers="memory")
    try:
        client.insert(table_name, trajectories(2, tokens=32, id_prefix="small"))
        err = rpc_error(lambda: client.insert(table_name, trajectories(20, tokens=256, id_prefix="big")),
                        grpc.StatusCode.RESOURCE_EXHAUSTED)
        assert table_name in err.details() and "memory_bytes" in err.details(), err.details()
        assert_still_serving(client, table_name, 2)
        assert client.insert(table_name, trajectories(1, tokens=32, id_prefix="again")).num_inserted == 1
    finally:
        client.drop_table(table_name)


def test_insert_larger_than_max_size(client, table_name):
    client.create_table(table_name, max_size=5)
    try:
        err = rpc_error(lambda: client.insert(table_name, trajectories(6)), IA)
        assert "max_size" in err.details()
        assert num_items(client, table_name) == 0
    finally:
        client.drop_table(table_name)


# -- DEADLINE_EXCEEDED ---------------------------------------------------------------------

def test_rate_limiter_deadline_is_the_request_timeout(client, table_name):
    client.create_table(table_name, rate_limiter={"type": "min_size", "min_size_to_sample": 10})
    try:
        client.insert(table_name, trajectories(3))
        t0 = time.monotonic()
        err = rpc_error(lambda: client.sample(table_name, 2, timeout=0.2), grpc.StatusCode.DEADLINE_EXCEEDED)
        elapsed = time.monotonic() - t0
        # The server answered after ~timeout, long before the RPC deadline (timeout + 5 s).
        assert 0.15 <= elapsed < 1.5, elapsed
        assert table_name in err.details() and "rate limiter" in err.details(), err.details()
        assert client.stats(table_name)[table_name]["samples"] == 0
        # timeout 0: do not wait at all.
        t0 = time.monotonic()
        rpc_error(lambda: client.sample(table_name, 2, timeout=0), grpc.StatusCode.DEADLINE_EXCEEDED)
        assert time.monotonic() - t0 < 1.0
    finally:
        client.drop_table(table_name)


def test_empty_stream_deadline(stub, table):
    t0 = time.monotonic()
    err = rpc_error(lambda: list(stub.Stream(
        pb.StreamRequest(table=table, group="g", batch_size=4, timeout_s=0.2), timeout=5)),
        grpc.StatusCode.DEADLINE_EXCEEDED)
    assert 0.15 <= time.monotonic() - t0 < 1.5
    assert "caught up" in err.details()


def test_rpc_deadline_shorter_than_request_timeout(shared_server, table_name, client):
    """A request timeout longer than the RPC deadline: the server stops waiting just
    before the deadline, so the caller still gets an answer in time."""
    client.create_table(table_name, rate_limiter={"type": "min_size", "min_size_to_sample": 10})
    try:
        channel, stub = raw_stub(shared_server.address)
        t0 = time.monotonic()
        err = rpc_error(lambda: list(stub.Sample(pb.SampleRequest(table=table_name, batch_size=1,
                                                                  timeout_s=math.inf), timeout=0.6)),
                        grpc.StatusCode.DEADLINE_EXCEEDED)
        assert time.monotonic() - t0 < 1.5
        channel.close()
        assert err.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    finally:
        client.drop_table(table_name)


# -- multi-message inserts are atomic ------------------------------------------------------

def test_multi_message_insert_is_atomic(shared_server, table_name):
    small = Client(shared_server.address, message_bytes=64 << 10)
    try:
        small.create_table(table_name)
        data = trajectories(60, tokens=1024, id_prefix="mm")
        parts = arrow_ipc.split_rows(data, small.message_bytes)
        assert len(parts) >= 4, "the insert must span several messages"
        last_row = data.num_rows - 1
        bad = with_loss_mask(data, row=last_row, token=1000, value=7)
        err = rpc_error(lambda: small.insert(table_name, bad), IA)
        assert f"row {last_row}" in err.details() and "'loss_mask'" in err.details(), err.details()
        assert num_items(small, table_name) == 0  # nothing from the earlier messages

        # A bad first message with valid later ones: nothing either.
        bad = with_loss_mask(data, row=0, token=1000, value=3)
        err = rpc_error(lambda: small.insert(table_name, bad), IA)
        assert "row 0" in err.details()
        assert num_items(small, table_name) == 0

        # The same rows, valid, with per-row priorities split across the messages.
        priorities = np.arange(1, data.num_rows + 1, dtype=np.float64)
        result = small.insert(table_name, data, priorities=priorities)
        assert result.num_inserted == data.num_rows and result.num_duplicates == 0
        assert np.all(np.diff(result.item_ids.astype(np.int64)) == 1)
        got = small.get(table_name, result.item_ids)
        assert got.data.column("traj_id").to_pylist() == data.column("traj_id").to_pylist()
        assert got.data.column("tokens").to_pylist() == data.column("tokens").to_pylist()
        assert got.priorities.tolist() == priorities.tolist()
    finally:
        small.drop_table(table_name)
        small.close()


def test_raw_multi_message_bad_last_message(client, stub, table):
    parts = [trajectories(3, id_prefix=f"p{i}") for i in range(4)]
    parts[-1] = with_loss_mask(parts[-1], row=1, token=20, value=2)
    err = rpc_error(lambda: stub.Insert(iter(insert_requests(table, parts)), timeout=5), IA)
    assert "row 10" in err.details(), err.details()  # 3 + 3 + 3 + 1: the row within the call
    garbage = insert_requests(table, parts[:3]) + [pb.InsertRequest(arrow_ipc=b"not arrow")]
    err = rpc_error(lambda: stub.Insert(iter(garbage), timeout=5), IA)
    assert "insert message 3" in err.details(), err.details()
    assert_still_serving(client, table, 0)


# -- INTERNAL must not happen for request data ------------------------------------------------

def test_huge_sample_batch_size_is_invalid_argument(client, table):
    client.insert(table, trajectories(2))
    err = rpc_error(lambda: client.sample(table, 2**40, timeout=0.1))
    assert err.code() in (IA, grpc.StatusCode.RESOURCE_EXHAUSTED), err.details()


def test_huge_group_size_is_invalid_argument(client, table_name):
    err = rpc_error(lambda: client.create_table(table_name, sampler={"type": "group", "group_size": 2**62}))
    assert err.code() == IA, err.details()


def test_durability_beyond_memory_is_refused_for_a_memory_only_table(client, table_name):
    client.create_table(table_name, tiers="memory")
    try:
        for level in ("wal", "fsync"):
            err = rpc_error(lambda: client.insert(table_name, trajectories(2, id_prefix=level), durability=level))
            assert err.code() == grpc.StatusCode.FAILED_PRECONDITION and "SSD tier" in err.details()
        assert client.insert(table_name, trajectories(2), durability="memory").num_inserted == 2
    finally:
        client.drop_table(table_name)
