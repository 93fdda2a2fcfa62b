"""Token-in, token-out checks at ingest (``TableSpec.ingest_checks``).

A trainer that retokenizes text, or a producer that rebuilds a prompt from a chat
template, silently trains on tokens the policy never produced (verl#6719, rllm#352,
slime#1563). These checks refuse such rows at insert, each optional:

- ``turns_mask``: where ``turns`` is set, every token inside an ``assistant`` turn has
  ``loss_mask`` 1 and every other token (other roles' turns, and tokens outside every
  turn: the prompt) has 0. A row with ``turns`` null is not checked.
- ``extends``: rows of one *episode* extend each other, token for token: a row's
  ``tokens`` start with every token of the episode's latest earlier row. The episode of
  a row is the pair (``prompt_id``, ``episode_id``); ``episode_id`` is a nullable string
  column the check adds to the table (a row without one is not checked). The earlier row
  is the one inserted last before it: in the same insert (rows count in order), or the
  episode's latest row while that row is still in the table (after it leaves, e.g.
  sampled with ``max_times_sampled``, the next row is not compared; extension is
  transitive, so comparing with an earlier row could only be weaker, never wrong).
- ``group_prefix``: members of a GRPO group (same ``group_id``) have the same prompt:
  the tokens before the first ``loss_mask`` = 1 (all of them for a row without one). A
  member is compared with the group's first member: an earlier row of the same insert,
  or the first stored member while it is in the table.

A violating insert is refused whole with INVALID_ARGUMENT naming the table, the row
(counted over the call), the column and the first differing token: its position and
both values (or where one sequence ends). Stored references are read once per insert, in
one gather of the ``tokens`` and ``loss_mask`` columns of the rows referenced (a restarted
table may read them from the SSD); if they cannot be read (a tier down, damage), the
rows are compared within the insert only and ``ingest_unchecked`` counts them.

Concurrency: the references are looked up under the table lock, compared outside it
(``check_against_stored``, from ``Table.prepare_insert``) and confirmed at commit under the lock: if another insert of
the same episode or group committed in between, the insert is refused (insert an
episode's rows in order). The state (:class:`Lineage`) is derived from the live items:
a restart rebuilds it from the index (each item keeps a 64-bit hash of its episode key;
a hash collision is caught by comparing the referenced row's key before any refusal).

Cost: vectorised numpy over the flat token arrays (one comparison per token of the
compared prefixes) plus one hash per distinct episode, and for ``extends`` one gather of
the stored rows extended. Measured once on a shared 2-core machine, in memory: a 256-row
insert of rows of 2.5-4k tokens (each extending its episode's previous row by 512) took
7-14 ms unchecked, 22-51 ms with ``extends`` or ``group_prefix``, 47-49 ms with all three.
"""

from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from . import prefixes
from .errors import ExpstoreError, InvalidArgument

if TYPE_CHECKING:
    from .table import Table

log = logging.getLogger("expstore.table")

EPISODE_COLUMN = "episode_id"
REFERENCE_COLUMNS = ["prompt_id", EPISODE_COLUMN, "tokens", "loss_mask"]  # those the table has


def episode_hashes(data: pa.Table) -> np.ndarray:
    """int64 per row: a 64-bit hash of (prompt_id, episode_id), 0 where episode_id is
    null. One hash per distinct key."""
    if EPISODE_COLUMN not in data.column_names:
        return np.zeros(data.num_rows, np.int64)
    episode = data.column(EPISODE_COLUMN)
    key = pc.binary_join_element_wise(data.column("prompt_id"), episode, "\x00")  # null where episode is
    encoded = pc.dictionary_encode(key).combine_chunks() if isinstance(key, pa.ChunkedArray) \
        else pc.dictionary_encode(key)
    table = np.fromiter((_hash(v) for v in encoded.dictionary.to_pylist()), np.int64, len(encoded.dictionary))
    codes = encoded.indices.fill_null(-1).to_numpy(zero_copy_only=False).astype(np.int64)
    return np.where(codes >= 0, np.append(table, 0)[codes], 0)


