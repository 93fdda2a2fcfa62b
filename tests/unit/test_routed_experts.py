"""The routed_experts column (R3 router replay, expstore/routed.py): declared by the
table's config, the narrowest id type, one entry of layers x top_k ids per token,
validated with the row, token and layer named, returned exactly as inserted."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest

from expstore.errors import InvalidArgument
from expstore.spec import RoutedExpertsSpec, TableSpec
from expstore.catalog import Catalog
from expstore.synthetic import trajectories
from expstore.table import Table
from expstore_client.batch import SampleBatch
from expstore_client.tensors import tensor_list

pytestmark = pytest.mark.timeout(60)
R3 = RoutedExpertsSpec(layers=3, top_k=2, num_experts=8)


def nested(experts: list) -> pa.Array:
    """Rows of per-token [layers][top_k] id lists, as a client sends them without the
    column's type (int64 lists: the table casts them)."""
    return pa.array(experts, pa.list_(pa.list_(pa.list_(pa.int64()))))


def with_experts(t: pa.Table, column) -> pa.Table:
    return t.append_column("routed_experts", column)


def rows_and_experts(n: int, tokens: int, spec: RoutedExpertsSpec = R3, seed: int = 0):
    t = trajectories(n, tokens=tokens, prompt_tokens=2, seed=seed)
    rng = np.random.default_rng(seed)
    experts = [rng.integers(0, spec.num_experts, (tokens, spec.layers, spec.top_k)) for _ in range(n)]
    return t, experts


def test_the_column_type_follows_the_model():
    assert Table(TableSpec("t", routed_experts=R3)).schema.field("routed_experts").type == \
        pa.list_(pa.list_(pa.list_(pa.uint8(), 2), 3))
    wide = RoutedExpertsSpec(layers=64, top_k=8, num_experts=300)
    assert Table(TableSpec("t", routed_experts=wide)).schema.field("routed_experts").type == \
        pa.list_(pa.list_(pa.list_(pa.uint16(), 8), 64))
    spec = TableSpec.from_dict({"name": "t", "routed_experts": {"layers": 64, "top_k": 8, "num_experts": 256}})
    assert spec.routed_experts == RoutedExpertsSpec(64, 8, 256) and TableSpec.from_dict(spec.to_dict()) == spec
    for bad, match in (({"layers": 0, "top_k": 1, "num_experts": 2}, "layers"),
                       ({"layers": 1, "top_k": 3, "num_experts": 2}, "top_k must be <= num_experts"),
                       ({"layers": 1, "top_k": 1, "num_experts": 70_000}, "65536"),
                       ({"layers": 1, "top_k": 1}, "num_experts")):
        with pytest.raises(InvalidArgument, match=match):
            TableSpec.from_dict({"name": "t", "routed_experts": bad})
    with pytest.raises(InvalidArgument, match="trajectory tables"):
        TableSpec("t", kind="generic", schema=pa.schema([("x", pa.int32())]), key_column="x", routed_experts=R3)


def test_rows_come_back_exactly_and_as_a_tensor():
    t = Table(TableSpec("t", routed_experts=R3))
    rows, experts = rows_and_experts(3, tokens=10)
    column = nested([e.tolist() for e in experts[:2]] + [None])  # row 2 recorded no routing
    t.insert(with_experts(rows, column))
    got = t.get([1, 2, 3]).data
    assert got.column("routed_experts").type == pa.list_(pa.list_(pa.list_(pa.uint8(), 2), 3))
    assert got.column("routed_experts").to_pylist() == column.to_pylist()
    batch = SampleBatch(ids=np.arange(2), data=pa.Table.from_batches([got.slice(0, 2)]), priorities=np.ones(2),
                        times_sampled=np.zeros(2), policy_versions=np.zeros(2))
    dense = batch.to_torch(["routed_experts"], pad_to="max")["routed_experts"]
    assert tuple(dense.shape) == (2, 10, 3, 2)  # (B, T, layers, top_k)
    np.testing.assert_array_equal(dense.numpy(), np.stack(experts[:2]))
    values, offsets = batch.to_numpy(["routed_experts"])["routed_experts"]
    assert values.shape == (20, 3, 2) and offsets.tolist() == [0, 10, 20]


