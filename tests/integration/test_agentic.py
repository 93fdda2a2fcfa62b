"""Long-horizon agentic RL features over the wire: the table config of group timeouts,
ingest checks, routed experts and task quotas round-trips through CreateTable and
Describe; a violating row is INVALID_ARGUMENT; routed experts go in as (T, layers, top_k)
arrays and come back as a (B, T, layers, top_k) tensor; a sample names data versions."""

from __future__ import annotations

import grpc
import numpy as np
import pyarrow as pa
import pytest

from ._util import rpc_error, trajectories


def test_the_config_round_trips_and_reaches_the_engine(client, table_name, drop):
    info = client.create_table(
        table_name, sampler={"type": "group", "group_size": 2, "task_quotas": {"math": {"min": 0.5, "max": 1.0}}},
        group_timeout_s=30.0, group_timeout_action="drop", ingest_checks=["turns_mask", "extends"],
        routed_experts={"layers": 4, "top_k": 2, "num_experts": 16})
    drop(table_name)
    config = client.describe(table_name).config
    assert config == info.config
    assert config["group_timeout_s"] == 30.0 and config["group_timeout_action"] == "drop"
    assert config["ingest_checks"] == ["extends", "turns_mask"]
    assert config["routed_experts"] == {"layers": 4, "top_k": 2, "num_experts": 16}
    assert config["sampler"]["task_quotas"] == {"math": {"min": 0.5, "max": 1.0}}
    schema = client.describe(table_name).schema
    assert schema.field("routed_experts").type == pa.list_(pa.list_(pa.list_(pa.uint8(), 2), 4))
    assert schema.field("group_released_partial").type == pa.bool_()
    assert schema.field("episode_id").type == pa.string()
    # the same config again is "the same table"
    client.create_table(
        table_name, sampler={"type": "group", "group_size": 2, "task_quotas": {"math": {"min": 0.5, "max": 1.0}}},
        group_timeout_s=30.0, group_timeout_action="drop", ingest_checks=["extends", "turns_mask"],
        routed_experts={"layers": 4, "top_k": 2, "num_experts": 16}, if_not_exists=True)
    e = rpc_error(lambda: client.create_table(table_name + "_bad", ingest_checks=["retokenize"]),
                  grpc.StatusCode.INVALID_ARGUMENT)
    assert "ingest_checks" in e.details()


def test_an_episode_that_does_not_extend_is_refused_over_the_wire(client, table_name, drop):
    client.create_table(table_name, ingest_checks=["extends"])
    drop(table_name)
    first = trajectories(1, tokens=12, prompt_tokens=4, id_prefix="turn1")
    first = first.append_column("episode_id", pa.array(["ep"]))
    client.insert(table_name, first)
    tokens = first.column("tokens").to_pylist()[0]
    second = trajectories(1, tokens=16, prompt_tokens=4, id_prefix="turn2")
    rewritten = tokens[:5] + [tokens[5] + 1] + tokens[6:] + [7, 7, 7, 7]  # a retokenized turn
    second = second.set_column(second.schema.get_field_index("tokens"), "tokens",
                               pa.array([rewritten], second.schema.field("tokens").type))
    second = second.set_column(second.schema.get_field_index("prompt_id"), "prompt_id", first.column("prompt_id"))
    second = second.append_column("episode_id", pa.array(["ep"]))
    e = rpc_error(lambda: client.insert(table_name, second), grpc.StatusCode.INVALID_ARGUMENT)
    assert f"row 0, column 'tokens': token 5 is {tokens[5] + 1}, but the episode's earlier row (item 1) " \
           f"has {tokens[5]} there" in e.details()
    assert client.stats(table_name)[table_name]["items"] == 1


def test_routed_experts_arrays_in_a_tensor_out(client, table_name, drop):
    client.create_table(table_name, routed_experts={"layers": 3, "top_k": 2, "num_experts": 8})
    drop(table_name)
    client.describe(table_name)  # the client learns the column's type
    rng = np.random.default_rng(0)
    rows = trajectories(2, tokens=(10, 14), id_prefix="r3").to_pylist()
    experts = [rng.integers(0, 8, (len(r["tokens"]), 3, 2)) for r in rows]
    client.insert(table_name, [dict(r, routed_experts=e) for r, e in zip(rows, experts)])
    batch = client.get(table_name, [1, 2])
    dense = batch.to_torch(["routed_experts"], pad_to="max")["routed_experts"]
    width = max(len(e) for e in experts)
    assert tuple(dense.shape) == (2, width, 3, 2)
    for i, e in enumerate(experts):
        np.testing.assert_array_equal(dense[i, :len(e)].numpy(), e)
    bad = [dict(rows[0], traj_id="r3_bad", routed_experts=np.full((len(rows[0]["tokens"]), 3, 2), 8))]
    e = rpc_error(lambda: client.insert(table_name, bad), grpc.StatusCode.INVALID_ARGUMENT)
    assert "row 0, column 'routed_experts': token 0, layer 0, expert 0: expert id 8" in e.details()


def test_a_sample_names_its_data_versions(client, table_name, drop):
    client.create_table(table_name, schema=pa.schema([("data_version", pa.int32())]),
                        sampler={"type": "uniform", "task_weights": {"*": 1.0}})
    drop(table_name)
    for version in (1, 2, 3):
        rows = trajectories(4, id_prefix=f"v{version}")
        client.insert(table_name, rows.append_column("data_version", pa.array([version] * 4, pa.int32())))
    got = client.sample(table_name, 32, data_versions={"*": (2, None)}).data.column("data_version").to_pylist()
    assert set(got) == {2, 3}
    got = client.sample(table_name, 32, data_versions={"math": (None, 1)}).data.column("data_version").to_pylist()
    assert set(got) == {1}