def _hash(key: str) -> int:
    h = int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "little", signed=True)
    return h or 1  # 0 means "no episode"


@dataclass(frozen=True)
class References:
    """The stored rows an insert's rows are compared with, as looked up under the lock:
    per distinct episode hash and group id, the referenced live item id (0: none), and
    the lineage's entries as they were (to confirm at commit that nothing came between)."""

    episodes: dict[int, int]
    groups: dict[str, int]
    seen: tuple[dict[int, int], dict[str, int]]

    @property
    def ids(self) -> list[int]:
        return sorted({i for i in (*self.episodes.values(), *self.groups.values()) if i})


class Lineage:
    """Per episode hash, the id of its latest row; per group id, the id of its first
    member. Entries of items that left are dropped lazily (``purge``). Not thread-safe:
    the table holds its lock."""

    def __init__(self) -> None:
        self.episodes: dict[int, int] = {}
        self.groups: dict[str, int] = {}

    def references(self, hashes: np.ndarray, groups: list[str | None], live: Callable[[np.ndarray], np.ndarray]
                   ) -> References:
        """The live references of these rows' episodes and groups (lock held)."""
        eps = {h: self.episodes.get(h, 0) for h in np.unique(hashes[hashes != 0]).tolist()}
        grs = {g: self.groups.get(g, 0) for g in set(groups) if g is not None}
        ids = np.array([i for i in (*eps.values(), *grs.values()) if i], np.uint64)
        dead = set(ids[~live(ids)].tolist()) if len(ids) else set()
        return References({h: (0 if i in dead else i) for h, i in eps.items()},
                          {g: (0 if i in dead else i) for g, i in grs.items()}, (eps, grs))

    def confirm(self, refs: References, table: str) -> None:
        """At commit (lock held): refuse the insert if another one of the same episode or
        group committed since ``refs`` were looked up."""
        eps, grs = refs.seen
        for h, i in eps.items():
            if self.episodes.get(h, 0) != i:
                raise InvalidArgument(f"table {table!r}: an episode of this insert got a row (item "
                                      f"{self.episodes[h]}) from another insert while this one was checked; "
                                      f"insert an episode's rows in order (ingest check 'extends')")
        for g, i in grs.items():
            if self.groups.get(g, 0) != i:
                raise InvalidArgument(f"table {table!r}: group {g!r} got its first member (item {self.groups[g]}) "
                                      f"from another insert while this one was checked (ingest check 'group_prefix')")

    def record(self, hashes: np.ndarray, groups: list[str | None], ids: np.ndarray,
               refs: References | None = None) -> None:
        """Stored new rows, in insertion order: each is its episode's latest row; the
        first row of a group that had no live reference becomes the group's."""
        keep = hashes != 0
        self.episodes.update(zip(hashes[keep].tolist(), ids[keep].tolist()))
        taken: set[str] = set()
        for g, i in zip(groups, ids.tolist()):
            if g is None or g in taken:
                continue
            taken.add(g)
            if (refs.groups.get(g, 0) if refs is not None else self.groups.get(g, 0)) == 0:
                self.groups[g] = i

    def purge(self, live: Callable[[np.ndarray], np.ndarray], items: int) -> None:
        """Forget entries whose item left, once the maps outgrow twice the live items
        (amortised O(1) per insert)."""
        for name in ("episodes", "groups"):
            entries: dict = getattr(self, name)
            if len(entries) > 2 * items + 1024:
                keys = list(entries)
                ok = live(np.array([entries[k] for k in keys], np.uint64))
                setattr(self, name, {k: entries[k] for k, keep in zip(keys, ok.tolist()) if keep})

    def rebuild(self, ids: np.ndarray, hashes: np.ndarray, groups: list[str | None]) -> None:
        """From the live items after a restart (ids ascending)."""
        self.episodes, self.groups = {}, {}
        self.record(hashes, groups, ids)


