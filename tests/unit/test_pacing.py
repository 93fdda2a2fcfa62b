"""Admission-paced staleness (expstore/pacing.py): producers reserve before they start a
rollout, the store grants while ``admitted + n <= (v + s + 1) * B``, nothing is removed
for lateness, leases expire, and all of it survives a restart.

The simulation at the end is the reason for the mode: with long and short tasks mixed,
eviction trains on long tasks less than their share started; pacing trains exactly the
share started. Engine-level with injected clocks: no sleeps."""

from __future__ import annotations

import threading

import numpy as np
import pyarrow as pa
import pytest

from expstore.errors import DeadlineExceeded, FailedPrecondition, InvalidArgument, NotFound
from expstore.journal import Journal
from expstore.spec import PacingSpec, SamplerSpec, TableSpec
from expstore.catalog import Catalog
from expstore.synthetic import trajectories
from expstore.table import Table

from _clock import T0, Wall

pytestmark = pytest.mark.timeout(120)


def paced(per_version: int = 4, staleness: int = 1, lease_s: float = 100.0, **kw) -> TableSpec:
    kw.setdefault("sampler", SamplerSpec("fifo"))
    kw.setdefault("max_times_sampled", 1)
    return TableSpec("t", max_staleness=staleness, pacing=PacingSpec(per_version, lease_s), **kw)


def rows(n: int, reservation: int | None, *, prefix: str, version: int = 0, task: str = "math") -> pa.Table:
    t = trajectories(n, tokens=12, id_prefix=prefix, policy_version=version, tasks=(task,))
    return t.append_column("reservation_id", pa.array([reservation] * n, pa.uint64()))


def test_reservations_are_granted_up_to_the_window_then_wait_for_the_trainer():
    t = Table(paced(per_version=4, staleness=1), wall_clock=Wall())
    grants = [t.reserve(2, timeout=0) for _ in range(4)]  # (0 + 1 + 1) * 4 = 8 rows
    assert [g.id for g in grants] == [1, 2, 3, 4] and all(g.count == 2 for g in grants)
    with pytest.raises(DeadlineExceeded, match=r"pacing: a reservation of 1 rows waits for the trainer: "
                                               r"8 rows admitted, 8 allowed at policy version 0"):
        t.reserve(1, timeout=0)
    t.set_policy_version(1)  # the limit moves by B
    assert t.reserve(4, timeout=0).id == 5
    with pytest.raises(DeadlineExceeded):
        t.reserve(1, timeout=0)
    s = t.stats()
    assert (s["pacing_admitted"], s["pacing_limit"], s["pacing_live_reservations"], s["reserve_waits"]) == (12, 12, 5, 0)


def test_a_reservation_wider_than_the_window_is_refused_at_once():
    t = Table(paced(per_version=4, staleness=1), wall_clock=Wall())
    with pytest.raises(InvalidArgument, match=r"reservation of 9 rows can never be granted: at most .* = 8 rows"):
        t.reserve(9, timeout=None)
    with pytest.raises(InvalidArgument, match="lease_s"):
        t.reserve(1, lease_s=0)


def test_inserts_settle_reservations_and_nothing_is_removed_for_staleness():
    t = Table(paced(per_version=2, staleness=0), wall_clock=Wall())
    r = t.reserve(2, timeout=0)
    t.insert(rows(1, r.id, prefix="a"))
    assert t.stats()["pacing_unused_rows"] == 1
    t.insert(rows(1, r.id, prefix="b"))  # the second row settles it
    s = t.stats()
    assert (s["pacing_live_reservations"], s["pacing_settled_rows"], s["pacing_admitted"]) == (0, 2, 2)
    assert t.set_policy_version(5) == 0  # 5 versions later: nothing evicted ...
    late = t.insert(rows(1, r.id, prefix="c", version=0))  # ... and a row far behind is stored
    assert late.num_inserted == 1 and late.num_stale == 0 and len(t) == 3
    s = t.stats()
    assert (s["pacing_late_rows"], s["pacing_admitted"], s["removed_stale"]) == (1, 3, 0)


