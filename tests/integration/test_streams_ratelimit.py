"""Consumer groups, the rate limiter and staleness across real clients and the wire."""

from __future__ import annotations

import asyncio
import threading
import time

import grpc
import pytest

from expstore_client import AsyncClient, Client

from ._util import audit_lines, num_items, pb, raw_stub, rpc_error, trajectories, wait_until


@pytest.fixture
def table(client, table_name):
    client.create_table(table_name)
    yield table_name
    client.drop_table(table_name)


def drain(client, table, group, batch_size, **kw):
    """Every id a group is handed until it is caught up, acking each batch."""
    ids = []
    for batch in client.stream(table, group, batch_size, poll_timeout=0.2, idle_timeout=0.2, **kw):
        ids += batch.ids.tolist()
        batch.ack()
    return ids


# -- streams -------------------------------------------------------------------------------

def test_two_consumer_groups_each_see_every_item_once(shared_server, client, table):
    ids = client.insert(table, trajectories(23, id_prefix="a")).item_ids.tolist()
    other = Client(shared_server.address)
    try:
        results = {}
        threads = [threading.Thread(target=lambda g=g, c=c: results.__setitem__(g, drain(c, table, g, 5)))
                   for g, c in (("learner", client), ("auditor", other))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(20)
        assert results["learner"] == ids and results["auditor"] == ids
        # Rows inserted later go to both groups, once, after the earlier ones.
        more = client.insert(table, trajectories(4, id_prefix="b")).item_ids.tolist()
        assert drain(client, table, "learner", 3) == more
        assert drain(other, table, "auditor", 10) == more
        stats = client.stats(table)[table]
        assert stats["group.learner.delivered"] == 27 and stats["group.learner.inflight"] == 0
        assert stats["group.auditor.acked"] == 27 and stats["consumer_groups"] == 2
    finally:
        other.close()


def test_unacked_items_come_back_after_visibility_timeout(client, table):
    ids = client.insert(table, trajectories(6)).item_ids.tolist()
    stream = client.stream(table, "g", 4, poll_timeout=2, visibility_timeout=0.3)
    first = next(stream)
    assert first.ids.tolist() == ids[:4]  # not acked
    second = next(stream)
    assert second.ids.tolist() == ids[4:]
    second.ack()
    t0 = time.monotonic()
    again = next(stream)  # waits for the visibility timeout, then redelivers
    waited = time.monotonic() - t0
    assert again.ids.tolist() == ids[:4]
    assert waited < 1.5, waited
    assert again.data.column("traj_id").to_pylist() == first.data.column("traj_id").to_pylist()
    assert again.ack() == 4
    # Acked: nothing more is redelivered.
    assert list(client.stream(table, "g", 4, poll_timeout=0.2, idle_timeout=0.5,
                              visibility_timeout=0.3)) == []
    stats = client.stats(table)[table]
    assert stats["group.g.redelivered"] == 4 and stats["group.g.acked"] == 6


def test_ack_twice_counts_already_acked(shared_server, client, table):
    ids = client.insert(table, trajectories(3)).item_ids.tolist()
    batch = next(client.stream(table, "g", 3, poll_timeout=1))
    assert batch.ack() == 3
    channel, stub = raw_stub(shared_server.address)
    resp = stub.Ack(pb.AckRequest(table=table, group="g", item_ids=ids), timeout=5)
    assert resp.num_acked == 0 and resp.num_already_acked == 3
    channel.close()


@pytest.mark.parametrize("flight", [False, True])
def test_an_auto_acked_stream_acks_each_batch_with_the_call_that_fetches_the_next(shared_server, table, flight):
    """Each batch's ack rides on the next Stream call (audited there, as Ack is); closing
    the iterator acks the last batch with an Ack. Nothing is redelivered."""
    with Client(shared_server.address, flight=flight) as client:
        ids = client.insert(table, trajectories(12)).item_ids.tolist()
        stream = client.stream(table, "g", 4, poll_timeout=1, visibility_timeout=0.3, auto_ack=True)
        seen = [next(stream).ids.tolist() for _ in range(3)]
        stats = client.stats(table)[table]
        assert stats["group.g.acked"] == 8 and stats["group.g.inflight"] == 4  # the first two, by the 2nd and 3rd calls
        stream.close()
        assert sum(seen, []) == ids and client.stats(table)[table]["group.g.acked"] == 12
        time.sleep(0.4)  # past the visibility timeout: an unacked row would come back now
        assert list(client.stream(table, "g", 4, poll_timeout=0.2, idle_timeout=0.3)) == []

    def lines():
        return [(line["method"], line["detail"]) for line in audit_lines(shared_server.data_dir)
                if line["table"] == table and line["method"] in ("Stream", "Ack")]
    assert wait_until(lambda: len(lines()) == 3)
    assert lines() == [("Stream", "group=g acked=4"), ("Stream", "group=g acked=4"), ("Ack", "group=g acked=4")]


def test_a_stream_call_that_acks_an_id_never_delivered_is_not_found_and_reads_nothing(shared_server, client, table):
    ids = client.insert(table, trajectories(4)).item_ids.tolist()
    channel, stub = raw_stub(shared_server.address)
    try:
        def stream(ack):
            request = pb.StreamRequest(table=table, group="g", batch_size=2, timeout_s=1, ack_item_ids=ack)
            return [i for m in stub.Stream(request, timeout=5) for i in m.item_ids]
        assert stream([]) == ids[:2]
        with pytest.raises(grpc.RpcError) as e:
            stream([ids[0], 10**12])
        assert e.value.code() == grpc.StatusCode.NOT_FOUND and "never delivered item 1000000000000" in e.value.details()
        stats = client.stats(table)[table]
        assert stats["group.g.delivered"] == 2 and stats["group.g.acked"] == 0  # nothing acked, nothing read
        assert stream(ids[:2]) == ids[2:]
        assert client.stats(table)[table]["group.g.acked"] == 2
    finally:
        channel.close()


def test_stream_idle_timeout_ends_the_iterator(client, table):
    client.insert(table, trajectories(3))
    t0 = time.monotonic()
    batches = list(client.stream(table, "g", 10, poll_timeout=0.2, idle_timeout=0.5))
    elapsed = time.monotonic() - t0
    assert [len(b) for b in batches] == [3]  # un-acked, but the visibility timeout is 60 s
    assert 0.4 <= elapsed < 2.5, elapsed


def test_stream_idle_timeout_shorter_than_poll_timeout(client, table):
    t0 = time.monotonic()
    assert list(client.stream(table, "g", 10, poll_timeout=2.5, idle_timeout=0.3)) == []
    assert time.monotonic() - t0 < 1.5


def test_stream_start_latest(client, table):
    client.insert(table, trajectories(3, id_prefix="old"))
    assert list(client.stream(table, "late", 5, poll_timeout=0.1, idle_timeout=0.1, start="latest")) == []
    new = client.insert(table, trajectories(2, id_prefix="new")).item_ids.tolist()
    assert drain(client, table, "late", 5, start="latest") == new
    assert len(drain(client, table, "early", 5)) == 5


def test_blocked_stream_wakes_on_insert(shared_server, client, table):
    other = Client(shared_server.address)
    got = {}

    def consume():
        t0 = time.monotonic()
        got["batch"] = next(other.stream(table, "g", 10, poll_timeout=5))
        got["at"] = time.monotonic() - t0

    t = threading.Thread(target=consume)
    t.start()
    time.sleep(0.3)
    inserted_at = time.monotonic()
    ids = client.insert(table, trajectories(2)).item_ids.tolist()
    t.join(10)
    other.close()
    assert got["batch"].ids.tolist() == ids
    assert got["at"] >= 0.25 and got["at"] < 0.3 + (time.monotonic() - inserted_at) + 1.0


# -- rate limiter across clients ----------------------------------------------------------------

def test_blocked_sample_returns_once_another_client_inserts(shared_server, client, table_name):
    client.create_table(table_name, rate_limiter={"type": "min_size", "min_size_to_sample": 10})
    trainer = Client(shared_server.address)
    out = {}

    def sample():
        try:
            out["batch"] = trainer.sample(table_name, 4, timeout=10)
        except grpc.RpcError as e:
            out["error"] = e
        out["done"] = time.monotonic()

    try:
        client.insert(table_name, trajectories(9, id_prefix="a"))
        t = threading.Thread(target=sample)
        t.start()
        time.sleep(0.4)
        assert "done" not in out, "the sample must wait for min_size_to_sample items"
        inserted = time.monotonic()
        client.insert(table_name, trajectories(1, id_prefix="b"))
        t.join(10)
        assert "error" not in out, out.get("error")
        assert len(out["batch"]) == 4
        assert out["done"] - inserted < 1.0, "the sample did not wake promptly"
        assert client.stats(table_name)[table_name]["sample_waits"] >= 1
    finally:
        trainer.close()
        client.drop_table(table_name)


def test_drop_table_ends_blocked_calls(shared_server, client, table_name):
    client.create_table(table_name, rate_limiter={"type": "min_size", "min_size_to_sample": 10})
    other = Client(shared_server.address)
    out = {}

    def sample():
        try:
            other.sample(table_name, 1, timeout=10)
        except grpc.RpcError as e:
            out["code"] = e.code()
        out["done"] = time.monotonic()

    t = threading.Thread(target=sample)
    t.start()
    time.sleep(0.3)
    dropped = time.monotonic()
    client.drop_table(table_name)
    t.join(10)
    other.close()
    assert out["code"] in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.NOT_FOUND), out
    assert out["done"] - dropped < 1.0
    client.create_table(table_name)  # the name is free again
    client.drop_table(table_name)