def check_against_stored(table: "Table", whole: pa.Table, episodes: np.ndarray) -> References:
    """Run "extends" and "group_prefix" on an insert's rows (``whole``, their episode
    hashes) against the stored rows they reference (``Table.prepare_insert``, no lock
    held): the references are looked up under the table lock, the stored rows read and
    compared outside it. Returns the references, confirmed at commit (``Lineage.confirm``)."""
    p = table.parts
    groups = whole.column("group_id").to_pylist() if "group_prefix" in p.checks.names \
        else [None] * whole.num_rows
    with table.lock:
        refs = p.lineage.references(episodes, groups, p.index.is_live)
    stored, stored_ids = None, np.zeros(0, np.uint64)
    if refs.ids:
        ids = np.array(refs.ids, np.uint64)
        try:
            with table.lock:
                slots = p.index.lookup(ids)
                stored_ids = ids[slots >= 0]
                snap = table.plan_read(slots[slots >= 0])
            columns = [c for c in REFERENCE_COLUMNS if c in table.schema.names]
            stored = pa.Table.from_batches([table.read(snap, columns).data])
        except ExpstoreError as e:  # a tier down, damage: compare within the insert only
            log.warning("table %r: ingest checks compare within the insert only: %s", table.name, e)
            stored, stored_ids = None, np.zeros(0, np.uint64)
            with table.lock:
                table.counters["ingest_unchecked"] += whole.num_rows
    p.checks.check_lineage(whole, episodes, refs, stored, stored_ids.tolist())
    return refs


class Checks:
    """The configured checks of one table; see the module docstring."""

    def __init__(self, names: tuple[str, ...], table: str) -> None:
        self.names = frozenset(names)
        self.table = table

    @property
    def needs_references(self) -> bool:
        return bool(self.names & {"extends", "group_prefix"})

    def check_rows(self, data: pa.Table, row_offset: int = 0) -> None:
        """The checks that need no stored rows (``turns_mask``) on one conformed, validated part."""
        if "turns_mask" in self.names:
            _turns_mask(data, self.table, row_offset)

    def check_lineage(self, data: pa.Table, hashes: np.ndarray, refs: References,
                      stored: pa.Table | None = None, stored_ids: list[int] = ()) -> None:
        """``extends`` and ``group_prefix`` over the whole insert. ``stored``: the
        REFERENCE_COLUMNS of the referenced rows, row-aligned with ``stored_ids`` (those
        that could not be read are missing: their rows are compared within the insert only)."""
        n = data.num_rows
        # A pool of sequences: this insert's rows 0..n-1, then the stored references.
        parts = [data] if stored is None or stored.num_rows == 0 else [data, stored]
        pool = _Pool([p.column("tokens") for p in parts], [p.column("loss_mask") for p in parts])
        pooled = {int(item): n + k for k, item in enumerate(stored_ids)}
        keys = {}
        if stored is not None and stored.num_rows and EPISODE_COLUMN in stored.column_names:
            keys = dict(zip(pooled, zip(stored.column("prompt_id").to_pylist(),
                                        stored.column(EPISODE_COLUMN).to_pylist())))
        if "extends" in self.names:
            self._extends(data, hashes, refs, keys, pool, pooled)
        if "group_prefix" in self.names:
            self._group_prefix(data, refs, pool, pooled)

    def _extends(self, data, hashes, refs, keys, pool, pooled) -> None:
        rows, against = [], []
        last: dict[int, int] = {}
        mine = None
        for r, h in enumerate(hashes.tolist()):
            if not h:
                continue
            if h in last:
                rows.append(r)
                against.append(last[h])
            elif refs.episodes.get(h) in pooled:
                item = refs.episodes[h]
                if mine is None:
                    mine = list(zip(data.column("prompt_id").to_pylist(), data.column(EPISODE_COLUMN).to_pylist()))
                if keys[item] == mine[r]:  # else two keys share a hash: not the same episode
                    rows.append(r)
                    against.append(pooled[item])
            last[h] = r
        hit = pool.first_difference(np.array(rows, np.int64), np.array(against, np.int64), prefix=False)
        if hit is not None:
            row, ref, at, mine, theirs = hit
            where = self._name(ref, pool, pooled, "the episode's earlier row")
            if mine is None:
                what = (f"{at} tokens, fewer than {where}, whose token {at} is {theirs}; a row must extend "
                        f"its episode's earlier rows token for token")
            else:
                what = (f"token {at} is {mine}, but {where} has {theirs} there; a row must extend its "
                        f"episode's earlier rows token for token")
            raise InvalidArgument(f"table {self.table!r}: row {row}, column 'tokens': {what} (ingest check 'extends')")

    def _group_prefix(self, data, refs, pool, pooled) -> None:
        groups = data.column("group_id").to_pylist()
        rows, against = [], []
        first: dict[str, int] = {}
        for r, g in enumerate(groups):
            if g is None:
                continue
            item = refs.groups.get(g, 0)
            if item in pooled:
                rows.append(r)
                against.append(pooled[item])
            elif g in first:
                rows.append(r)
                against.append(first[g])
            else:
                first[g] = r
        hit = pool.first_difference(np.array(rows, np.int64), np.array(against, np.int64), prefix=True)
        if hit is not None:
            row, ref, at, mine, theirs = hit
            where = self._name(ref, pool, pooled, f"group {groups[row]!r}'s first member")
            show = lambda v: "the end of the prompt" if v is None else v  # noqa: E731
            raise InvalidArgument(
                f"table {self.table!r}: row {row}, column 'tokens': the prompt (the tokens before the first "
                f"loss_mask = 1) differs from that of {where} at token {at}: {show(mine)} here, {show(theirs)} "
                f"there; the members of a group share their prompt (ingest check 'group_prefix')")

    @staticmethod
    def _name(ref: int, pool: "_Pool", pooled: dict[int, int], what: str) -> str:
        items = {k: item for item, k in pooled.items()}
        return f"{what} (item {items[ref]})" if ref in items else f"{what} (row {ref} of this insert)"


