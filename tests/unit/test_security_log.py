"""expstore_server.security_log: the audit log's lines are bounded, and so are its files."""

from __future__ import annotations

import json

from expstore_server.security_log import SecurityLog


def test_a_burst_of_lines_rotates_within_max_bytes_and_keeps_the_newest_in_order(tmp_path):
    log = SecurityLog(tmp_path / "audit.jsonl", max_bytes=4096, backups=3)
    for i in range(2000):  # queued faster than they are written: bursts of many lines
        log.record(who="w", method="Insert", table=f"t{i:05d}" + "x" * 1000, outcome="OK", detail="d" * 10_000)
    log.close()
    names = ["audit.jsonl.3", "audit.jsonl.2", "audit.jsonl.1", "audit.jsonl"]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(names)
    assert all((tmp_path / n).stat().st_size <= 4096 for n in names)
    kept = [json.loads(line) for n in names for line in (tmp_path / n).read_text().splitlines()]
    assert [int(e["table"][1:6]) for e in kept] == list(range(2000 - len(kept), 2000))
    assert all(e["table"].endswith("...[750 more characters]") and e["detail"].endswith("[9744 more characters]")
               for e in kept)