def test_rows_without_a_granted_reservation_are_refused_naming_the_row():
    t = Table(paced(), wall_clock=Wall())
    r = t.reserve(1, timeout=0)
    with pytest.raises(InvalidArgument, match=r"row 0, column 'reservation_id': the table paces admission"):
        t.insert(trajectories(2, tokens=12))
    bad = pa.concat_tables([rows(1, r.id, prefix="a"), rows(1, 99, prefix="b")])
    with pytest.raises(InvalidArgument, match=r"row 1, column 'reservation_id': no reservation 99 was granted"):
        t.insert(bad)
    assert len(t) == 0 and t.stats()["pacing_unused_rows"] == 1  # nothing applied


def test_release_and_lease_expiry_give_rows_back():
    wall = Wall()
    t = Table(paced(per_version=2, staleness=0, lease_s=10.0), wall_clock=wall)
    a = t.reserve(1, timeout=0)
    b = t.reserve(1, timeout=0, lease_s=30.0)
    with pytest.raises(DeadlineExceeded):
        t.reserve(1, timeout=0)
    assert t.release(a.id) == 1 and t.release(a.id) == 0  # idempotent
    with pytest.raises(NotFound, match="no reservation 7 was granted"):
        t.release(7)
    c = t.reserve(1, timeout=0)
    assert c.deadline == T0 + 10 and b.deadline == T0 + 30
    wall.now = T0 + 10  # c's lease ends: its row goes back
    d = t.reserve(1, timeout=0)
    s = t.stats()
    assert (s["pacing_expired_rows"], s["pacing_released_rows"], s["pacing_admitted"]) == (1, 1, 2)
    t.insert(rows(1, c.id, prefix="late"))  # the producer of c was only slow: stored, charged anew
    assert len(t) == 1 and t.stats()["pacing_admitted"] == 3 and d.id == 4


def test_a_waiting_reservation_wakes_when_the_trainer_moves_on():
    t = Table(paced(per_version=1, staleness=0), wall_clock=Wall())
    t.reserve(1, timeout=0)
    got = []
    waiter = threading.Thread(target=lambda: got.append(t.reserve(1, timeout=30)))
    waiter.start()
    while t.stats()["reserve_waits"] == 0:
        threading.Event().wait(0.001)
    t.set_policy_version(1)
    waiter.join()
    assert got[0].id == 2 and got[0].policy_version == 1


def test_reserve_on_an_unpaced_table_and_bad_specs():
    with pytest.raises(FailedPrecondition, match="does not pace admission"):
        Table(TableSpec("t")).reserve(1, timeout=0)
    with pytest.raises(InvalidArgument, match="pacing needs max_staleness"):
        TableSpec("t", pacing=PacingSpec(4))
    with pytest.raises(InvalidArgument, match="rollouts_per_version must be an integer >= 1"):
        TableSpec.from_dict({"name": "t", "max_staleness": 1, "pacing": {"rollouts_per_version": 0}})
    spec = TableSpec.from_dict({"name": "t", "max_staleness": 1, "pacing": {"rollouts_per_version": 8, "lease_s": 60}})
    assert spec.pacing == PacingSpec(8, 60) and TableSpec.from_dict(spec.to_dict()) == spec


@pytest.mark.parametrize("snapshots", [False, True])
def test_reservations_and_leases_survive_a_restart(tmp_path, monkeypatch, snapshots):
    monkeypatch.setattr(Journal, "wants_snapshot", lambda self: snapshots)
    wall = Wall()
    monkeypatch.setattr(Catalog, "_open", lambda self, s, storage: Table(s, seed=0, storage=storage, wall_clock=wall))
    store = Catalog(tmp_path / "d")
    t = store.create_table(paced(per_version=4, staleness=0, lease_s=10.0))
    a = t.reserve(2, timeout=0)                       # settled by one row, one left
    b = t.reserve(1, timeout=0, lease_s=100.0)        # live across the restart
    c = t.reserve(1, timeout=0)                       # released
    t.insert(rows(1, a.id, prefix="a"))
    t.release(c.id)
    wall.now = T0 + 5
    store.close()

    store = Catalog(tmp_path / "d")
    t = store.table("t")
    s = t.stats()
    assert (s["pacing_admitted"], s["pacing_live_reservations"], s["pacing_unused_rows"]) == (3, 2, 2)
    with pytest.raises(DeadlineExceeded):
        t.reserve(2, timeout=0)
    assert t.reserve(1, timeout=0).id == 4  # ids go on
    wall.now = T0 + 10  # a's lease ends at its original deadline, not 10 s after the restart
    assert t.stats()["pacing_admitted"] == 3
    t.insert(rows(1, b.id, prefix="b"))
    store.close()

    store = Catalog(tmp_path / "d")
    t = store.table("t")
    s = t.stats()
    assert (s["pacing_admitted"], s["pacing_live_reservations"]) == (3, 1)  # 4's lease is live until T0 + 15
    assert len(t) == 2
    store.close()