def test_sample_to_insert_ratio_holds_inserts_back(shared_server, client, table_name):
    client.create_table(table_name, rate_limiter={"type": "sample_to_insert_ratio", "samples_per_insert": 1.0,
                                                  "min_size_to_sample": 1, "error_buffer": 1.0})
    producer = Client(shared_server.address)
    out = {}

    def insert():
        try:
            out["result"] = producer.insert(table_name, trajectories(1, id_prefix="held"), timeout=10)
        except grpc.RpcError as e:
            out["error"] = e
        out["done"] = time.monotonic()

    try:
        client.insert(table_name, trajectories(2, id_prefix="first"))  # diff = 2 = max_diff
        # With no sample, one more insert cannot pass: a short timeout fails cleanly...
        t0 = time.monotonic()
        err = rpc_error(lambda: producer.insert(table_name, trajectories(1, id_prefix="held"), timeout=0.2),
                        grpc.StatusCode.DEADLINE_EXCEEDED)
        assert time.monotonic() - t0 < 1.5 and "rate limiter" in err.details()
        assert num_items(client, table_name) == 2
        # ...and a long one waits until a trainer samples.
        t = threading.Thread(target=insert)
        t.start()
        time.sleep(0.4)
        assert "done" not in out and num_items(client, table_name) == 2
        sampled = time.monotonic()
        assert len(client.sample(table_name, 1, timeout=1)) == 1
        t.join(10)
        assert "error" not in out, out.get("error")
        assert out["result"].num_inserted == 1
        assert out["done"] - sampled < 1.0
        assert num_items(client, table_name) == 3
    finally:
        producer.close()
        client.drop_table(table_name)


