"""The Client over the wire: round trips (Sample, Stream, Get), idempotent retries, large
batches split across messages, compression, SampleBatch views, and every insert form."""

from __future__ import annotations

import itertools
import json
import threading

import grpc
import numpy as np
import pyarrow as pa
import pytest

from expstore_client import Client, Ragged

from ._util import (as_numpy_rows, num_items, pb, raw_stub, rpc_error, tokens_by_traj,
                    trajectories)


@pytest.fixture
def table(client, table_name):
    client.create_table(table_name)
    yield table_name
    client.drop_table(table_name)


def inside(array: np.ndarray, buffer: pa.Buffer) -> bool:
    """Whether the numpy array's memory lies inside the Arrow buffer (no copy)."""
    start = array.ctypes.data
    return buffer.address <= start and start + array.nbytes <= buffer.address + buffer.size


# -- ids, retries --------------------------------------------------------------------------

def test_insert_returns_ids_and_retry_is_idempotent(client, table):
    data = trajectories(8, id_prefix="idem")
    first = client.insert(table, data)
    assert first.num_inserted == 8 and first.num_duplicates == 0
    assert first.item_ids.dtype == np.uint64 and len(set(first.item_ids.tolist())) == 8
    again = client.insert(table, data)  # a retry after a lost response
    assert again.num_inserted == 0 and again.num_duplicates == 8
    assert again.item_ids.tolist() == first.item_ids.tolist()
    assert num_items(client, table) == 8
    # A partly new batch: known rows report their stored ids, new rows get new ones.
    mixed = pa.concat_tables([data.slice(6, 2), trajectories(3, id_prefix="new")])
    res = client.insert(table, mixed)
    assert res.num_inserted == 3 and res.num_duplicates == 2
    assert res.item_ids[:2].tolist() == first.item_ids[6:].tolist()
    assert min(res.item_ids[2:].tolist()) > max(first.item_ids.tolist())
    assert num_items(client, table) == 11
    assert client.stats(table)[table]["duplicates"] == 10


