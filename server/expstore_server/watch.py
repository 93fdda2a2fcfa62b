"""``expstore stats --watch``: a live terminal view of the figures the metrics export.

Each refresh fetches the tables' stats (the Stats RPC, or an offline store) and renders
one block per table: items and bytes per tier, insert / sample / stream rates computed
against the previous refresh, rate-limiter waits, staleness of returned items, and lag
and unacked deliveries per consumer group. On a terminal each block replaces the last;
otherwise (a pipe, a file, a test) blocks follow each other. :func:`figures` gives the
same figures as data, for the web console.
"""

from __future__ import annotations

import time
from typing import Callable, TextIO

Stats = dict[str, dict[str, float]]
CLEAR = "\033[H\033[2J"
TIERS = ("memory", "ssd", "remote")
RATES = (("inserted", "inserts"), ("sampled", "samples"), ("streamed", "stream_deliveries"))
GROUP_FIELDS = (("lag", "lag"), ("unacked", "inflight"), ("delivered", "delivered"),
                ("redelivered", "redelivered"), ("acked", "acked"))


def watch(fetch: Callable[[], Stats], out: TextIO, *, interval: float = 2.0, count: int | None = None,
          clock: Callable[[], float] = time.monotonic, sleep: Callable[[float], None] = time.sleep) -> int:
    """Render ``fetch()`` every ``interval`` seconds, ``count`` times (None: until
    interrupted). Returns the exit code."""
    if interval <= 0:
        raise ValueError(f"--interval must be > 0, got {interval}")
    if count is not None and count < 1:
        raise ValueError(f"--count must be >= 1, got {count}")
    previous: tuple[Stats, float] | None = None
    refreshes = 0
    while True:
        stats, now = fetch(), clock()
        block = render(stats, previous, now, interval)
        out.write(CLEAR + block if out.isatty() else ("\n" if refreshes else "") + block)
        out.flush()
        previous, refreshes = (stats, now), refreshes + 1
        if count is not None and refreshes >= count:
            return 0
        sleep(interval)


def render(stats: Stats, previous: tuple[Stats, float] | None, now: float, interval: float) -> str:
    """One refresh: a header line, then a block per table."""
    lines = [f"expstore stats  {time.strftime('%H:%M:%S')}  every {interval:g} s"]
    for table in sorted(stats):
        s = stats[table]
        before = None
        if previous is not None and table in previous[0] and now > previous[1]:
            before = (previous[0][table], now - previous[1])
        lines += _table_block(table, s, before)
    return "\n".join(lines) + "\n"


def figures(s: dict[str, float], before: tuple[dict[str, float], float] | None) -> dict:
    """The figures of one table's stats, as data: what ``stats --watch`` prints and the
    console shows. ``before``: (the stats of an earlier refresh, seconds since), for the
    rates (None: rates unknown)."""
    rates = {label: None if before is None else (s[key] - before[0].get(key, 0)) / before[1] for label, key in RATES}
    return {
        "items": s["items"], "eligible": s["sampler_eligible"], "policy_version": s["policy_version"],
        "tiers": {t: {"items": s.get(f"items_{t}"), "bytes": s.get(f"{t}_bytes")} for t in TIERS},
        "rates": rates,
        "waits": {op: {"calls": s[f"{op}_waits"], "seconds": s[f"{op}_wait_seconds"]}
                  for op in ("insert", "sample", "stream")},
        "staleness": {op: staleness(s, op, total) for op, total in (("sample", "samples"),
                                                                    ("stream", "stream_deliveries"))},
        "groups": _groups(s),
    }


def staleness(s: dict[str, float], op: str, total_key: str) -> dict:
    """Items returned by ``op``, their mean versions behind, and (bound, items within it)
    for each staleness bucket."""
    total = s[total_key]
    bounds = sorted(int(k.rsplit("_", 1)[1]) for k in s if k.startswith(f"staleness.{op}.le_"))
    return {"total": total, "mean": s[f"staleness.{op}.sum"] / total if total else None,
            "buckets": [(b, s[f"staleness.{op}.le_{b}"]) for b in bounds]}


def _table_block(table: str, s: dict[str, float], before: tuple[dict[str, float], float] | None) -> list[str]:
    f = figures(s, before)
    lines = [f"{table}  items {_n(f['items'])}  eligible {_n(f['eligible'])}  "
             f"policy version {_n(f['policy_version'])}",
             _line("", "".join(t.rjust(12) for t in TIERS)),
             _line("items", "".join(_cell(f["tiers"][t]["items"], _n) for t in TIERS)),
             _line("bytes", "".join(_cell(f["tiers"][t]["bytes"], _bytes) for t in TIERS)),
             _line("rate /s", "   ".join(f"{label} {'-' if r is None else f'{r:.1f}'}"
                                        for label, r in f["rates"].items())),
             _line("waits", "   ".join(f"{op} {_n(w['calls'])} ({w['seconds']:.2f} s)" for op, w in f["waits"].items())),
             _line("staleness", "   ".join(f"{op} {_staleness(st)}" for op, st in f["staleness"].items()))]
    for group, fields in sorted(f["groups"].items()):
        lines.append(_line(f"group {group}", "   ".join(
            f"{label} {_n(fields[key])}" for label, key in GROUP_FIELDS if key in fields)))
    return lines


def _line(label: str, text: str) -> str:
    return f"  {label:<10} {text}"


def _staleness(st: dict) -> str:
    """Mean versions behind, and the share of items within each bucket up to all of them."""
    total = st["total"]
    if not total:
        return "-"
    parts = [f"mean {st['mean']:.2f}"]
    for bound, within in st["buckets"]:
        parts.append(f"<={bound} {100 * within / total:.0f}%")
        if within == total:
            break
    return ", ".join(parts)


def _groups(s: dict[str, float]) -> dict[str, dict[str, float]]:
    """group.<name>.<field> keys by group name (names may contain dots)."""
    out: dict[str, dict[str, float]] = {}
    for k, v in s.items():
        if k.startswith("group."):
            name, _, field = k[len("group."):].rpartition(".")
            out.setdefault(name, {})[field] = v
    return out


def _cell(value: float | None, fmt: Callable[[float], str]) -> str:
    return (fmt(value) if value is not None else "-").rjust(12)


def _n(v: float) -> str:
    return str(int(v)) if float(v).is_integer() else f"{v:g}"


def _bytes(v: float) -> str:
    units = ("B", "KiB", "MiB", "GiB", "TiB")
    i = 0
    while abs(v) >= 1024 and i < len(units) - 1:
        v, i = v / 1024, i + 1
    return f"{v:.0f} B" if i == 0 else f"{v:.1f} {units[i]}"