def test_the_client_packs_arrays_in_the_narrowest_type():
    rows, experts = rows_and_experts(2, tokens=6)
    column = tensor_list(experts, R3.arrow_type)
    assert column.type == R3.arrow_type and column.to_pylist() == [e.tolist() for e in experts]
    t = Table(TableSpec("t", routed_experts=R3))
    t.insert(with_experts(rows, column))
    assert t.get([1, 2]).data.column("routed_experts").to_pylist() == column.to_pylist()


@pytest.mark.parametrize("edit, message", [
    (lambda e: e.__setitem__(1, e[1][:5]), "row 1, column 'routed_experts': 5 entries; expected 6, one per token"),
    (lambda e: e[0].__setitem__((2, 1, 1), 8),
     "row 0, column 'routed_experts': token 2, layer 1, expert 1: expert id 8; expected an id in [0, 8) "
     "(the table's num_experts)"),
    (lambda e: e[1].__setitem__((0, 0, 0), -1), "row 1, column 'routed_experts': token 0, layer 0, expert 0: "
                                                "expert id -1"),
])
def test_bad_entries_are_refused_naming_row_token_and_layer(edit, message):
    t = Table(TableSpec("t", routed_experts=R3))
    rows, experts = rows_and_experts(2, tokens=6)
    edit(experts)
    with pytest.raises(InvalidArgument) as e:
        t.insert(with_experts(rows, nested([x.tolist() for x in experts])))
    assert message in str(e.value)
    assert len(t) == 0


def test_shapes_and_nulls_inside_are_refused():
    t = Table(TableSpec("t", routed_experts=R3))
    rows, experts = rows_and_experts(1, tokens=6)
    cells = [x.tolist() for x in experts]
    cells[0][3] = cells[0][3][:2]  # token 3 has 2 layers
    with pytest.raises(InvalidArgument, match="row 0, column 'routed_experts': token 3 has 2 layers; expected 3"):
        t.insert(with_experts(rows, nested(cells)))
    cells = [x.tolist() for x in experts]
    cells[0][4][2] = [1, 2, 3]
    with pytest.raises(InvalidArgument, match="token 4, layer 2 has 3 experts; expected 2"):
        t.insert(with_experts(rows, nested(cells)))
    cells = [x.tolist() for x in experts]
    cells[0][5] = None
    with pytest.raises(InvalidArgument, match="token 5 is null"):
        t.insert(with_experts(rows, nested(cells)))
    cells = [x.tolist() for x in experts]
    cells[0][1][0][1] = None
    with pytest.raises(InvalidArgument, match="token 1, layer 0, expert 1 is null"):
        t.insert(with_experts(rows, nested(cells)))
    with pytest.raises(InvalidArgument, match="is not a list of per-token"):
        t.insert(with_experts(rows, pa.array([[1] * 6], pa.list_(pa.int64()))))
    assert len(t) == 0


def test_stored_and_restored_by_the_ssd_tier(tmp_path):
    store = Catalog(tmp_path / "d")
    t = store.create_table(TableSpec("t", routed_experts=RoutedExpertsSpec(4, 8, 256)))
    rows, experts = rows_and_experts(4, tokens=32, spec=RoutedExpertsSpec(4, 8, 256))
    t.insert(with_experts(rows, tensor_list(experts, t.schema.field("routed_experts").type)))
    store.close()
    store = Catalog(tmp_path / "d")
    got = store.table("t").get([1, 2, 3, 4]).data.column("routed_experts").to_pylist()
    assert got == [e.tolist() for e in experts]
    store.close()