def test_concurrent_retries_store_each_row_once(shared_server, client, table):
    """Producers racing to insert the same traj_ids: every row is stored exactly once and
    every caller learns the same ids."""
    data = trajectories(50, id_prefix="race")
    results = [None] * 8

    def insert(i):
        with Client(shared_server.address) as c:
            results[i] = c.insert(table, data)

    threads = [threading.Thread(target=insert, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    assert sum(r.num_inserted for r in results) == 50
    assert all(r.num_inserted + r.num_duplicates == 50 for r in results)
    assert len({tuple(r.item_ids.tolist()) for r in results}) == 1
    assert num_items(client, table) == 50


# -- round trips ----------------------------------------------------------------------------

def test_get_sample_stream_round_trip(client, table):
    data = trajectories(30, tokens=(9, 300), id_prefix="rt", seed=3)
    ids = client.insert(table, data).item_ids
    expected = tokens_by_traj(data)
    by_id = dict(zip(ids.tolist(), data.column("traj_id").to_pylist()))

    got = client.get(table, ids[::-1])
    assert got.ids.tolist() == ids[::-1].tolist()
    assert got.data.column("traj_id").to_pylist() == data.column("traj_id").to_pylist()[::-1]
    assert tokens_by_traj(got.data) == expected
    assert got.data.column("logprobs").to_pylist() == data.column("logprobs").to_pylist()[::-1]

    batch = client.sample(table, 64, timeout=2)
    assert len(batch) == 64 and len(batch.ids) == 64
    assert len(batch.probabilities) == 64 and len(batch.weights) == 64
    for item_id, traj, toks in zip(batch.ids.tolist(), batch.data.column("traj_id").to_pylist(),
                                   batch.data.column("tokens").to_pylist()):
        assert by_id[item_id] == traj and expected[traj] == toks
    assert np.allclose(batch.probabilities, 1 / 30)

    seen = []
    for b in client.stream(table, "rt", 7, poll_timeout=0.2, idle_timeout=0.2):
        assert tokens_by_traj(b.data) == {t: expected[t] for t in b.data.column("traj_id").to_pylist()}
        seen += b.ids.tolist()
        b.ack()
    assert seen == ids.tolist()  # insertion order, each once


def test_get_with_no_ids(client, table):
    client.insert(table, trajectories(2))
    got = client.get(table, [])
    assert len(got) == 0 and got.data.schema.names == client.describe(table).schema.names


def test_compressed_round_trip_equals_plain(client, table):
    data = trajectories(40, tokens=512, id_prefix="z")
    ids = client.insert(table, data, compress=True).item_ids  # zstd on the way in, too
    plain = client.get(table, ids)
    packed = client.get(table, ids, compress=True)
    assert packed.data.equals(plain.data)
    assert plain.data.column("tokens").to_pylist() == data.column("tokens").to_pylist()
    sampled = client.sample(table, 16, compress=True)
    assert tokens_by_traj(sampled.data).items() <= tokens_by_traj(data).items()


@pytest.fixture
def small_message_server(server_factory):
    return server_factory("[server]\nmessage_bytes = 65536\n")


def test_large_batches_split_and_reassemble(small_message_server):
    """Server and client both cut at 64 KiB: ~36 KiB rows travel a few per message."""
    address = small_message_server.address
    with Client(address, message_bytes=64 << 10) as c:
        c.create_table("big")
        data = trajectories(48, tokens=4096, id_prefix="big")
        ids = c.insert("big", data).item_ids
        assert len(ids) == 48

        channel, stub = raw_stub(address)
        messages = list(stub.Get(pb.GetRequest(table="big", item_ids=list(map(int, ids))), timeout=10))
        assert len(messages) >= 10, len(messages)
        assert sum(len(m.item_ids) for m in messages) == 48
        assert all(len(m.item_ids) == len(m.priorities) == len(m.times_sampled) for m in messages)
        zipped = list(stub.Get(pb.GetRequest(table="big", item_ids=list(map(int, ids)), compress=True),
                               timeout=10))
        assert sum(len(m.arrow_ipc) for m in zipped) < sum(len(m.arrow_ipc) for m in messages)
        sampled = list(stub.Sample(pb.SampleRequest(table="big", batch_size=40, timeout_s=1), timeout=10))
        assert len(sampled) > 1
        assert all(len(m.item_ids) == len(m.probabilities) == len(m.weights) for m in sampled)
        channel.close()

        got = c.get("big", ids)
        assert got.ids.tolist() == ids.tolist()
        assert got.data.column("tokens").to_pylist() == data.column("tokens").to_pylist()
        batch = c.sample("big", 40, compress=True)
        assert len(batch) == 40 and len(batch.weights) == 40
        expected = tokens_by_traj(data)
        by_id = dict(zip(ids.tolist(), data.column("traj_id").to_pylist()))
        for item_id, traj, toks in zip(batch.ids.tolist(), batch.data.column("traj_id").to_pylist(),
                                       batch.data.column("tokens").to_pylist()):
            assert by_id[item_id] == traj and expected[traj] == toks
        streamed = []
        for b in c.stream("big", "g", 48, poll_timeout=0.2, idle_timeout=0.2):
            streamed += b.data.column("traj_id").to_pylist()
            b.ack()
        assert streamed == data.column("traj_id").to_pylist()


def test_client_receive_limit(shared_server, client, table):
    """A client whose receive limit is below the server's message size gets a status."""
    ids = client.insert(table, trajectories(4, tokens=512)).item_ids
    with Client(shared_server.address, max_message_bytes=10_000) as small:
        err = rpc_error(lambda: small.get(table, ids))
        assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert len(small.get(table, ids[:0])) == 0  # the channel still works


# -- SampleBatch views ----------------------------------------------------------------------

@pytest.mark.parametrize("compress", [False, True])
def test_to_numpy_is_zero_copy(client, table, compress):
    data = trajectories(12, tokens=(10, 90), id_prefix="np")
    ids = client.insert(table, data).item_ids
    batch = client.get(table, ids, compress=compress)
    arrays = batch.to_numpy()
    tokens = arrays["tokens"]
    assert isinstance(tokens, Ragged)
    assert tokens.values.dtype == np.int32 and tokens.offsets[0] == 0
    assert as_numpy_rows(tokens.values, tokens.offsets) == data.column("tokens").to_pylist()
    assert np.array_equal(np.diff(tokens.offsets), batch.lengths("tokens"))
    col = batch.column("tokens")
    assert not tokens.values.flags.owndata
    assert inside(tokens.values, col.values.buffers()[1]), "tokens were copied"
    mask = arrays["loss_mask"]
    assert mask.values.dtype == np.uint8
    assert as_numpy_rows(mask.values, mask.offsets) == data.column("loss_mask").to_pylist()
    reward = arrays["reward"]
    assert reward.dtype == np.float32 and np.array_equal(reward, data.column("reward").to_numpy())
    assert inside(reward, batch.column("reward").buffers()[1]), "reward was copied"
    assert arrays["policy_version"].tolist() == [0] * 12
    assert arrays["traj_id"].tolist() == data.column("traj_id").to_pylist()


@pytest.mark.filterwarnings("ignore:The given NumPy array is not writable")
def test_to_torch(client, table):
    torch = pytest.importorskip("torch")
    data = trajectories(6, tokens=(10, 40), id_prefix="pt", seed=7)
    ids = client.insert(table, data).item_ids
    batch = client.get(table, ids)
    rows = data.column("tokens").to_pylist()
    lengths = [len(r) for r in rows]

    packed = batch.to_torch(["tokens", "reward"])
    assert isinstance(packed["tokens"], Ragged)
    assert packed["tokens"].values.dtype == torch.int32
    assert packed["tokens"].offsets.tolist() == np.concatenate([[0], np.cumsum(lengths)]).tolist()
    assert packed["tokens"].values.tolist() == [t for r in rows for t in r]
    view = batch.to_numpy(["tokens"])["tokens"].values
    assert packed["tokens"].values.data_ptr() == view.ctypes.data  # same memory, no copy
    assert packed["reward"].dtype == torch.float32 and packed["reward"].shape == (6,)

    dense = batch.to_torch(["tokens"], pad_to="max", pad_value=-1)
    dense.update(batch.to_torch(["loss_mask"], pad_to="max"))
    assert tuple(dense["tokens"].shape) == (6, max(lengths))
    for i, r in enumerate(rows):
        assert dense["tokens"][i, :len(r)].tolist() == r
        assert (dense["tokens"][i, len(r):] == -1).all()
    assert dense["loss_mask"].dtype == torch.uint8 and tuple(dense["loss_mask"].shape) == (6, max(lengths))

    cut = batch.to_torch(["tokens"], pad_to=16)["tokens"]
    assert tuple(cut.shape) == (6, 16)
    for i, r in enumerate(rows):
        assert cut[i].tolist() == (r + [0] * 16)[:16]

    everything = batch.to_torch()
    assert "traj_id" not in everything and "tokens" in everything and "policy_version" in everything


# -- insert forms --------------------------------------------------------------------------

def test_insert_list_of_dicts_with_maps_and_turns(client, table):
    rows = [
        {"traj_id": "d-0", "prompt_id": "p0", "task": "code", "group_id": "g0", "group_size": 2,
         "tokens": [5, 6, 7, 8, 9, 10], "loss_mask": [0, 0, 1, 1, 0, 1],
         "logprobs": [0.0, 0.0, -0.5, -0.25, 0.0, -1.0], "policy_version": 3,
         "turns": [{"role": "user", "start": 0, "end": 2},
                   {"role": "assistant", "start": 2, "end": 4, "tool_name": "python",
                    "tool_args": '{"x": 1}'},
                   {"role": "tool", "start": 4, "end": 5, "tool_result": "1", "tool_status": "ok",
                    "latency_ms": 12.5},
                   {"role": "assistant", "start": 5, "end": 6}],
         "reward": 1.0, "step_rewards": [0.0, 0.5, 0.0, 0.5],
         "reward_components": {"tests_passed": 1.0, "length_penalty": -0.125},
         "finish_reason": "stop", "metadata": json.dumps({"seed": 1})},
        {"traj_id": "d-1", "prompt_id": "p0", "task": "code", "group_id": "g0", "group_size": 2,
         "tokens": [5, 6, 11], "loss_mask": [0, 0, 1], "logprobs": [0.0, 0.0, -2.0],
         "policy_version": 3, "reward": 0.0, "reward_components": {"tests_passed": 0.0},
         "finish_reason": "length"},
    ]
    ids = client.insert(table, rows).item_ids
    got = client.get(table, ids).data.to_pylist()
    for sent, back in zip(rows, got):
        assert back["traj_id"] == sent["traj_id"] and back["tokens"] == sent["tokens"]
        assert dict(back["reward_components"]) == sent["reward_components"]
        assert back["policy_version"] == 3 and back["group_size"] == 2
    turns = got[0]["turns"]
    assert [t["role"] for t in turns] == ["user", "assistant", "tool", "assistant"]
    assert [(t["start"], t["end"]) for t in turns] == [(0, 2), (2, 4), (4, 5), (5, 6)]
    assert turns[1]["tool_name"] == "python" and turns[2]["latency_ms"] == 12.5
    assert turns[0]["tool_name"] is None
    assert got[1]["turns"] is None and got[1]["step_rewards"] is None
    assert json.loads(got[0]["metadata"]) == {"seed": 1}


def test_insert_dict_of_numpy_arrays(client, table):
    b, t = 5, 12
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 1000, (b, t))  # int64, 2-D: one row per trajectory
    mask = np.zeros((b, t), np.uint8)
    mask[:, 4:] = 1
    logprobs = np.where(mask == 1, -rng.random((b, t)), 0.0)  # float64
    data = {"traj_id": np.array([f"n-{i}" for i in range(b)]), "prompt_id": np.array(["p"] * b),
            "task": np.array(["math"] * b), "tokens": tokens, "loss_mask": mask, "logprobs": logprobs,
            "policy_version": np.arange(b, dtype=np.int64), "reward": rng.random(b),
            "finish_reason": np.array(["stop"] * b)}
    ids = client.insert(table, data).item_ids
    got = client.get(table, ids)
    assert got.data.column("tokens").to_pylist() == tokens.tolist()
    assert got.data.column("tokens").type == pa.list_(pa.int32())
    assert got.data.column("loss_mask").to_pylist() == mask.tolist()
    assert np.allclose(np.array(got.data.column("logprobs").to_pylist()), logprobs, atol=1e-6)
    assert got.policy_versions.tolist() == list(range(b))
    assert got.data.column("traj_id").to_pylist() == [f"n-{i}" for i in range(b)]


def test_insert_pa_table_and_record_batch(client, table):
    data = trajectories(6, id_prefix="tab")
    ids = client.insert(table, data).item_ids
    rb = trajectories(3, id_prefix="rb").to_batches()[0]
    ids2 = client.insert(table, rb).item_ids
    got = client.get(table, np.concatenate([ids, ids2]))
    assert got.data.column("traj_id").to_pylist() == [f"tab-{i}" for i in range(6)] + [f"rb-{i}" for i in range(3)]


def test_extra_user_columns_are_kept(client, table_name):
    client.create_table(table_name, schema=pa.schema([("difficulty", pa.float32()),
                                                      ("tags", pa.list_(pa.string()))]))
    try:
        rows = trajectories(2).to_pylist()
        rows[0]["difficulty"], rows[0]["tags"] = 0.5, ["a", "b"]
        ids = client.insert(table_name, rows).item_ids
        got = client.get(table_name, ids).data
        assert got.column("difficulty").to_pylist() == [0.5, None]
        assert got.column("tags").to_pylist() == [["a", "b"], None]
    finally:
        client.drop_table(table_name)


def test_generic_table_with_key_column(client, table_name):
    schema = pa.schema([("key", pa.string()), ("value", pa.float64())])
    client.create_table(table_name, kind="generic", schema=schema, key_column="key", sampler="fifo")
    try:
        res = client.insert(table_name, [{"key": "a", "value": 1.0}, {"key": "b", "value": 2.0}])
        again = client.insert(table_name, [{"key": "b", "value": 9.0}])
        assert again.num_duplicates == 1 and again.item_ids.tolist() == res.item_ids[1:].tolist()
        assert client.sample(table_name, 2).data.to_pylist() == [{"key": "a", "value": 1.0},
                                                                {"key": "b", "value": 2.0}]
    finally:
        client.drop_table(table_name)


def test_priorities_and_update(client, table_name):
    client.create_table(table_name, sampler={"type": "prioritized", "alpha": 1.0, "beta": 1.0})
    try:
        ids = client.insert(table_name, trajectories(4), priorities=[1.0, 0.0, 0.0, 0.0]).item_ids
        assert set(client.sample(table_name, 32).ids.tolist()) == {int(ids[0])}
        assert client.update_priorities(table_name, ids, [0.0, 0.0, 0.0, 5.0]).num_updated == 4
        batch = client.sample(table_name, 32)
        assert set(batch.ids.tolist()) == {int(ids[3])}
        assert np.allclose(batch.probabilities, 1.0) and np.allclose(batch.priorities, 5.0)
        assert client.get(table_name, ids).priorities.tolist() == [0.0, 0.0, 0.0, 5.0]
    finally:
        client.drop_table(table_name)


def test_list_describe_stats(client, table):
    client.insert(table, trajectories(3))
    info = client.describe(table)
    assert info.name == table and info.num_items == 3 and info.config["sampler"]["type"] == "uniform"
    assert "tokens" in info.schema.names
    assert table in [t.name for t in client.list_tables()]
    stats = client.stats()
    assert stats[table]["items"] == 3 and stats[table]["inserts"] == 3


def test_insert_future_and_prefetching_sampler(client, table_name):
    client.create_table(table_name, max_times_sampled=0)
    futures = [client.insert_future(table_name, trajectories(8, id_prefix=f"f{i}")) for i in range(4)]
    results = [f.result(timeout=30) for f in futures]
    assert sum(r.num_inserted for r in results) == 32
    assert sorted(int(i) for r in results for i in r.item_ids) == list(range(1, 33))
    bad = client.insert_future(table_name, [dict(traj_id="x")])  # missing required columns
    with pytest.raises(grpc.RpcError) as e:
        bad.result(timeout=30)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT

    it = client.sampler(table_name, 16, prefetch=3)
    batches = list(itertools.islice(it, 5))
    it.close()  # cancels the calls still in flight
    assert all(len(b) == 16 for b in batches)
    assert {int(i) for b in batches for i in b.ids} <= set(range(1, 33))
    assert client.stats(table_name)[table_name]["samples"] >= 5 * 16
    with pytest.raises(ValueError):
        next(client.sampler(table_name, 16, prefetch=0))


def test_share_prefixes_is_set_over_the_wire_and_groups_come_back_whole(client, table_name):
    group = trajectories(16, tokens=640, prompt_tokens=512, groups=1, shared_prompts=True, seed=3)
    stored = {}
    for share in (False, True):
        name = f"{table_name}_{int(share)}"
        info = client.create_table(name, share_prefixes=share, tiers="memory", max_size=100)
        assert info.config["share_prefixes"] is share
        ids = client.insert(name, group).item_ids
        stored[share] = client.stats(name)[name]["memory_bytes"]
        rows = client.get(name, ids).data.sort_by("traj_id")
        whole = ["traj_id", "tokens", "loss_mask", "logprobs"]
        assert rows.select(whole).to_pylist() == group.sort_by("traj_id").select(whole).to_pylist(), "rows come back whole"
        client.drop_table(name)
    assert stored[True] * 3 < stored[False], stored
    assert client.create_table(table_name).config["share_prefixes"] is True  # the default
    client.drop_table(table_name)
