"""The ``expstore stats --watch`` view (expstore_server.watch) with a fake clock."""

from __future__ import annotations

import io

import pytest

from expstore_server.watch import CLEAR, watch

BASE = {"items": 10, "sampler_eligible": 10, "policy_version": 3, "items_memory": 10, "items_ssd": 0,
        "items_remote": 0, "memory_bytes": 2048, "ssd_bytes": 1536, "inserts": 10, "samples": 4,
        "stream_deliveries": 0, "insert_waits": 1, "insert_wait_seconds": 0.5, "sample_waits": 0,
        "sample_wait_seconds": 0.0, "stream_waits": 0, "stream_wait_seconds": 0.0,
        "staleness.sample.le_0": 2, "staleness.sample.le_1": 4, "staleness.sample.le_2": 4, "staleness.sample.sum": 2,
        "staleness.stream.le_0": 0, "staleness.stream.le_1": 0, "staleness.stream.le_2": 0, "staleness.stream.sum": 0,
        "group.a.b.lag": 7, "group.a.b.inflight": 3, "group.a.b.delivered": 3}


class Fake:
    """Stats that grow by 10 inserts and 20 samples (0 versions behind) per refresh, 2 s apart."""

    def __init__(self) -> None:
        self.t, self.n, self.sleeps = 100.0, 0, []

    def fetch(self):
        fresh = 20 * self.n
        s = dict(BASE, inserts=10 + 10 * self.n, samples=4 + fresh, **{
            "staleness.sample.le_0": 2 + fresh, "staleness.sample.le_1": 4 + fresh, "staleness.sample.le_2": 4 + fresh})
        self.n += 1
        return {"rollouts": s}

    def clock(self):
        return self.t

    def sleep(self, dt):
        self.sleeps.append(dt)
        self.t += 2.0


class Terminal(io.StringIO):
    def isatty(self):
        return True


def run(out, count=2):
    fake = Fake()
    assert watch(fake.fetch, out, interval=2.0, count=count, clock=fake.clock, sleep=fake.sleep) == 0
    return fake


def test_plain_output_is_successive_blocks_with_rates_between_refreshes():
    out = io.StringIO()
    fake = run(out)
    assert fake.sleeps == [2.0]  # no sleep after the last refresh
    first, second = out.getvalue().split("\n\n")
    assert CLEAR not in out.getvalue()
    assert "inserted -   sampled -   streamed -" in first
    assert "inserted 5.0   sampled 10.0   streamed 0.0" in second
    assert "items 10  eligible 10  policy version 3" in second
    assert "2.0 KiB" in second and "1.5 KiB" in second  # memory and ssd bytes
    assert "insert 1 (0.50 s)" in second
    assert "sample mean 0.50, <=0 50%, <=1 100%" in first and "stream -" in first
    assert "sample mean 0.08, <=0 92%, <=1 100%" in second
    assert "group a.b  lag 7   unacked 3   delivered 3" in second


def test_terminal_output_redraws_each_refresh():
    out = Terminal()
    run(out, count=3)
    blocks = out.getvalue().split(CLEAR)
    assert blocks[0] == "" and len(blocks) == 4 and all(b.startswith("expstore stats") for b in blocks[1:])


@pytest.mark.parametrize("kw", [{"interval": 0}, {"count": 0}])
def test_bad_interval_or_count(kw):
    with pytest.raises(ValueError):
        watch(lambda: {}, io.StringIO(), **kw)
