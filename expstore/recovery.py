"""Rebuilding a durable table after a restart, and the snapshots that bound it.

``restore`` loads the latest snapshot (``write_snapshot`` wrote it: the index columns of
the live items, keys, codebooks, consumer groups, rate limiter, placement, quarantine),
replays every journal record after it (records.py: each kind its own typed record and
``replay``), then *adopts* the chunks the items reference: from the SSD, or the remote
tier where the journal's demotions put them (no remote I/O). All of it runs under the
table lock, with the journal off (``Table.replaying``).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import numpy as np

from . import group_timeouts, records
from .errors import DataLoss
from .index import COLUMNS

if TYPE_CHECKING:
    from .table import Table

log = logging.getLogger("expstore.table")


def write_snapshot(table: "Table") -> None:
    """The whole state as one journal snapshot, written now (lock held); older records
    are dropped."""
    table.parts.journal.write_snapshot(snapshot_fields(table))


def snapshot_fields(table: "Table") -> dict:
    """The whole state, for a journal snapshot (lock held): index columns of live items in
    id order, keys, codebooks, consumer groups, rate limiter, placement, quarantine. Copies
    only: the snapshot may be packed and written after the lock is released."""
    p = table.parts
    ix = p.index
    live = ix.live_slots()
    fields = {f"col_{name}": ix[name][live] for name in COLUMNS}
    fields.update(
        keys=p.keys.keys_of(live) if p.keys is not None else None,
        group_names=p.groups.names, task_names=p.tasks.names,
        next_id=ix.next_id, policy_version=table.policy_version, touches=table.touches,
        limiter=p.limiter.state(), consumers=p.consumers.to_dicts(),
        **p.quarantine.to_fields(), **p.chunks.placement.state())
    if p.timeouts is not None:
        fields["group_timeouts"] = p.timeouts.state(p.groups.name)
    if p.pacing is not None:
        fields["pacing"] = p.pacing.state()
    if p.retention is not None:
        fields["retention"] = p.retention.state()
    if p.keys is not None:
        fields["removed_keys"], fields["removed_ids"] = p.keys.removed()
    return fields


def restore(table: "Table") -> dict[str, int]:
    """Rebuild a durable table from its journal (lock held): the latest snapshot, then
    every record after it, then the chunks the items reference. Items whose chunk is in
    no tier are dropped and counted if they were acknowledged at durability ``memory``
    before a crash; if they were acknowledged at ``wal`` or ``fsync``, DataLoss is raised
    and nothing is dropped. Returns what was restored."""
    p = table.parts
    snapshot, entries = p.journal.load()
    table.replaying = True
    try:
        if snapshot is not None:
            _load_snapshot(table, snapshot)
        n = 0
        for kind, fields in entries:
            records.decode(kind, fields).replay(table)
            n += 1
    finally:
        table.replaying = False
    lost = _adopt_chunks(table)
    if p.checks is not None:
        _rebuild_lineage(table)
    if p.chunks.placement.legacy:  # record the demotions: the next start needs no listing
        write_snapshot(table)
    table.counters.clear()  # stats count what this process did; replay is not that
    return {"items": len(p.index), "records": n, "lost": lost, "quarantined": len(p.quarantine)}


def _load_snapshot(table: "Table", s: dict) -> None:
    p = table.parts
    for name in s["group_names"]:
        p.groups.code(name)
    for name in s["task_names"]:
        p.tasks.code(name)
    ids = s["col_id"]
    s.setdefault("col_touched", ids.astype(np.int64))  # snapshots before it: insertion order
    for name in ("episode", "data_version"):  # snapshots before them: none
        s.setdefault(f"col_{name}", np.zeros(len(ids), np.int64))
    rows = {name: s[f"col_{name}"] for name in COLUMNS if name not in ("id", "group", "task")}
    slots, _ = p.index.add(len(ids), ids=ids, group=s["col_group"], task=s["col_task"], **rows)
    if len(ids) == 0:
        p.index.next_id = max(p.index.next_id, s["next_id"])
    if p.keys is not None:
        p.keys.add(slots, s["keys"], ids)
        p.keys.restore_removed(s["removed_keys"], s["removed_ids"])
    # Selectors take the items in the order they were last inserted or updated (the
    # heaps' tie order), then the counter goes on from there.
    touched = s["col_touched"]
    items = table.items(slots[np.argsort(touched, kind="stable")])
    p.sampler.insert(items)
    p.remover.insert(items)
    cap = table.spec.max_times_sampled
    table.restore_counts(touches=int(s.get("touches", touched.max() + 1 if len(touched) else 0)),
                         allowance=int((cap - s["col_times_sampled"]).sum()) if cap else 0)
    p.index.next_id = max(p.index.next_id, s["next_id"])
    table.policy_version = s["policy_version"]
    p.limiter.restore(s["limiter"])
    p.consumers.load(s["consumers"])
    p.quarantine.restore(s)
    p.chunks.placement.load_state(s)
    if p.pacing is not None and s.get("pacing") is not None:
        p.pacing.load(s["pacing"])
    if p.retention is not None and s.get("retention") is not None:
        p.retention.load(s["retention"])
    if p.timeouts is not None and s.get("group_timeouts") is not None:
        p.timeouts.load(s["group_timeouts"], p.groups.find)
        _rerelease(table, slots)


def _rerelease(table: "Table", slots: np.ndarray) -> None:
    """After a snapshot load, make the groups released before it eligible again (their
    members were re-inserted as forming), unless one of them left since the release
    (the group broke: never eligible again)."""
    p = table.parts
    ix = p.index
    forming = p.sampler.forming(p.timeouts.codes(group_timeouts.RELEASED))
    members = slots[np.isin(ix["group"][slots], forming)]
    if len(members) == 0:
        return
    codes, first, arrived = np.unique(ix["group"][members], return_index=True, return_counts=True)
    whole = codes[arrived == ix["group_size"][members][first]]
    p.sampler.expire(whole, release=True)
    table.remove_slots(p.sampler.rejected(), "zero_variance", log=False)


def _rebuild_lineage(table: "Table") -> None:
    """The ingest checks' references from the live items (after a restore)."""
    p = table.parts
    ix = p.index
    live = ix.live_slots()
    live = live[np.argsort(ix["id"][live], kind="stable")]
    groups = [None] * len(live)
    if "group_prefix" in p.checks.names:
        groups = [p.groups.name(c) if c >= 0 else None for c in ix["group"][live].tolist()]
    p.lineage.rebuild(ix["id"][live], ix["episode"][live], groups)