class _Flat:
    """A list column as flat numpy values and per-row offsets (slices handled)."""

    def __init__(self, *columns: pa.ChunkedArray | pa.Array) -> None:
        values, lengths = [], []
        for column in columns:
            for arr in (column.chunks if isinstance(column, pa.ChunkedArray) else [column]):
                values.append(pc.list_flatten(arr).to_numpy(zero_copy_only=False))
                lengths.append(pc.list_value_length(arr).fill_null(0).to_numpy(zero_copy_only=False))
        self.values = np.concatenate(values) if values else np.zeros(0)
        lengths = np.concatenate(lengths).astype(np.int64) if lengths else np.zeros(0, np.int64)
        self.offsets = np.zeros(len(lengths) + 1, np.int64)
        np.cumsum(lengths, out=self.offsets[1:])


class _Pool:
    """Sequences by pool index: rows of the insert, then the stored references."""

    def __init__(self, tokens: list[pa.ChunkedArray], masks: list[pa.ChunkedArray]) -> None:
        flat = _Flat(*tokens)
        self.tokens, self.offsets = flat.values, flat.offsets
        self.mask = _Flat(*masks).values
        self.lengths = np.diff(self.offsets)

    def prompt_lengths(self) -> np.ndarray:
        """Tokens before each sequence's first loss_mask = 1 (its length if none)."""
        return prefixes.first_ones(self.mask, self.offsets[:-1], self.offsets[1:])

    def first_difference(self, rows: np.ndarray, refs: np.ndarray, *, prefix: bool):
        """The first (in row order) of ``rows`` that differs from its reference: with
        ``prefix``, their prompts must be equal; else the reference's tokens must be a
        prefix of the row's. Returns (row, ref, position, row's value or None, ref's
        value or None) or None. Vectorised over the compared tokens."""
        if len(rows) == 0:
            return None
        order = np.argsort(rows, kind="stable")
        rows, refs = rows[order], refs[order]
        if prefix:
            length = self.prompt_lengths()
            n_row, n_ref = length[rows], length[refs]
        else:
            n_row, n_ref = self.lengths[rows], self.lengths[refs]
        m = np.minimum(n_row, n_ref)
        starts = np.zeros(len(m) + 1, np.int64)
        np.cumsum(m, out=starts[1:])
        pair = np.repeat(np.arange(len(m)), m)
        k = np.arange(int(starts[-1])) - starts[pair]
        differ = self.tokens[self.offsets[rows][pair] + k] != self.tokens[self.offsets[refs][pair] + k]
        bad_pair = np.zeros(len(m), bool)
        bad_pair[pair[differ]] = True
        at = np.where(bad_pair, 0, m)  # the position of the difference
        if differ.any():
            first_k = np.full(len(m), -1, np.int64)
            hits = np.flatnonzero(differ)
            p, first = np.unique(pair[hits], return_index=True)
            first_k[p] = k[hits[first]]
            at = np.where(bad_pair, first_k, at)
        bad = bad_pair | (n_row != n_ref if prefix else n_row < n_ref)
        if not bad.any():
            return None
        j = int(np.argmax(bad))
        p = int(at[j])

        def value(seq: int, n: int):
            return int(self.tokens[self.offsets[seq] + p]) if p < n else None
        return int(rows[j]), int(refs[j]), p, value(int(rows[j]), int(n_row[j])), value(int(refs[j]), int(n_ref[j]))


