"""Task quotas and data versions in the task mixture (samplers/mixture.py): every batch
holds each task's minimum and never more than its maximum, exactly; a batch the tasks
cannot fill waits with the task named; samples can be restricted to data versions."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest

from expstore.errors import DeadlineExceeded, InvalidArgument
from expstore.samplers import Codebook, Fifo, GroupSampler, Items, TaskMixture, Uniform
from expstore.spec import SamplerSpec, TableSpec
from expstore.catalog import Catalog
from expstore.synthetic import trajectories
from expstore.table import Table

pytestmark = pytest.mark.timeout(60)


def codebook(*names: str) -> Codebook:
    cb = Codebook()
    cb.encode(pa.array(list(names), pa.string()))
    return cb


def items(tasks, groups=None, versions=None) -> Items:
    k = len(tasks)
    return Items(slots=np.arange(k), ids=np.arange(1, k + 1, dtype=np.uint64), priorities=np.ones(k),
                 groups=np.full(k, -1) if groups is None else np.asarray(groups),
                 group_sizes=np.zeros(k, np.int64), tasks=np.asarray(tasks, np.int64),
                 rewards=np.full(k, np.nan),
                 data_versions=None if versions is None else np.asarray(versions, np.int64))


def test_every_batch_holds_each_task_between_its_min_and_max():
    cb = codebook("a", "b", "c")
    # b would take nearly everything by weight: the quotas hold it to a quarter; the
    # excess is redrawn among a (up to its max) and c (above its min)
    mix = TaskMixture({"a": 1.0, "b": 100.0, "c": 1.0}, cb, Uniform,
                      quotas={"a": {"min": 0.25, "max": 0.5}, "b": {"max": 0.25}, "c": {"min": 0.125}})
    tasks = np.repeat([0, 1, 2], [20, 20, 20])
    mix.insert(items(tasks))
    rng = np.random.default_rng(0)
    counts = []
    for _ in range(300):
        per_task = np.bincount(tasks[mix.sample(8, rng).slots], minlength=3)
        assert per_task.sum() == 8
        assert 2 <= per_task[0] <= 4 and per_task[1] <= 2 and per_task[2] >= 1
        counts.append(per_task)
    counts = np.array(counts)
    assert set(counts[:, 0].tolist()) == {2, 3, 4} and counts[:, 1].mean() > 1.9


def test_a_batch_the_minimums_cannot_fill_waits_and_says_which_task():
    cb = codebook("a", "b")
    mix = TaskMixture({"*": 1.0}, cb, Fifo, quotas={"b": {"min": 0.5}})
    mix.insert(items([0, 0, 0, 0, 1]))  # b holds one item: a batch of 4 needs 2
    assert mix.can_sample(2) and not mix.can_sample(4)
    assert "task 'b' can serve 1 of the 2 units its min quota needs" in mix.explain(4)
    got = mix.sample(2, np.random.default_rng(0)).slots.tolist()
    assert sorted(got) == [0, 4]  # one of a, the min of b
    with pytest.raises(InvalidArgument, match="min quotas"):  # ceil(0.5 * 1) + ceil(0.6 * 1) > 1
        TaskMixture({"*": 1.0}, cb, Uniform, quotas={"a": {"min": 0.4}, "b": {"min": 0.5}}).sample(
            1, np.random.default_rng(0))


def test_a_table_sample_waits_for_the_task_that_holds_it_back():
    t = Table(TableSpec("t", sampler=SamplerSpec(type="uniform", task_quotas={"code": {"min": 0.5}})))
    t.insert(trajectories(8, tasks=["math"]))
    with pytest.raises(DeadlineExceeded, match="task 'code' has no items for its min quota"):
        t.sample(4, timeout=0)
    t.insert(trajectories(2, tasks=["code"], id_prefix="code"))
    batch = t.sample(4, timeout=0)
    assert batch.data.column("task").to_pylist().count("code") >= 2


def test_quotas_count_whole_groups():
    cb = codebook("a", "b")
    mix = TaskMixture({"*": 1.0}, cb, lambda: GroupSampler(2), unit=2, quotas={"a": {"max": 0.5}})
    groups = np.arange(12) // 2
    mix.insert(items([0] * 8 + [1] * 4, groups=groups))
    rng = np.random.default_rng(3)
    for _ in range(50):
        slots = mix.sample(8, rng).slots
        assert len(slots) == 8 and (slots < 8).sum() <= 4  # at most 2 of the 4 groups from a
        assert all(groups[slots[i]] == groups[slots[i + 1]] for i in range(0, 8, 2))


def test_quota_config_is_checked():
    ok = SamplerSpec(task_quotas={"a": {"min": 0.2, "max": 0.6}})
    assert ok.mixed and TableSpec.from_dict(TableSpec("t", sampler=ok).to_dict()).sampler == ok
    for bad, match in (({"a": {"min": 1.5}}, r"in \[0, 1\]"), ({"a": {"min": 0.6, "max": 0.5}}, "exceeds max"),
                       ({"a": {"min": 0.6}, "b": {"min": 0.6}}, "sum to 1.2"), ({"*": {"min": 0.1}}, "name tasks"),
                       ({"a": {"share": 0.1}}, "share")):
        with pytest.raises(InvalidArgument, match=match):
            SamplerSpec(task_quotas=bad)


def test_data_versions_restrict_a_sample_and_survive_a_restart(tmp_path):
    schema = pa.schema([("data_version", pa.int32())])
    spec = TableSpec("t", schema=schema, sampler=SamplerSpec(type="uniform", task_weights={"*": 1.0}))
    store = Catalog(tmp_path / "d")
    t = store.create_table(spec)
    for version in (1, 2, 3):
        rows = trajectories(4, tasks=["math"], id_prefix=f"v{version}")
        t.insert(rows.append_column("data_version", pa.array([version] * 4, pa.int32())))
    got = t.sample(64, timeout=0, data_versions={"math": (2, None)}).data.column("data_version").to_pylist()
    assert set(got) == {2, 3}
    store.close()
    store = Catalog(tmp_path / "d")
    t = store.table("t")
    got = t.sample(64, timeout=0, data_versions={"*": (None, 1)}).data.column("data_version").to_pylist()
    assert set(got) == {1}
    with pytest.raises(InvalidArgument, match="min 3 exceeds max 1"):
        t.sample(1, timeout=0, data_versions={"math": (3, 1)})
    store.close()
    with pytest.raises(InvalidArgument, match="needs task mixing"):
        Table(TableSpec("u", schema=schema)).sample(1, timeout=0, data_versions={"*": (0, 1)})
