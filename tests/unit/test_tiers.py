"""One conformance suite for the Tier protocol (expstore/tiers/base.py), run against every
backend: memory, RocksDB, and remote on file:// and on s3:// (a moto server on loopback),
and a table's Placement over them (memory only, and memory over RocksDB), which makes the
calls the engine makes on the SSD tier: encode, write, commit_put, get_rows."""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Callable

import numpy as np
import pyarrow as pa
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from expstore.errors import NotFound
from expstore.gather import take_rows
from expstore.placement import Placement
from expstore.schema import TRAJECTORY_V1
from expstore.synthetic import trajectories
from expstore.tiers import MemoryTier
from expstore.tiers.remote import RemoteTier
from expstore.tiers.rocks import open_rocks_tier


def chunk(n: int, seed: int = 0) -> pa.RecordBatch:
    """n rows of the full trajectory schema: list<int32>, list<struct> (turns), a map
    (reward_components), all-null columns, and schema metadata."""
    t = trajectories(n, tokens=(16, 48), groups=max(n // 2, 1), seed=seed, id_prefix=f"c{seed}").combine_chunks()
    columns = []
    for f in TRAJECTORY_V1:
        if f.name in t.column_names:
            columns.append(t[f.name].chunks[0])
        elif f.name == "reward_components":
            columns.append(pa.array([[("format", 1.0), ("correct", float(i % 2))] if i % 3 else None
                                     for i in range(n)], type=f.type))
        else:
            columns.append(pa.nulls(n, f.type))
    schema = TRAJECTORY_V1.with_metadata({"expstore.test": "conformance"})
    return pa.RecordBatch.from_arrays(columns, schema=schema)


def same(a: pa.RecordBatch, b: pa.RecordBatch) -> bool:
    return a.schema.equals(b.schema, check_metadata=True) and a.equals(b)


@dataclass
class Backend:
    name: str
    new: Callable[[], object]           # a tier at a fresh, empty location
    reopen: Callable[[object], object] | None  # a fresh instance on a tier's location; None: not persistent


def _closed(tier) -> None:
    if isinstance(tier, Placement):
        tier = tier.ssd
    close = getattr(tier, "close", None)
    if close is not None:
        close()


def _remote(base: Callable[[], str], storage_options: dict | None) -> Backend:
    where: dict[int, str] = {}

    def new():
        uri = base()
        tier = RemoteTier(uri, "t", storage_options=storage_options)
        where[id(tier)] = uri
        return tier

    def reopen(tier):
        uri = where[id(tier)]
        _closed(tier)
        again = RemoteTier(uri, "t", storage_options=storage_options)
        where[id(again)] = uri
        return again

    return Backend("remote", new, reopen)


BACKENDS = ["memory", "rocks", "file", "s3", "placement", "placement-ssd"]
_locations = itertools.count()


@pytest.fixture(params=BACKENDS)
def backend(request, tmp_path_factory) -> Backend:
    kind = request.param
    if kind == "memory":
        return Backend("memory", lambda: MemoryTier(1 << 30), None)
    if kind == "placement":  # a volatile table's
        return Backend(kind, lambda: Placement(MemoryTier(1 << 30)), None)
    if kind == "placement-ssd":  # a durable table's, its memory cache too small to keep a chunk
        return Backend(kind, lambda: Placement(MemoryTier(1 << 10), open_rocks_tier(
            str(tmp_path_factory.mktemp("rocks")), "t")), None)
    if kind == "file":
        return _remote(lambda: tmp_path_factory.mktemp("remote").as_uri(), None)
    if kind == "s3":
        s3 = request.getfixturevalue("s3_server")
        bucket = s3.bucket("tiers")
        return _remote(lambda: f"s3://{bucket}/p{next(_locations)}", s3.lance_options)
    where: dict[int, str] = {}

    def new():
        path = str(tmp_path_factory.mktemp("rocks"))
        tier = open_rocks_tier(path, "t")
        where[id(tier)] = path
        return tier

    def reopen(tier):
        path = where[id(tier)]
        _closed(tier)
        again = open_rocks_tier(path, "t")
        where[id(again)] = path
        return again

    return Backend("rocks", new, reopen)


@pytest.fixture
def tier(backend):
    t = backend.new()
    yield t
    _closed(t)


def test_put_get_round_trip(tier):
    batches = {0: chunk(5, seed=0), 1: chunk(1, seed=1), 7: chunk(12, seed=7)}
    for c, b in batches.items():
        tier.put(c, b)
    for c, b in batches.items():
        assert same(tier.get([c])[c], b)


def test_get_many_at_once(tier):
    batches = {c: chunk(3, seed=c) for c in range(10)}
    for c, b in batches.items():
        tier.put(c, b)
    got = tier.get([9, 2, 5, 0, 2])
    assert set(got) == {9, 2, 5, 0}
    assert all(same(got[c], batches[c]) for c in got)
    assert tier.get([]) == {}


def test_unknown_id_is_not_found_naming_the_chunk(tier):
    tier.put(0, chunk(2))
    with pytest.raises(NotFound, match="chunk 41"):
        tier.get([0, 41])
    with pytest.raises(NotFound, match="chunk 3"):
        tier.get([3])


def test_delete_is_idempotent(tier):
    tier.put(0, chunk(2, seed=0))
    tier.put(1, chunk(2, seed=1))
    tier.delete([0])
    tier.delete([0, 99])
    tier.delete([])
    assert len(tier) == 1
    with pytest.raises(NotFound, match="chunk 0"):
        tier.get([0])
    assert same(tier.get([1])[1], chunk(2, seed=1))


def test_nbytes_len_and_size_of(tier):
    assert (len(tier), tier.nbytes) == (0, 0)
    assert tier.budget > 0
    batches = {c: chunk(c + 1, seed=c) for c in range(4)}
    for c, b in batches.items():
        tier.put(c, b)
        assert tier.size_of(c) == b.get_total_buffer_size()
    assert len(tier) == 4
    assert tier.nbytes == sum(b.get_total_buffer_size() for b in batches.values())
    tier.delete([1, 3])
    assert len(tier) == 2
    assert tier.nbytes == batches[0].get_total_buffer_size() + batches[2].get_total_buffer_size()


def test_persists_across_reopen(backend):
    if backend.reopen is None:
        pytest.skip(f"the {backend.name} tier is not persistent")
    tier = backend.new()
    for c in range(4):
        tier.put(c, chunk(3, seed=c))
    tier.delete([2])
    nbytes = tier.nbytes
    again = backend.reopen(tier)
    assert (len(again), again.nbytes) == (3, nbytes)
    assert all(same(b, chunk(3, seed=c)) for c, b in again.get([0, 1, 3]).items())
    with pytest.raises(NotFound):
        again.get([2])
    again.put(4, chunk(2, seed=4))  # a reopened tier goes on writing
    assert same(again.get([4])[4], chunk(2, seed=4))
    _closed(again)


SMALL = {c: chunk(2, seed=c) for c in range(6)}


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=st.lists(st.tuples(st.sampled_from(["put", "delete", "get"]), st.integers(0, 5)), max_size=10))
def test_random_operations_match_a_dict(backend, ops):
    tier, model = backend.new(), {}
    for op, c in ops:
        if op == "put" and c not in model:  # chunk ids are written once, never reused
            tier.put(c, SMALL[c])
            model[c] = SMALL[c]
        elif op == "delete":
            tier.delete([c])
            model.pop(c, None)
        elif op == "get" and c in model:
            assert same(tier.get([c])[c], model[c])
        elif op == "get":
            with pytest.raises(NotFound):
                tier.get([c])
        assert len(tier) == len(model)
        assert tier.nbytes == sum(b.get_total_buffer_size() for b in model.values())
    assert {c: b.to_pydict() for c, b in tier.get(model).items()} == {c: b.to_pydict() for c, b in model.items()}
    _closed(tier)


def test_rows_read_as_the_engine_reads_them(backend):
    """A table plans its reads under its lock and fetches them outside it (from the SSD:
    ``get_rows``, the blocks in one multi-get); the rows are those ``get`` returns."""
    if not backend.name.startswith("placement"):
        pytest.skip("reads planned by a table's placement")
    tier = backend.new()
    batches = {c: chunk(5, seed=c) for c in range(3)}
    for c, b in batches.items():
        tier.put(c, b)
    chunks, rows = np.array([2, 0, 2, 1]), np.array([4, 0, 1, 3])
    plan = tier.plan(chunks, rows)
    data = take_rows(*tier.fetch(plan), chunk(1).schema)
    tier.finish(plan)
    expected = [batches[c].slice(r, 1).to_pylist()[0] for c, r in zip(chunks.tolist(), rows.tolist())]
    assert data.to_pylist() == expected
    tier.delete([0, 1, 2])  # nothing is left pinned: the chunks go at once
    assert (len(tier), tier.nbytes) == (0, 0)
    _closed(tier)
