"""Durability: kill -9 at random moments loses no acknowledged insert and duplicates none;
a restart restores items, priorities, times_sampled, policy versions, consumer offsets,
unacked deliveries and training cuts; one server per data dir."""

from __future__ import annotations

import random
import signal
import threading
import time

import grpc
import numpy as np
import pytest

from expstore_client import Client

from ._util import rpc_error, start_server, stored_traj_ids, trajectories

pytestmark = pytest.mark.timeout(180)


def restart(server):
    server.stop(signal.SIGKILL)
    return start_server(server.data_dir)


@pytest.mark.parametrize("rows,tokens", [(16, 64), (32, 4096)], ids=["rocksdb", "chunk-files"])
def test_kill_9_during_inserts_loses_no_acknowledged_row_and_duplicates_none(tmp_path, rows, tokens):
    """Small chunks are RocksDB values; large ones (1.2 MB) files of their own, written
    before their meta key: a kill between the two leaves an orphan the restart removes."""
    server = start_server(tmp_path / "data")
    Client(server.address).create_table("t", sampler="uniform", max_size=10**6)
    acknowledged: list[str] = []
    rng = random.Random(7)
    for round_ in range(3):
        stop = threading.Event()

        def produce(address=server.address, round_=round_):
            client = Client(address, timeout=5)
            i = 0
            while not stop.is_set():
                batch = trajectories(rows, tokens=tokens, id_prefix=f"r{round_}-{i}-", seed=i)
                try:
                    client.insert("t", batch, durability="wal")
                except grpc.RpcError:
                    return  # the server died under us: this batch was not acknowledged
                acknowledged.extend(batch.column("traj_id").to_pylist())
                i += 1

        writer = threading.Thread(target=produce)
        writer.start()
        time.sleep(rng.uniform(0.3, 1.2))
        server.stop(signal.SIGKILL)
        stop.set()
        writer.join()
        server = start_server(server.data_dir)
        # A retry of the last acknowledged batch is a duplicate, never a second copy.
        client = Client(server.address)
        stored = stored_traj_ids(client, "t", f"check{round_}")
        assert len(stored) == len(set(stored)), "a row is stored twice"
        assert set(acknowledged) <= set(stored), f"lost {len(set(acknowledged) - set(stored))} acknowledged rows"
        assert not list(server.data_dir.rglob("*.partial")), "a file killed mid-write outlived the restart"
        again = client.insert("t", trajectories(rows, tokens=tokens, id_prefix=f"r{round_}-0-", seed=0))
        assert again.num_duplicates == rows
    assert len(acknowledged) > 0
    server.stop()


def test_restart_restores_priorities_times_sampled_versions_and_unacked_deliveries(tmp_path):
    server = start_server(tmp_path / "data")
    c = Client(server.address)
    c.create_table("p", sampler={"type": "prioritized", "alpha": 1.0}, max_times_sampled=100)
    c.create_table("q", sampler="fifo")
    ids = c.insert("p", trajectories(50, tokens=32, id_prefix="p")).item_ids
    c.update_priorities("p", ids[:10], [7.0] * 10)
    sampled = c.sample("p", 40, step=3)
    c.set_policy_version("p", 4)
    c.insert("q", trajectories(30, tokens=32, id_prefix="q"))
    stream = c.stream("q", "trainer", 10, visibility_timeout=600)
    first = next(stream)
    first.ack()
    second = next(stream)  # delivered, never acked: redelivered after the restart
    before = c.get("p", ids)
    server = restart(server)
    c = Client(server.address)
    after = c.get("p", ids)
    assert np.array_equal(before.priorities, after.priorities)
    assert np.array_equal(before.times_sampled, after.times_sampled)
    assert after.times_sampled.sum() == 40
    assert c.describe("p").policy_version == 4
    assert np.array_equal(c.manifest("p", 3)[0], sampled.ids)
    assert after.data.equals(before.data)
    # Unacked deliveries keep their deadline (600 s): the next read gets fresh items.
    third = next(c.stream("q", "trainer", 10, visibility_timeout=600))
    assert set(third.ids).isdisjoint(first.ids) and set(third.ids).isdisjoint(second.ids)
    assert c.stats("q")["q"]["group.trainer.inflight"] == 20
    server.stop()


def test_training_cut_resume_redelivers_exactly_what_the_next_step_had_not_committed(tmp_path):
    server = start_server(tmp_path / "data")
    c = Client(server.address)
    c.create_table("s", sampler="fifo")
    c.insert("s", trajectories(60, tokens=16, id_prefix="s"))
    read = c.stream("s", "g", 10, visibility_timeout=600)
    step1 = next(read)
    c.commit_cut("s", "g", 1, step1.ids, tag="ckpt-1")
    step2 = next(read)
    c.commit_cut("s", "g", 2, step2.ids, tag="ckpt-2")
    step3 = next(read)  # the trainer crashes during step 3 (nothing committed)
    server = restart(server)
    c = Client(server.address)
    # The trainer resumes from its step-2 checkpoint: step 3's items come again, first.
    assert c.resume("s", "g", 2) == {"position": int(step2.ids[-1]) + 1, "inflight": 0}
    again = next(c.stream("s", "g", 10, visibility_timeout=600))
    assert list(again.ids) == list(step3.ids)
    # Resuming from step 1 instead redelivers steps 2 and 3.
    c.resume("s", "g", 1)
    redo = [int(i) for b in (next(c.stream("s", "g", 10)), next(c.stream("s", "g", 10))) for i in b.ids]
    assert redo == [int(i) for i in np.concatenate([step2.ids, step3.ids])]
    err = rpc_error(lambda: c.resume("s", "g", 9), grpc.StatusCode.NOT_FOUND)
    assert "no cut at step 9" in err.details()
    server.stop()