def test_queue_rate_limiter_round_trip(client, table_name):
    client.create_table(table_name, sampler="fifo", remover="fifo", max_times_sampled=1,
                        rate_limiter={"type": "queue", "size": 3})
    try:
        ids = client.insert(table_name, trajectories(3)).item_ids.tolist()
        rpc_error(lambda: client.insert(table_name, trajectories(1, id_prefix="x"), timeout=0.1),
                  grpc.StatusCode.DEADLINE_EXCEEDED)
        assert client.sample(table_name, 2).ids.tolist() == ids[:2]
        assert client.insert(table_name, trajectories(2, id_prefix="y"), timeout=1).num_inserted == 2
        assert num_items(client, table_name) == 3  # the sampled two left (max_times_sampled=1)
    finally:
        client.drop_table(table_name)


# -- first come, first served ----------------------------------------------------------------

RUNS = 20
QUEUE1 = dict(sampler="fifo", remover="fifo", max_size=1, max_times_sampled=1,
              rate_limiter={"type": "queue", "size": 1})


def keys(batch) -> list[int]:
    return [int(t.split("-")[0][1:]) for t in batch.data.column("traj_id").to_pylist()]


def test_a_producers_blocked_inserts_are_stored_in_the_order_it_issued_them(shared_server, client, table_name):
    """Queue(1): one producer fires 8 inserts without waiting (insert_future); the first
    is stored, the others wait for the rate limiter, and each sample lets one in. They
    must come out 1..8, every time (Reverb admits pending inserts in order)."""
    producer = Client(shared_server.address)  # its channel connects under the first inserts
    try:
        for run in range(RUNS):
            name = f"{table_name}_{run}"
            client.create_table(name, **QUEUE1)
            futures = [producer.insert_future(name, trajectories(1, id_prefix=f"k{k}-"), timeout=30)
                       for k in range(1, 9)]
            order = [keys(client.sample(name, 1, timeout=10))[0] for _ in range(8)]
            assert [f.result(10).num_inserted for f in futures] == [1] * 8
            assert order == list(range(1, 9)), f"run {run}"
            client.drop_table(name)
    finally:
        producer.close()