def _turns_mask(data: pa.Table, table: str, row_offset: int) -> None:
    turns = data.column("turns").combine_chunks()
    if turns.null_count == len(turns):
        return
    tokens = _Flat(data.column("tokens"))
    mask = _Flat(data.column("loss_mask")).values
    n_turns = pc.list_value_length(turns).fill_null(0).to_numpy(zero_copy_only=False).astype(np.int64)
    checked = turns.is_valid().to_numpy(zero_copy_only=False)
    flat = pc.list_flatten(turns)
    role = flat.field("role").to_numpy(zero_copy_only=False)
    start = flat.field("start").to_numpy(zero_copy_only=False).astype(np.int64)
    end = flat.field("end").to_numpy(zero_copy_only=False).astype(np.int64)
    turn_row = np.repeat(np.arange(len(n_turns)), n_turns)
    base = tokens.offsets[turn_row]
    assistant = role == "assistant"
    edges = np.zeros(len(mask) + 1, np.int64)
    np.add.at(edges, base[assistant] + start[assistant], 1)
    np.add.at(edges, base[assistant] + end[assistant], -1)
    expected = (np.cumsum(edges[:-1]) > 0).astype(mask.dtype)
    in_checked_row = np.repeat(checked, np.diff(tokens.offsets))
    wrong = np.flatnonzero(in_checked_row & (mask != expected))
    if len(wrong) == 0:
        return
    j = int(wrong[0])
    row = int(np.searchsorted(tokens.offsets, j, side="right") - 1)
    k = j - int(tokens.offsets[row])
    mine = np.flatnonzero(turn_row == row)
    inside = mine[(start[mine] <= k) & (k < end[mine])]
    if len(inside):
        t = int(inside[0])
        where = f"inside turn {t - int(mine[0])} (role {role[t]!r}, tokens [{start[t]}, {end[t]}))"
    else:
        where = "outside every turn"
    raise InvalidArgument(
        f"table {table!r}: row {row_offset + row}, column 'loss_mask': value {int(mask[j])} at token {k}, {where}; "
        f"expected {int(expected[j])}: assistant turns have loss_mask 1, every other token 0 "
        f"(ingest check 'turns_mask')")