def test_cuts_record_manifests_that_a_restart_keeps_and_a_resume_rewinds(tmp_path):
    server = start_server(tmp_path / "data")
    c = Client(server.address)
    c.create_table("s", sampler="fifo")
    c.insert("s", trajectories(30, tokens=16, id_prefix="s", policy_version=3))
    assert c.commit_cut("s", "g", 0) == 0  # step 0, before the group's first read: creates it
    read = c.stream("s", "g", 10, visibility_timeout=600)
    steps = {step: next(read).ids.tolist() for step in (1, 2, 3)}
    for step, ids in steps.items():
        c.commit_cut("s", "g", step, ids)
    c.commit_cut("s", "g", 3, steps[3])  # a retried commit replaces, never adds
    server = restart(server)
    c = Client(server.address)
    for step, ids in steps.items():
        got, versions = c.manifest("s", step)
        assert got.tolist() == ids and versions.tolist() == [3] * 10
    c.resume("s", "g", 1)  # steps 2 and 3 are trained again: their manifests go
    assert rpc_error(lambda: c.manifest("s", 2), grpc.StatusCode.NOT_FOUND)
    again = next(c.stream("s", "g", 10, visibility_timeout=600)).ids.tolist()
    c.commit_cut("s", "g", 2, again)
    server = restart(server)
    c = Client(server.address)
    assert c.manifest("s", 2)[0].tolist() == again == steps[2]
    assert rpc_error(lambda: c.manifest("s", 3), grpc.StatusCode.NOT_FOUND)
    c.resume("s", "g", 0)
    assert next(c.stream("s", "g", 10)).ids.tolist() == steps[1]
    server.stop()


def test_a_second_server_on_the_same_data_dir_fails_with_a_clear_message(tmp_path):
    server = start_server(tmp_path / "data")
    with pytest.raises(RuntimeError, match="in use by expstore-server pid"):
        start_server(tmp_path / "data")
    server.stop()


def test_durable_tables_from_the_config_survive_a_restart(tmp_path):
    config = """
    [[tables]]
    name = "rollouts"
    sampler = { type = "uniform" }
    """
    server = start_server(tmp_path / "data", config)
    ids = Client(server.address).insert("rollouts", trajectories(5, id_prefix="a")).item_ids
    server.stop(signal.SIGKILL)
    server = start_server(server.data_dir, config)  # listens once the tables are restored
    c = Client(server.address)
    assert c.describe("rollouts").num_items == 5  # not recreated empty from the config
    assert c.get("rollouts", ids).data.column("traj_id").to_pylist() == [f"a-{i}" for i in range(5)]
    server.stop()


def test_kill_9_during_a_streaming_trainer_resumes_at_its_last_cut_without_loss_or_repeats(tmp_path):
    server = start_server(tmp_path / "data")
    c = Client(server.address)
    c.create_table("s", sampler="fifo")
    c.insert("s", trajectories(2000, tokens=16, id_prefix="s"))
    committed: dict[int, list[int]] = {}  # step -> item ids the trainer committed with its cut
    rng = random.Random(3)
    step = 0
    for round_ in range(3):
        stop = threading.Event()

        def train(address=server.address):
            nonlocal step
            client = Client(address, timeout=5)
            try:
                if committed:
                    client.resume("s", "trainer", max(committed))
                for batch in client.stream("s", "trainer", 16, poll_timeout=0.5, idle_timeout=2.0):
                    client.commit_cut("s", "trainer", step + 1, batch.ids)
                    step += 1
                    committed[step] = [int(i) for i in batch.ids]
                    if stop.is_set():
                        return
            except grpc.RpcError:
                return  # the server died: the step in progress was not committed

        trainer = threading.Thread(target=train)
        trainer.start()
        time.sleep(rng.uniform(0.3, 1.0))
        server.stop(signal.SIGKILL)
        stop.set()
        trainer.join()
        server = start_server(server.data_dir)
    # Resume at the last cut and read the rest: every item exactly once overall.
    c = Client(server.address)
    c.resume("s", "trainer", max(committed))
    rest = [int(i) for b in c.stream("s", "trainer", 256, poll_timeout=0.5, idle_timeout=1.0) for i in b.ids]
    seen = [i for ids in committed.values() for i in ids] + rest
    assert sorted(seen) == list(range(1, 2001)), "an item was lost or trained on twice"
    server.stop()
