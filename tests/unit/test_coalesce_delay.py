"""The insert coalescer's group-commit delay (server/expstore_server/coalesce.py): after a
group of several calls, the next group waits for the rest of its crowd when fewer calls
than that are queued, until as many are queued (or the delay is over); a lone producer,
or a crowd already queued, never waits; a group that finds more calls queued than the
last group had stays open while calls keep coming (``gap_s``). The clock is the test's: the coalescer is handed
a ``wait`` that records each wait, lets calls arrive during it and records whether the
crowd was complete at its end, and a ``run`` that records each group and lets calls
arrive during its commit; one test waits on the real clock for a crowd that comes back."""

from __future__ import annotations

import asyncio

import numpy as np
import pyarrow as pa

from expstore.errors import InvalidArgument
from expstore.spec import SamplerSpec, TableSpec
from expstore.synthetic import trajectories
from expstore.table import Table
from expstore_server.arrivals import Line
from expstore_server.coalesce import InsertCoalescer, Pending

DELAY_S = 0.5  # never really waited: the test's wait only records it
GAP_S = 0.001


def _table() -> Table:
    return Table(TableSpec(name="t", kind="trajectory", sampler=SamplerSpec(type="fifo"), max_size=10_000), seed=0)


def _insert(coalescer: InsertCoalescer, table: Table, name: str, seed: int):
    """A producer's Insert call of two rows (traj_ids ``name-0``, ``name-1``), queued in
    a line of its own: its answer, once committed."""
    rows = trajectories(2, tokens=4, id_prefix=f"{name}-", seed=seed)
    call = Pending([rows], np.ones(2), None, rows.nbytes, alone=_never_alone)
    return coalescer.insert(table, call, Line().arrive(0), None)


class _Crowd:
    """Producers' calls into one table, and what the coalescer did with them: the calls
    of each group committed, the waits it took. ``arrive_during_commit[k]`` calls
    arrive while the k-th group is committed, ``arrive_during_wait[k]`` during the k-th
    wait."""

    def __init__(self, arrive_during_commit: dict[int, int], arrive_during_wait: dict[int, int],
                 delay_s: float = DELAY_S, gap_s: float = 0.0) -> None:
        self.table = _table()
        self.groups: list[list[str]] = []
        self.waits: list[float] = []
        self.complete: list[bool] = []  # whether each wait's crowd was all queued at its end
        self.calls: list[asyncio.Task] = []
        self._during_commit, self._during_wait = arrive_during_commit, arrive_during_wait
        self._sent = 0
        self.coalescer = InsertCoalescer(self._run, delay_s=delay_s, gap_s=gap_s, wait=self._wait)

    async def arrive(self, n: int) -> None:
        """``n`` new calls start; each has joined the queue on return."""
        for _ in range(n):
            name = f"call{self._sent}"
            self._sent += 1
            self.calls.append(asyncio.create_task(_insert(self.coalescer, self.table, name, self._sent)))
        await asyncio.sleep(0)  # each runs up to its queue.append

    async def answers(self) -> list:
        """Every call's answer, once all have one (calls keep arriving meanwhile)."""
        while not all(c.done() for c in self.calls):
            await asyncio.gather(*self.calls)
        return [c.result() for c in self.calls]

    async def _run(self, fn, table, group):
        self.groups.append([c.parts[0].column("traj_id")[0].as_py().split("-")[0] for c in group])
        await self.arrive(self._during_commit.get(len(self.groups) - 1, 0))
        return fn(table, group)

    async def _wait(self, crowd: asyncio.Future, seconds: float) -> None:
        self.waits.append(seconds)
        await self.arrive(self._during_wait.get(len(self.waits) - 1, 0))
        self.complete.append(crowd.done())


async def _never_alone(*args):
    raise AssertionError("a group that commits whole never commits its calls one by one")


def test_after_a_group_of_several_calls_the_next_waits_for_the_rest_of_its_crowd():
    async def main():
        crowd = _Crowd(arrive_during_commit={0: 1}, arrive_during_wait={0: 2})
        await crowd.arrive(3)
        results = await crowd.answers()
        # Without the wait, the call that arrived during the first commit would have been
        # committed alone, and the two behind it together: [call3], [call4, call5].
        assert crowd.groups == [["call0", "call1", "call2"], ["call3", "call4", "call5"]]
        assert crowd.waits == [DELAY_S] and crowd.complete == [True]  # three queued: the wait ends
        assert [r.num_inserted for r in results] == [2] * 6 and len(crowd.table) == 12

    asyncio.run(main())


def test_a_lone_producer_never_waits():
    async def main():
        crowd = _Crowd(arrive_during_commit={}, arrive_during_wait={})
        for _ in range(3):  # one call at a time, each answered before the next starts
            await crowd.arrive(1)
            await crowd.calls[-1]
        assert crowd.groups == [["call0"], ["call1"], ["call2"]] and crowd.waits == []

    asyncio.run(main())


