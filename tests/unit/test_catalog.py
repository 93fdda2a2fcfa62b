"""Store: the table registry (create, if_not_exists, drop, lookup errors, close)."""

from __future__ import annotations

import pyarrow as pa
import pytest

from expstore.errors import AlreadyExists, DeadlineExceeded, NotFound, Unavailable
from expstore.spec import SamplerSpec, TableSpec
from expstore.catalog import Catalog
from expstore.synthetic import trajectories
from expstore.table import Table


def rows(n=3, prefix="traj"):
    return trajectories(n, tokens=8, id_prefix=prefix)


def test_create_and_lookup():
    s = Catalog()
    t = s.create_table(TableSpec("a"))
    assert isinstance(t, Table) and t.name == "a"
    assert s.table("a") is t
    s.create_table(TableSpec("c"))
    s.create_table(TableSpec("b"))
    assert [x.name for x in s.tables()] == ["a", "b", "c"]


def test_create_existing_is_already_exists():
    s = Catalog()
    t = s.create_table(TableSpec("a"))
    with pytest.raises(AlreadyExists, match="'a'"):
        s.create_table(TableSpec("a"))
    with pytest.raises(AlreadyExists):
        s.create_table(TableSpec("a", max_size=10))
    assert s.table("a") is t


def test_if_not_exists_same_spec_returns_existing():
    s = Catalog()
    schema = pa.schema([("k", pa.string())])
    spec = TableSpec("g", kind="generic", schema=schema, key_column="k",
                     sampler=SamplerSpec("prioritized", alpha=0.6))
    t = s.create_table(spec)
    t.insert(pa.table({"k": ["x"]}))
    same = TableSpec("g", kind="generic", schema=pa.schema([("k", pa.string())]), key_column="k",
                     sampler=SamplerSpec("prioritized", alpha=0.6))
    assert s.create_table(same, if_not_exists=True) is t
    assert len(s.table("g")) == 1  # not recreated


def test_if_not_exists_different_spec_is_already_exists():
    s = Catalog()
    s.create_table(TableSpec("a", max_size=10))
    with pytest.raises(AlreadyExists, match="different"):
        s.create_table(TableSpec("a", max_size=11), if_not_exists=True)
    with pytest.raises(AlreadyExists):
        s.create_table(TableSpec("a", max_size=10, sampler=SamplerSpec("fifo")), if_not_exists=True)
    assert s.table("a").spec.max_size == 10


def test_if_not_exists_creates_when_absent():
    s = Catalog()
    t = s.create_table(TableSpec("a"), if_not_exists=True)
    assert s.table("a") is t


def test_unknown_table_lists_known_tables():
    s = Catalog()
    with pytest.raises(NotFound, match=r"'nope'.*none"):
        s.table("nope")
    s.create_table(TableSpec("beta"))
    s.create_table(TableSpec("alpha"))
    with pytest.raises(NotFound, match=r"'nope'.*alpha, beta"):
        s.table("nope")
    with pytest.raises(NotFound, match=r"'nope'.*alpha, beta"):
        s.drop_table("nope")


def test_drop_closes_table_and_frees_name():
    s = Catalog()
    t = s.create_table(TableSpec("a"))
    t.insert(rows())
    s.drop_table("a")
    with pytest.raises(NotFound):
        s.table("a")
    assert s.tables() == []
    with pytest.raises(Unavailable):
        t.sample(1, timeout=0)
    with pytest.raises(NotFound):
        s.drop_table("a")
    fresh = s.create_table(TableSpec("a"))
    assert fresh is not t and len(fresh) == 0
    with pytest.raises(DeadlineExceeded):
        fresh.sample(1, timeout=0)


def test_close_closes_every_table():
    s = Catalog()
    a, b = s.create_table(TableSpec("a")), s.create_table(TableSpec("b"))
    s.close()
    for t in (a, b):
        with pytest.raises(Unavailable):
            t.insert(rows())


def test_seeded_stores_sample_alike():
    def draw(seed):
        s = Catalog(seed=seed)
        s.create_table(TableSpec("first"))
        t = s.create_table(TableSpec("second"))
        t.insert(rows(50))
        return t.sample(30).item_ids.tolist()

    assert draw(7) == draw(7)
    assert draw(7) != draw(8)


def test_tables_are_independent():
    s = Catalog()
    a, b = s.create_table(TableSpec("a")), s.create_table(TableSpec("b"))
    a.insert(rows(3))
    assert len(a) == 3 and len(b) == 0
    assert b.insert(rows(3)).item_ids.tolist() == [1, 2, 3]  # ids are per table


def test_a_generic_table_is_restored_with_its_schema_and_rows(tmp_path):
    schema = pa.schema([("key", pa.string()), ("value", pa.large_binary())])
    store = Catalog(tmp_path / "d")
    t = store.create_table(TableSpec("g", kind="generic", schema=schema, key_column="key"))
    ids = t.insert(pa.table({"key": ["a", "b"], "value": [b"1", b"22"]}, schema=schema)).item_ids
    store.close()
    store = Catalog(tmp_path / "d")
    assert not store.unopened
    g = store.table("g")
    assert g.schema.equals(schema)
    assert g.get(ids).data.column("value").to_pylist() == [b"1", b"22"]
    store.close()