@pytest.mark.parametrize("flight", [False, True])
def test_async_producers_blocked_inserts_and_samples_keep_their_order(shared_server, client, table_name, flight):
    """The same with AsyncClient tasks; then 6 samples fired at an empty queue are served
    in the order they were issued as items arrive one by one. Over gRPC the calls all
    reach the server and wait in its line in the connection's order; over Flight (every
    insert sent there) a client's calls go one at a time, in the order they were made."""
    async def run_all():
        async with AsyncClient(shared_server.address, flight=flight, flight_min_bytes=0) as producer:
            for run in range(RUNS):
                name = f"{table_name}_{run}"
                client.create_table(name, **QUEUE1)
                inserts = [asyncio.create_task(producer.insert(name, trajectories(1, id_prefix=f"k{k}-"),
                                                               timeout=30)) for k in range(1, 9)]
                order = []
                for _ in range(8):
                    order += keys(await asyncio.to_thread(client.sample, name, 1, timeout=10))
                await asyncio.gather(*inserts)
                assert order == list(range(1, 9)), f"run {run}"
                samples = [asyncio.create_task(producer.sample(name, 1, timeout=30)) for _ in range(6)]
                waiting = 6 if not flight else 1
                assert await asyncio.to_thread(wait_until, lambda: client.stats(name)[name]["sample_queue"] == waiting)
                for k in range(1, 7):
                    await asyncio.to_thread(client.insert, name, trajectories(1, id_prefix=f"s{k}-"), timeout=10)
                assert [keys(b)[0] for b in await asyncio.gather(*samples)] == list(range(1, 7)), f"run {run}"
                client.drop_table(name)

    asyncio.run(run_all())


def test_a_call_waiting_behind_others_times_out_with_its_place_named(client, table_name):
    client.create_table(table_name, **QUEUE1)
    try:
        client.insert(table_name, trajectories(1, id_prefix="k0"))
        waiting = client.insert_future(table_name, trajectories(1, id_prefix="k1"), timeout=30)
        assert wait_until(lambda: client.stats(table_name)[table_name]["insert_queue"] == 1)
        err = rpc_error(lambda: client.insert(table_name, trajectories(1, id_prefix="k2"), timeout=0.2),
                        grpc.StatusCode.DEADLINE_EXCEEDED)
        assert "first come, first served" in err.details()
        assert keys(client.sample(table_name, 1)) == [0] and waiting.result(10).num_inserted == 1
        assert client.stats(table_name)[table_name]["insert_queue"] == 0
    finally:
        client.drop_table(table_name)


