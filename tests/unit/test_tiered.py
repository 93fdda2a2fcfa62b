"""The tiered composition end to end: a table of ~0.5 GB of trajectories with a 32 MB
memory budget spills to the SSD tier and, past its watermark, to the remote tier; every
sampler still returns correct batches and its distribution is unchanged, with items
served from all three tiers."""

from __future__ import annotations

import shutil

import numpy as np
import pyarrow as pa
import pytest
from scipy import stats

from expstore.spec import SamplerSpec, TableSpec
from expstore.catalog import Catalog
from expstore.synthetic import trajectories
from expstore.tiers.remote import RemoteTier

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

TOKENS = 4096           # ~36 KiB per trajectory
ROWS_PER_INSERT = 128   # ~4.6 MiB chunks
INSERTS = 110           # ~0.5 GB in all
MEMORY_BYTES = 32 << 20
SSD_BYTES = 200 << 20


def fill(table, n_inserts: int = INSERTS, rows: int = ROWS_PER_INSERT) -> None:
    for i in range(n_inserts):
        t = trajectories(rows, tokens=TOKENS, groups=rows // 4, seed=i, id_prefix=f"b{i}")
        table.insert(t, priorities=np.full(rows, 1.0 + (i % 4)))
        while table.demote():
            pass


@pytest.fixture(scope="module")
def big(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiered")
    remote_uri = (root / "remote").as_uri()
    store = Catalog(root / "data", seed=0, remote=lambda name: RemoteTier(remote_uri, name))
    table = store.create_table(TableSpec("big", tiers="remote", memory_bytes=MEMORY_BYTES, ssd_bytes=SSD_BYTES,
                                         sampler=SamplerSpec("uniform"), max_size=10**6))
    fill(table)
    yield store, table
    store.close()
    shutil.rmtree(root)  # half a gigabyte: not kept until the session ends


def tier_of_items(table, durable: bool = False) -> dict[int, str]:
    """item id -> the fastest tier holding it (``durable``: the SSD or remote tier)."""
    ix, placement = table.parts.index, table.parts.placement
    live = ix.live_slots()
    where = placement.home if durable else placement.where
    return dict(zip(ix["id"][live].tolist(), (where(c) for c in ix["chunk"][live].tolist())))


def test_a_table_of_sixteen_memory_budgets_spills_over_all_three_tiers_within_its_budgets(big):
    _, table = big
    s = table.stats()
    assert s["items"] == INSERTS * ROWS_PER_INSERT
    assert s["memory_bytes"] <= MEMORY_BYTES
    assert s["items_memory"] > 0 and s["items_ssd"] > 0 and s["items_remote"] > 0, s
    assert s["ssd_bytes"] <= SSD_BYTES + (8 << 20)  # one chunk of slack: the mover runs after inserts


def test_uniform_samples_are_uniform_across_tiers_and_rows_are_exact(big):
    _, table = big
    where = tier_of_items(table)
    counts = {"memory": 0, "ssd": 0, "remote": 0}
    for _ in range(12):
        rows = table.sample(64)
        for item_id in rows.item_ids.tolist():
            counts[where[item_id]] += 1
        # The payload is the one inserted for that id: traj_id b<insert>-<row> <-> item id.
        ids = rows.data.column("traj_id").to_pylist()
        first = int(rows.item_ids[0])
        assert ids[0] == f"b{(first - 1) // ROWS_PER_INSERT}-{(first - 1) % ROWS_PER_INSERT}"
        assert rows.data.column("tokens").offsets.to_numpy()[-1] == TOKENS * len(ids)
    n = len(where)
    expected = [sum(v == t for v in where.values()) / n * sum(counts.values()) for t in counts]
    assert stats.chisquare(list(counts.values()), expected).pvalue > 1e-3, (counts, expected)
    assert all(counts.values())


def test_every_sampler_serves_from_a_tiered_table(tmp_path):
    remote_uri = (tmp_path / "remote").as_uri()
    store = Catalog(tmp_path / "data", seed=1, remote=lambda name: RemoteTier(remote_uri, name))
    samplers = [SamplerSpec("prioritized", alpha=1.0), SamplerSpec("fifo"), SamplerSpec("lifo"),
                SamplerSpec("max_heap"), SamplerSpec("min_heap"), SamplerSpec("group", group_size=4)]
    for spec in samplers:
        table = store.create_table(TableSpec(spec.type, tiers="remote", memory_bytes=4 << 20,
                                             ssd_bytes=8 << 20, sampler=spec))
        fill(table, n_inserts=12, rows=64)
        s = table.stats()
        assert s["items_remote"] and s["items_ssd"], (spec.type, s)
        rows = table.sample(16)
        ids = rows.item_ids
        assert rows.data.num_rows == 16 and pa.compute.all(pa.compute.equal(
            rows.data.column("traj_id"), table.get(ids).data.column("traj_id"))).as_py()
        if spec.type == "fifo":
            assert ids.tolist() == list(range(1, 17))  # the oldest: on the remote tier
        if spec.type == "lifo":
            assert ids.tolist() == list(range(12 * 64, 12 * 64 - 16, -1))
        if spec.type == "max_heap":
            assert (rows.priorities == 4.0).all()
        if spec.type == "group":
            groups = rows.data.column("group_id").to_pylist()
            assert all(groups.count(g) == 4 for g in groups)
    # Prioritized: batches are drawn in proportion to priority (1..4) across tiers.
    table = store.table("prioritized")
    pr = np.concatenate([table.sample(64).priorities for _ in range(30)])
    observed = [int((pr == p).sum()) for p in (1.0, 2.0, 3.0, 4.0)]
    assert stats.chisquare(observed, np.array([1, 2, 3, 4]) / 10 * len(pr)).pvalue > 1e-3, observed
    store.close()


def test_a_restart_finds_every_item_on_its_tier(big, tmp_path):
    store, table = big
    before = tier_of_items(table, durable=True)
    ids = np.array(sorted(before)[::997], dtype=np.uint64)
    data = table.get(ids).data
    root = store.db.path
    store.close()
    remote_uri = (root.parent / "remote").as_uri()
    again = Catalog(root, seed=0, remote=lambda name: RemoteTier(remote_uri, name))
    t = again.table("big")
    assert tier_of_items(t, durable=True) == before
    assert t.get(ids).data.equals(data)
    again.close()