def test_a_crowd_already_queued_goes_at_once_and_a_group_of_one_does_not_wait():
    async def main():
        # Two calls, then two arrive during their commit (no wait: as many as the last
        # group are queued), then one during the next commit (after a group of two,
        # fewer are queued: a wait, during which nobody comes), then none.
        crowd = _Crowd(arrive_during_commit={0: 2, 1: 1}, arrive_during_wait={})
        await crowd.arrive(2)
        await crowd.answers()
        assert crowd.groups == [["call0", "call1"], ["call2", "call3"], ["call4"]]
        assert crowd.waits == [DELAY_S] and crowd.complete == [False]  # one of two: waits it out

    asyncio.run(main())


def test_a_growing_crowds_group_stays_open_while_its_calls_keep_coming():
    async def main():
        # Three calls; four arrive during their commit (more than the last group: a
        # growing crowd), so the second group stays open: one more call comes within the
        # gap, then nobody.
        crowd = _Crowd(arrive_during_commit={0: 4}, arrive_during_wait={0: 1}, gap_s=GAP_S)
        await crowd.arrive(3)
        await crowd.answers()
        assert crowd.groups == [["call0", "call1", "call2"], ["call3", "call4", "call5", "call6", "call7"]]
        assert crowd.waits == [GAP_S, GAP_S] and crowd.complete == [True, False]

    asyncio.run(main())


def test_producers_back_to_back_never_hold_their_group_open():
    async def main():
        # Two producers back to back: their next calls are queued by the end of each
        # commit, never more than the last group had: no group waits.
        crowd = _Crowd(arrive_during_commit={k: 2 for k in range(6)}, arrive_during_wait={}, gap_s=GAP_S)
        await crowd.arrive(2)
        await crowd.answers()
        assert [len(g) for g in crowd.groups] == [2] * 7 and crowd.waits == []

    asyncio.run(main())


def test_no_delay_means_no_wait():
    async def main():
        crowd = _Crowd(arrive_during_commit={0: 1}, arrive_during_wait={0: 2}, delay_s=0.0)
        await crowd.arrive(3)
        await crowd.answers()
        assert crowd.groups == [["call0", "call1", "call2"], ["call3"]] and crowd.waits == []

    asyncio.run(main())


def test_the_wait_ends_once_as_many_calls_as_the_last_group_are_queued():
    """On the real clock: three producers' calls are committed together while a fourth
    producer's call arrives; the three come back with their next calls as soon as they
    are answered, and the next group goes then, without waiting out a delay far longer
    than the test's timeout."""
    async def main():
        table, committed, late = _table(), [], []

        async def run(fn, table, group):
            committed.append(len(group))
            if len(committed) == 1:  # the fourth producer's call arrives during the commit
                late.append(asyncio.create_task(call()))
                await asyncio.sleep(0)
            return fn(table, group)

        coalescer = InsertCoalescer(run, delay_s=3600.0)
        sent = 0

        async def call():
            nonlocal sent
            sent += 1
            return await _insert(coalescer, table, f"c{sent}", sent)

        async def producer():
            for _ in range(2):  # back to back: the second call once the first is answered
                await call()

        await asyncio.wait_for(asyncio.gather(*(producer() for _ in range(3))), timeout=60)
        await asyncio.wait_for(late[0], timeout=60)
        assert committed == [3, 4] and len(table) == 14

    asyncio.run(main())


def test_a_group_that_fails_validation_is_taken_again_in_halves_until_the_bad_call_is_alone():
    """Eight calls queued together, the sixth (call5) with an invalid row: its group, then
    the half it is in, fail; the calls that pass are still committed in groups, and
    call5 ends alone, with its own error."""
    async def scenario():
        table, groups = _table(), []

        async def run(fn, table, group):
            groups.append([c.parts[0].column("traj_id")[0].as_py().split("-")[0] for c in group])
            return fn(table, group)

        coalescer = InsertCoalescer(run, delay_s=0.0, gap_s=0.0)
        calls = []
        for i in range(8):
            rows = trajectories(2, tokens=4, id_prefix=f"call{i}-", seed=i)
            if i == 5:
                at = rows.schema.get_field_index("loss_mask")
                rows = rows.set_column(at, rows.schema.field(at), pa.array([[2] * 4, [1] * 4], pa.list_(pa.uint8())))
            call = Pending([rows], np.ones(2), None, rows.nbytes, alone=_never_alone)
            calls.append(asyncio.ensure_future(coalescer.insert(table, call, Line().arrive(0), None)))
        answers = await asyncio.gather(*calls, return_exceptions=True)
        return groups, answers

    groups, answers = asyncio.run(scenario())
    names = [[f"call{i}" for i in ids] for ids in ([0, 1, 2, 3, 4, 5, 6, 7], [0, 1, 2, 3], [4, 5, 6, 7], [4, 5],
                                                   [4], [5, 6, 7], [5], [6, 7])]
    assert groups == names
    assert isinstance(answers[5], InvalidArgument) and "loss_mask" in str(answers[5])
    assert all(a.num_inserted == 2 for i, a in enumerate(answers) if i != 5)