def test_dropping_a_table_ends_every_call_in_its_lines(client, table_name):
    client.create_table(table_name, **QUEUE1)
    client.insert(table_name, trajectories(1, id_prefix="k0"))
    waiting = [client.insert_future(table_name, trajectories(1, id_prefix=f"k{k}"), timeout=60) for k in (1, 2, 3)]
    assert wait_until(lambda: client.stats(table_name)[table_name]["insert_queue"] == 3)
    client.drop_table(table_name)
    for f in waiting:  # long before their 60 s timeout
        with pytest.raises(grpc.RpcError) as e:
            f.result(20)
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE


# -- staleness -------------------------------------------------------------------------------

def test_staleness_removes_old_items_and_they_are_never_sampled(client, table_name):
    client.create_table(table_name, max_staleness=1)
    try:
        ids_by_version = {v: client.insert(table_name, trajectories(4, policy_version=v, id_prefix=f"v{v}"))
                          .item_ids.tolist() for v in range(4)}
        assert client.set_policy_version(table_name, 3) == 8  # versions 0 and 1 fall out
        assert num_items(client, table_name) == 8
        assert client.describe(table_name).policy_version == 3
        batch = client.sample(table_name, 200)
        assert set(batch.policy_versions.tolist()) <= {2, 3}
        assert set(batch.data.column("policy_version").to_pylist()) <= {2, 3}
        assert set(batch.ids.tolist()) <= set(ids_by_version[2] + ids_by_version[3])
        rpc_error(lambda: client.get(table_name, ids_by_version[0][:1]), grpc.StatusCode.NOT_FOUND)
        streamed = drain(client, table_name, "g", 100)
        assert streamed == ids_by_version[2] + ids_by_version[3]
        # A row already stale when it arrives is acknowledged but never stored.
        late = client.insert(table_name, trajectories(2, policy_version=0, id_prefix="late"))
        assert late.num_inserted == 2 and late.num_stale == 2
        assert num_items(client, table_name) == 8
        rpc_error(lambda: client.get(table_name, late.item_ids), grpc.StatusCode.NOT_FOUND)
        assert client.stats(table_name)[table_name]["removed_stale"] == 10
        # The next version expires version 2.
        assert client.set_policy_version(table_name, 4) == 4
        assert set(client.sample(table_name, 50).policy_versions.tolist()) == {3}
    finally:
        client.drop_table(table_name)


def test_max_times_sampled_over_the_wire(client, table_name):
    client.create_table(table_name, sampler="fifo", max_times_sampled=2)
    try:
        ids = client.insert(table_name, trajectories(2)).item_ids.tolist()
        assert client.sample(table_name, 2).ids.tolist() == ids
        assert client.sample(table_name, 2).times_sampled.tolist() == [2, 2]
        assert wait_until(lambda: num_items(client, table_name) == 0, timeout=2)
    finally:
        client.drop_table(table_name)


def test_group_sampler_returns_whole_groups(client, table_name):
    client.create_table(table_name, sampler={"type": "group", "group_size": 4})
    try:
        client.insert(table_name, trajectories(8, groups=2))
        batch = client.sample(table_name, 8)
        groups = batch.data.column("group_id").to_pylist()
        assert sorted(set(groups)) == ["traj-g0", "traj-g1"]
        assert all(groups.count(g) == 4 for g in set(groups))
        rpc_error(lambda: client.sample(table_name, 6), grpc.StatusCode.INVALID_ARGUMENT)
    finally:
        client.drop_table(table_name)