def _adopt_chunks(table: "Table") -> int:
    """Hand the chunks the restored items reference to the chunk store; drop items whose
    chunk is gone (written without the write-ahead log; DataLoss if it was acknowledged
    at wal or fsync), quarantine those whose chunk is damaged (its SSD metadata fails its
    checksum, or its remote fragment is unreadable), and delete chunks no item references
    (a crash between writing a chunk and logging its insert, or between a removal and the
    chunk's delete; the mover deletes those on the remote tier)."""
    p = table.parts
    ix, placement, archive = p.index, p.chunks.placement, p.archive
    for checksums in (placement.checksums, archive.checksums if archive is not None else None):
        if checksums is not None:
            checksums.load()
    live = ix.live_slots()
    chunks = np.unique(ix["chunk"][live])
    missing, damaged = placement.adopt(chunks.tolist())
    durable = [] if placement.legacy else sorted(set(missing) - set(placement.volatile(missing)))
    if durable:
        n = int(np.isin(ix["chunk"][live], durable).sum())
        shown = ", ".join(map(str, durable[:5])) + (", ..." if len(durable) > 5 else "")
        raise DataLoss(f"table {table.name!r}: {n} items acknowledged at durability 'wal' or 'fsync' "
                       f"reference {len(durable)} chunks that are in no tier (chunk ids {shown}): not on "
                       f"the SSD, and the journal records no move to the remote tier; nothing was dropped")
    lost = 0
    if missing or damaged:
        table.replaying = True  # no chunk bookkeeping yet
        gone = live[np.isin(ix["chunk"][live], missing)]
        lost = len(gone)
        table.remove_slots(gone, "lost")
        quarantined = {}
        for c in damaged:
            slots = live[ix["chunk"][live] == c]
            quarantined[c] = ix["id"][slots].copy()
            table.remove_slots(slots, "quarantined")
        table.replaying = False
        for c, why in damaged.items():  # journaled, so that they stay quarantined
            table.quarantine_event(c, _damaged_tier(placement, c), why, quarantined[c])
        live = ix.live_slots()
    chunks, counts = np.unique(ix["chunk"][live], return_counts=True)
    if placement.unverified():
        log.warning("table %r: %d remote chunks have no checksums (demoted before they were kept): "
                    "their reads are not verified", table.name, len(placement.unverified()))
    max_row = np.zeros(0, np.int64)
    if len(chunks):
        order = np.argsort(ix["chunk"][live], kind="stable")
        starts = np.searchsorted(ix["chunk"][live][order], chunks)
        max_row = np.maximum.reduceat(ix["row"][live][order], starts)
    ssd = placement.ssd
    for c, k, r in zip(chunks.tolist(), counts.tolist(), max_row.tolist()):
        if c in ssd:
            rows, nbytes = ssd.rows_of(c), ssd.size_of(c)
        else:
            rows, nbytes = placement.remote_size(c)
            rows = max(rows, r + 1)
        p.chunks.adopt(c, rows, k, nbytes)
    referenced = set(chunks.tolist())
    if archive is not None:  # freed before the crash, not yet archived
        pending = [c for c in archive.pending() if c not in referenced]
        missing, damaged = placement.adopt(pending)
        for c in missing:
            log.warning("table %r: chunk %d waiting for the archive is in no tier; its %d removed "
                        "items are not archived", table.name, c, len(archive.drop_rows(c, None)))
        for c, why in damaged.items():
            table.quarantine_event(c, _damaged_tier(placement, c), why, archive.drop_rows(c, None))
        pending = [c for c in pending if c in archive]
        archive.freed(pending)
        referenced.update(pending)
    try:
        stored = ssd.stored_chunks()
        top = max(stored, default=-1)
    except DataLoss as e:  # orphans stay until a start can list the chunks
        log.warning("table %r: cannot list its SSD chunks, unreferenced ones are kept: %s", table.name, e)
        stored = []
        try:
            top = ssd.last_chunk_id()
            top = -1 if top is None else top
        except DataLoss:
            top = max(referenced, default=-1) + (1 << 24)  # past any id the damaged range may hold
    orphans = [c for c in stored if c not in referenced]
    placement.delete(orphans + [c for c in placement.remote_chunks() if c not in referenced])
    placement.reserve_ids(max([*referenced, top], default=-1) + 1)
    return lost


def _damaged_tier(placement, chunk: int) -> str:
    """Where a chunk found damaged at restore lives: a remote one has checksums (its
    record goes: the chunk is unreferenced from now on)."""
    checksums = placement.checksums
    if checksums is not None and chunk in checksums:
        checksums.delete([chunk])
        return "remote"
    return "ssd"