# -- the mix of short and long tasks ------------------------------------------------------

SHORT, LONG = 1, 12  # rollout durations, in ticks of the simulation
B, S = 8, 2  # rows per policy version, staleness bound


def simulate(mode: str, *, slots: int = 32, ticks: int = 400, seed: int = 0) -> dict[str, int]:
    """A discrete-time run: ``slots`` producers, each starting a rollout (long or short
    with probability 1/2) whenever it is free (paced: once it holds a reservation), and
    one trainer taking a batch of B whenever one is there, then setting the next policy
    version. Returns the tasks started and trained, by kind, once the rollouts started
    have all come back and the trainer has taken what it can."""
    rng = np.random.default_rng(seed)
    wall = Wall()
    spec = paced(per_version=B, staleness=S) if mode == "paced" else \
        TableSpec("t", sampler=SamplerSpec("fifo"), max_times_sampled=1, max_staleness=S)
    table = Table(spec, wall_clock=wall, seed=seed)
    running: list[tuple[int, str, int, int | None]] = []  # (done at tick, kind, version, reservation)
    free, started, trained, k = slots, {"long": 0, "short": 0}, {"long": 0, "short": 0}, 0
    for tick in range(ticks + LONG + 1):
        while free and tick < ticks:  # producers start rollouts
            reservation = None
            if mode == "paced":
                try:
                    reservation = table.reserve(1, timeout=0).id
                except DeadlineExceeded:
                    break
            kind = "long" if rng.random() < 0.5 else "short"
            running.append((tick + (LONG if kind == "long" else SHORT), kind, table.policy_version, reservation))
            started[kind] += 1
            free -= 1
        for done in [r for r in running if r[0] == tick]:  # rollouts come back
            running.remove(done)
            _, kind, version, reservation = done
            data = rows(1, reservation, prefix=f"r{k}", version=version, task=kind) if mode == "paced" else \
                trajectories(1, tokens=12, id_prefix=f"r{k}", policy_version=version, tasks=(kind,))
            table.insert(data)
            k += 1
            free += 1
        while len(table) >= B:  # the trainer: one step per batch there
            for kind in table.sample(B, timeout=0).data.column("task").to_pylist():
                trained[kind] += 1
            table.set_policy_version(table.policy_version + 1)
    for kind in table.sample(len(table), timeout=0).data.column("task").to_pylist() if len(table) else []:
        trained[kind] += 1  # the last partial batch: trained too
    return {"started_long": started["long"], "started_short": started["short"],
            "trained_long": trained["long"], "trained_short": trained["short"]}


def test_pacing_trains_long_tasks_at_their_share_started_where_eviction_under_trains_them():
    evicting, paced_run = simulate("evict"), simulate("paced")
    for name, run in (("evicting", evicting), ("paced", paced_run)):
        started = run["started_long"] / (run["started_long"] + run["started_short"])
        trained = run["trained_long"] / max(1, run["trained_long"] + run["trained_short"])
        print(f"{name}: long tasks {started:.3f} of those started, {trained:.3f} of those trained {run}")
    # paced: every rollout started is trained, so the shares are equal exactly
    assert paced_run["trained_long"] == paced_run["started_long"] > 100
    assert paced_run["trained_short"] == paced_run["started_short"] > 100
    # evicting: long rollouts come back more than S versions late and are dropped
    started = evicting["started_long"] / (evicting["started_long"] + evicting["started_short"])
    trained = evicting["trained_long"] / (evicting["trained_long"] + evicting["trained_short"])
    assert trained < started / 2
    # a chi-square test of independence (kind x trained): p far below 1e-6
    table = np.array([[evicting["trained_long"], evicting["started_long"] - evicting["trained_long"]],
                      [evicting["trained_short"], evicting["started_short"] - evicting["trained_short"]]], float)
    expected = table.sum(1, keepdims=True) * table.sum(0, keepdims=True) / table.sum()
    assert ((table - expected) ** 2 / expected).sum() > 24  # chi2(1) > 24: p < 1e-6
