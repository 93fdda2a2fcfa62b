"""Trajectory protocol v1: the Arrow schema, conforming client data to a table's schema,
and validating trajectories (docs/architecture.md, "Trajectory protocol v1").

:func:`table_schema` gives a table's full schema at creation; on every insert,
:func:`conform` turns what a client sent into exactly that schema (safe casts, nulls for
absent nullable columns, no copy when the types already match) and, for trajectory
tables, :func:`validate_trajectories` checks the protocol's rules. A batch with any invalid
row is rejected whole; the error names the first offending row and its column.

Checks are vectorised (pyarrow.compute and numpy over flattened list values and offsets,
never a Python loop over rows) and handle sliced input, whose list offsets do not start
at 0. Pure functions, no state: thread-safe.

>>> t = pa.table({"traj_id": ["a"], "prompt_id": ["p"], "task": ["math"],
...               "tokens": [[1, 2, 3]], "loss_mask": [[0, 1, 1]],
...               "logprobs": [[0.0, -0.5, -0.1]], "policy_version": [3],
...               "finish_reason": ["stop"]})
>>> t = conform(t, TRAJECTORY_V1, table="rollouts")
>>> validate_trajectories(t, table="rollouts")
>>> t.schema.field("tokens").type
ListType(list<item: int32>)
"""

from __future__ import annotations

from functools import lru_cache, partial
from typing import Callable

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from .errors import InvalidArgument

try:  # after pyarrow, which has loaded the libarrow the module links to
    from . import _validate_native as native
except ImportError:  # not built: no C++ compiler at install (setup.py)
    native = None

TURN = pa.struct([
    ("role", pa.string()), ("start", pa.int32()), ("end", pa.int32()),
    ("tool_name", pa.string()), ("tool_args", pa.string()), ("tool_result", pa.string()),
    ("tool_status", pa.string()), ("latency_ms", pa.float32()),
])
"""One turn: token offsets [start, end) into ``tokens`` and, for a tool call, its name,
arguments, result, status and latency. start and end must be set (checked by validation)."""

TRAJECTORY_V1 = pa.schema([
    pa.field("traj_id", pa.string(), nullable=False),
    pa.field("prompt_id", pa.string(), nullable=False),
    pa.field("group_id", pa.string()),
    pa.field("group_size", pa.int32()),
    pa.field("task", pa.string(), nullable=False),
    pa.field("tokens", pa.list_(pa.int32()), nullable=False),
    pa.field("loss_mask", pa.list_(pa.uint8()), nullable=False),
    pa.field("logprobs", pa.list_(pa.float32()), nullable=False),
    pa.field("policy_version", pa.int64(), nullable=False),
    pa.field("token_policy_version", pa.list_(pa.int32())),
    pa.field("turns", pa.list_(TURN)),
    pa.field("reward", pa.float32()),
    pa.field("step_rewards", pa.list_(pa.float32())),
    pa.field("reward_components", pa.map_(pa.string(), pa.float32())),
    pa.field("advantages", pa.list_(pa.float32())),
    pa.field("values", pa.list_(pa.float32())),
    pa.field("finish_reason", pa.string(), nullable=False),
    pa.field("metadata", pa.string()),  # JSON text, not parsed by the engine
])
"""Protocol v1 (docs/architecture.md#trajectory-protocol-v1). Non-nullable fields are the required columns."""

# Typed scalars: a bare Python int in a compute call costs ~45 us (pyarrow tries a failing
# dateutil import under the import lock each time).
_ZERO = pa.scalar(0, pa.int32())

RESERVED_COLUMNS = frozenset({"item_id", "priority", "times_sampled", "inserted_at", "tier"})
"""Server-owned columns, visible in queries; no table schema or insert may contain them."""

_PER_TOKEN = ("token_policy_version", "advantages", "values")  # nullable, len == len(tokens)


def table_schema(kind: str, schema: pa.Schema | None, *, table: str,
                 added: list[pa.Field] = ()) -> pa.Schema:
    """The full schema of a new table.

    kind "trajectory": TRAJECTORY_V1 followed by the columns of ``schema`` that are not in
    v1 (a v1 column may be repeated only with the identical type and nullability), then
    the ``added`` columns the table's config brings (``TableSpec.engine_columns``), which
    ``schema`` may repeat only with the identical type.
    kind "generic": ``schema`` itself, which must have at least one column.
    Reserved (server-owned) or duplicate column names are refused in both.
    """
    extra = schema if schema is not None else pa.schema([])
    _check_names(extra.names, table)
    if kind == "generic":
        _require(len(extra) > 0, f"table {table!r}: a generic table needs a schema")
        return extra
    _require(kind == "trajectory", f"table {table!r}: kind must be 'trajectory' or 'generic', got {kind!r}")
    fields = list(TRAJECTORY_V1)
    for f in extra:
        if f.name in TRAJECTORY_V1.names:
            v1 = TRAJECTORY_V1.field(f.name)
            _require(f.type == v1.type and f.nullable == v1.nullable,
                     f"table {table!r}: column {f.name!r} is part of trajectory protocol v1 as "
                     f"{v1.type}{'' if v1.nullable else ' not null'}; it cannot be redefined as "
                     f"{f.type}{'' if f.nullable else ' not null'} (leave it out of the extra columns)")
        else:
            fields.append(f)
    names = [f.name for f in fields]
    for f in added:
        if f.name in names:
            declared = fields[names.index(f.name)]
            _require(declared.type == f.type and declared.nullable,
                     f"table {table!r}: column {f.name!r} is defined by the table's config as {f.type} "
                     f"(nullable); it cannot be declared as {declared.type}"
                     f"{'' if declared.nullable else ' not null'} (leave it out of the extra columns)")
        else:
            fields.append(f)
            names.append(f.name)
    return pa.schema(fields)


def conform(data: pa.Table | pa.RecordBatch, schema: pa.Schema, *, table: str) -> pa.Table:
    """``data`` with exactly ``schema``'s columns, in order, and types.

    - An absent nullable column is filled with nulls; an absent required one is an error.
    - A column not in the schema is an error that lists the known columns; a reserved
      (server-owned) column is an error.
    - A column of the schema's type is passed through without a copy. Otherwise it is
      converted with a safe cast: int64 -> int32 and large_list -> list (overflow is an
      error), string <-> large_string, dictionary -> plain, a struct with fewer fields ->
      the full struct (the rest null). float64 -> float32 is allowed because it is what
      numpy callers send; it rounds, and values beyond float32's range become inf (which
      validation then refuses where finiteness is required). Casts between strings and
      non-strings (parsing "3" as a number) are refused, as is anything Arrow's safe cast
      refuses.
    - A null in a required column is an error naming the first such row.
    """
    if isinstance(data, pa.RecordBatch):
        data = pa.Table.from_batches([data])
    names = data.column_names
    _check_names(names, table)
    unknown = [n for n in names if schema.get_field_index(n) < 0]
    _require(not unknown, f"table {table!r}: unknown column(s) {unknown}; known columns: {schema.names}")
    columns = []
    for f in schema:
        if f.name not in names:
            if not f.nullable:  # (the message only when it is raised: a few us a column)
                raise InvalidArgument(f"table {table!r}: required column {f.name!r} ({f.type}) is missing")
            columns.append(pa.nulls(data.num_rows, f.type))
            continue
        col = data.column(f.name)
        if col.type != f.type:
            col = _cast(col, f, table)
        if not f.nullable and col.null_count:
            row = pc.index(pc.is_null(col), True).as_py()
            raise _row_error(table, row, f.name, "null, but the column is required")
        columns.append(col)
    return pa.Table.from_arrays(columns, schema=schema)


def _cast(col: pa.ChunkedArray, f: pa.Field, table: str) -> pa.ChunkedArray:
    what = f"table {table!r}: column {f.name!r}: cannot convert {col.type} to {f.type}"
    _require(not _string_clash(col.type, f.type), f"{what} (strings convert only to strings)")
    try:
        return pc.cast(col, f.type, safe=True)
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError, pa.ArrowTypeError) as e:
        raise InvalidArgument(f"{what} safely: {e}") from None


def _string_clash(src: pa.DataType, dst: pa.DataType) -> bool:
    """Whether a cast would convert between strings and other values at any nesting level."""
    src = src.value_type if pa.types.is_dictionary(src) else src
    if pa.types.is_null(src):
        return False
    if _is_string(src) != _is_string(dst):
        return True
    if not (src.num_fields and dst.num_fields):
        return False
    if pa.types.is_struct(src) and pa.types.is_struct(dst):  # a struct cast matches by name
        pairs = [(f.type, dst.field(f.name).type) for f in src if dst.get_field_index(f.name) >= 0]
    else:  # lists, maps (their entries struct)
        pairs = [(src.field(0).type, dst.field(0).type)]
    return any(_string_clash(a, b) for a, b in pairs)


def _is_string(t: pa.DataType) -> bool:
    return pa.types.is_string(t) or pa.types.is_large_string(t) or pa.types.is_string_view(t)


def _check_names(names: list[str], table: str) -> None:
    unique = set(names)
    if len(unique) != len(names):
        dup = sorted({n for n in names if names.count(n) > 1})
        raise InvalidArgument(f"table {table!r}: duplicate column name(s) {dup}")
    if not unique.isdisjoint(RESERVED_COLUMNS):
        raise InvalidArgument(f"table {table!r}: column(s) {sorted(unique & RESERVED_COLUMNS)} are server-owned "
                              f"({sorted(RESERVED_COLUMNS)}) and cannot be written or defined")


# --------------------------------------------------------------------------- validation

Hit = tuple[int, str, str]  # (row within the checked data, column, what is wrong)


def validate_trajectories(data: pa.Table | pa.RecordBatch, *, table: str, row_offset: int = 0,
                          vocab_size: int | None = None) -> None:
    """Check conformed trajectories; raise InvalidArgument for the first offending row.

    The error reads ``table 'T': row R, column 'C': <what is wrong, what is expected>``
    with R = row_offset + the row's index in ``data``. Rules, in tie-break order:

    1. required columns are not null; traj_id is non-empty and unique within the batch;
    2. loss_mask and logprobs have len(tokens) elements; so do token_policy_version,
       advantages and values where not null; no list holds null elements;
    3. tokens are ids >= 0, and < ``vocab_size`` when the table declares one (a trainer
       indexes its embedding with them); loss_mask values are 0 or 1; logprobs are
       finite, and <= 0 where loss_mask = 1;
    4. policy_version >= 0; token_policy_version >= 0, and >= policy_version where
       loss_mask = 1 (policy_version is the oldest version that generated any token);
    5. advantages and values are finite;
    6. turns: no null turn, start and end set, 0 <= start <= end <= len(tokens), ordered
       and non-overlapping (start_k >= end_{k-1}); step_rewards: one per turn where both
       are set, finite;
    7. reward and reward_components values are finite where set (a null reward means
       "filled in later");
    8. group_size >= 1 where set, and set only together with group_id (a group_id without
       group_size is allowed: the group sampler's group_size then applies); group_id is
       non-empty where set.

    Cost: O(rows + tokens) vectorised work per rule, ~0.3 ms a call whatever the rows;
    where it is built, the native check (validate_native.cpp) first answers in one pass
    whether every rule holds (microseconds for a small insert), and these checks run only
    to find and describe the first offending row.
    """
    if isinstance(data, pa.RecordBatch):
        data = pa.Table.from_batches([data])
    if native is not None and native.clean(data.to_batches(), vocab_size):
        return
    found: Hit | None = None
    for check in (_required_not_null, _traj_id):  # whole-table checks
        hit = check(data)
        if hit is not None:
            found, data = hit, data.slice(0, hit[0])
    base = 0
    for batch in data.to_batches():  # rows >= the table-level hit are already cut off
        view, hit_here = _View(batch), False
        for check in _batch_checks(vocab_size):
            hit = check(view) if view.n else None
            if hit is not None:  # later checks look only at the rows before this one
                found, hit_here = (base + hit[0], hit[1], hit[2]), True
                view = _View(view.batch.slice(0, hit[0]))
        if hit_here:
            break
        base += batch.num_rows
    if found is not None:
        raise _row_error(table, row_offset + found[0], found[1], found[2])


class _View:
    """One record batch with its list columns flattened once: values (the elements of
    non-null rows, in order) and per-row lengths (0 for null rows)."""

    def __init__(self, batch: pa.RecordBatch):
        self.batch, self.n, self._flat = batch, batch.num_rows, {}

    def np(self, name: str) -> np.ndarray:  # nulls read as NaN (floats) or are masked by valid()
        return self.batch.column(name).to_numpy(zero_copy_only=False)

    def valid(self, name: str) -> np.ndarray:
        arr = self.batch.column(name)
        return arr.is_valid().to_numpy(zero_copy_only=False) if arr.null_count else np.ones(self.n, bool)

    def flat(self, name: str) -> tuple[pa.Array, np.ndarray, np.ndarray]:
        """(values, lengths, ends); ends = cumsum(lengths) locate an element's row."""
        if name not in self._flat:
            arr = self.batch.column(name)
            offsets = arr.offsets.to_numpy().astype(np.int64)
            lengths = np.diff(offsets)
            values = arr.values.slice(offsets[0], offsets[-1] - offsets[0])
            if arr.null_count:  # a null row may own a non-empty segment: drop it
                valid = self.valid(name)
                if lengths[~valid].any():
                    values = values.filter(pa.array(np.repeat(valid, lengths)))
                lengths = np.where(valid, lengths, 0)
            self._flat[name] = (values, lengths, np.cumsum(lengths))
        return self._flat[name]

    def values(self, name: str) -> np.ndarray:
        return self.flat(name)[0].to_numpy(zero_copy_only=False)

    def rows(self, name: str) -> np.ndarray:
        """The row of each flattened element (computed once per column)."""
        key = ("rows", name)
        if key not in self._flat:
            self._flat[key] = np.repeat(np.arange(self.n), self.flat(name)[1])
        return self._flat[key]


def _first(bad: np.ndarray) -> int | None:
    i = int(np.argmax(bad)) if len(bad) else 0
    return i if len(bad) and bad[i] else None


def _nulls(arr: pa.Array) -> np.ndarray:
    return arr.is_null().to_numpy(zero_copy_only=False)


def _row_hit(bad: np.ndarray, name: str, what: Callable[[int], str]) -> Hit | None:
    """A hit for the first bad row; what(row) describes it."""
    r = _first(bad)
    return None if r is None else (r, name, what(r))


def _elem_hit(v: _View, name: str, bad: np.ndarray, what: Callable[[int, int], str]) -> Hit | None:
    """A hit for the first bad flattened element j of column name; what(j, k) describes
    it, k being j's position within its row."""
    j = _first(bad)
    if j is None:
        return None
    _, lengths, ends = v.flat(name)
    row = int(np.searchsorted(ends, j, side="right"))
    return row, name, what(j, j - int(ends[row] - lengths[row]))


def _required_not_null(data: pa.Table) -> Hit | None:
    hits = [(pc.index(pc.is_null(data.column(f.name)), True).as_py(), f.name)
            for f in TRAJECTORY_V1 if not f.nullable and data.column(f.name).null_count]
    row, name = min(hits, key=lambda h: h[0]) if hits else (0, "")  # first in schema order
    return (row, name, "null, but the column is required") if hits else None


def _traj_id(data: pa.Table) -> Hit | None:
    ids = data.column("traj_id").combine_chunks()
    empty = pc.fill_null(pc.equal(pc.binary_length(ids), _ZERO), False).to_numpy(zero_copy_only=False)
    codes = pc.fill_null(pc.dictionary_encode(ids).indices, pa.scalar(-1, pa.int32())).to_numpy().astype(np.int64)
    # codes number distinct ids in order of first appearance: a row repeats an earlier id
    # iff its code is not above the largest code before it
    prev_max = np.maximum.accumulate(np.concatenate([[-1], codes[:-1]]))[:len(codes)]
    dup = (codes >= 0) & (codes <= prev_max)
    return _row_hit(empty | dup, "traj_id", lambda r: (
        "empty; expected a non-empty id, unique within the batch" if empty[r] else
        f"{ids[r].as_py()!r} duplicates row {int(np.argmax(codes == codes[r]))} of this batch; "
        "traj_id must be unique"))


def _length(v: _View, name: str) -> Hit | None:
    n, n_tok = v.flat(name)[1], v.flat("tokens")[1]
    return _row_hit(v.valid(name) & (n != n_tok), name, lambda r: (
        f"{n[r]} elements; expected {n_tok[r]}, one per token (the length of tokens)"))


def _null_items(v: _View, name: str) -> Hit | None:
    values = v.flat(name)[0]
    return values.null_count and _elem_hit(v, name, _nulls(values), lambda j, k: (
        f"element {k} is null; lists must not hold nulls")) or None


def _elements(v: _View, name: str, ok: Callable, expected: str, unit: str = "token") -> Hit | None:
    """The first element of list column name for which ok(values) is False."""
    x = v.values(name)
    return _elem_hit(v, name, ~ok(x), lambda j, k: f"value {x[j]} at {unit} {k}; expected {expected}")


def _finite(name: str, unit: str = "token") -> Callable[[_View], Hit | None]:
    return partial(_elements, name=name, ok=np.isfinite, expected="finite", unit=unit)


def _token_ids(v: _View, vocab_size: int | None) -> Hit | None:
    x = v.values("tokens")
    bad = x < 0 if vocab_size is None else (x < 0) | (x >= vocab_size)
    expected = ">= 0 (a token id)" if vocab_size is None else \
        f"a token id in [0, {vocab_size}) (the table's vocab_size)"
    return _elem_hit(v, "tokens", bad, lambda j, k: f"value {x[j]} at token {k}; expected {expected}")


def _logprob_sign(v: _View) -> Hit | None:
    m, lp = v.values("loss_mask"), v.values("logprobs")
    return _elem_hit(v, "logprobs", (m == 1) & (lp > 0), lambda j, k: (
        f"value {lp[j]:g} at token {k} where loss_mask = 1; expected <= 0 (a log-probability)"))


def _policy_version(v: _View) -> Hit | None:
    pv = v.np("policy_version")
    return _row_hit(pv < 0, "policy_version", lambda r: f"{pv[r]}; expected >= 0")


def _tpv_vs_policy_version(v: _View) -> Hit | None:
    name = "token_policy_version"
    if v.batch.column(name).null_count == v.n:
        return None
    tpv, pv = v.values(name), v.np("policy_version")[v.rows(name)]
    m = v.values("loss_mask")  # its elements of the rows that have tpv line up with tpv
    if v.batch.column(name).null_count:
        m = m[v.valid(name)[v.rows("loss_mask")]]
    return _elem_hit(v, name, (m == 1) & (tpv < pv), lambda j, k: (
        f"value {tpv[j]} at token {k} (loss_mask = 1) is below policy_version {pv[j]}; "
        "policy_version must be the oldest version that generated any token"))


def _turn_fields(v: _View) -> dict[str, pa.Array]:
    return dict(zip(TURN.names, v.flat("turns")[0].flatten()))


def _null_turns(v: _View) -> Hit | None:
    turns = v.flat("turns")[0]
    start, end = (_nulls(_turn_fields(v)[f]) for f in ("start", "end"))
    return _elem_hit(v, "turns", _nulls(turns) | start | end, lambda j, k: (
        f"turn {k} is null" if not turns[j].is_valid else
        f"turn {k} has no {'start' if start[j] else 'end'}; expected token offsets [start, end)"))


def _turn_offsets(v: _View) -> tuple[np.ndarray, np.ndarray]:
    return tuple(_turn_fields(v)[f].to_numpy().astype(np.int64) for f in ("start", "end"))


def _turn_bounds(v: _View) -> Hit | None:
    (s, e), n_tok = _turn_offsets(v), v.flat("tokens")[1][v.rows("turns")]
    return _elem_hit(v, "turns", (s < 0) | (e < s) | (e > n_tok), lambda j, k: (
        f"turn {k} spans [{s[j]}, {e[j]}); expected 0 <= start <= end <= {n_tok[j]} (the length of tokens)"))


def _turn_order(v: _View) -> Hit | None:
    (s, e), (_, n_turns, ends) = _turn_offsets(v), v.flat("turns")
    prev_end = np.concatenate([[0], e[:-1]])[:len(e)]
    first_of_row = np.zeros(len(s), bool)
    first_of_row[(ends - n_turns)[n_turns > 0]] = True
    return _elem_hit(v, "turns", ~first_of_row & (s < prev_end), lambda j, k: (
        f"turn {k} starts at {s[j]}, before turn {k - 1} ends at {prev_end[j]}; "
        "turns must be ordered and must not overlap"))


def _step_reward_count(v: _View) -> Hit | None:
    n_sr, n_turns = v.flat("step_rewards")[1], v.flat("turns")[1]
    return _row_hit(v.valid("step_rewards") & v.valid("turns") & (n_sr != n_turns), "step_rewards",
                    lambda r: f"{n_sr[r]} step rewards for {n_turns[r]} turns; expected one per turn")


def _reward(v: _View) -> Hit | None:
    reward = v.np("reward")
    return _row_hit(v.valid("reward") & ~np.isfinite(reward), "reward",
                    lambda r: f"{reward[r]}; expected a finite number or null")


def _reward_components(v: _View) -> Hit | None:
    keys, parts = v.flat("reward_components")[0].flatten()
    return _elem_hit(v, "reward_components", ~np.isfinite(parts.to_numpy(zero_copy_only=False)),
                     lambda j, k: f"component {keys[j].as_py()!r} is {parts[j].as_py()}; expected finite")


def _group_size(v: _View) -> Hit | None:
    size = v.np("group_size")
    return _row_hit(v.valid("group_size") & (size < 1), "group_size",
                    lambda r: f"{int(size[r])}; expected >= 1 or null")


def _group_id(v: _View) -> Hit | None:
    orphan = v.valid("group_size") & ~v.valid("group_id")
    empty = pc.fill_null(pc.equal(pc.binary_length(v.batch.column("group_id")), _ZERO), False)
    return _row_hit(orphan | empty.to_numpy(zero_copy_only=False), "group_id", lambda r: (
        "null while group_size is set; a group size needs a group_id" if orphan[r] else
        "empty; expected a non-empty id or null"))


@lru_cache(maxsize=64)
def _batch_checks(vocab_size: int | None) -> tuple[Callable[[_View], Hit | None], ...]:
    """The per-batch rules, in tie-break order; each sees only rows that passed all
    earlier rules. validate_native.cpp checks the same rules (and the whole-table ones):
    a rule changed or added here is changed or added there too
    (test_validate_native.py counts them)."""
    return (
        *(partial(_length, name=n) for n in ("loss_mask", "logprobs", *_PER_TOKEN)),
        *(partial(_null_items, name=n) for n in ("tokens", "loss_mask", "logprobs", *_PER_TOKEN, "step_rewards")),
        partial(_token_ids, vocab_size=vocab_size),
        partial(_elements, name="loss_mask", ok=lambda x: x <= 1, expected="0 or 1"),
        _finite("logprobs"), _logprob_sign, _policy_version,
        partial(_elements, name="token_policy_version", ok=lambda x: x >= 0, expected=">= 0"),
        _tpv_vs_policy_version, _finite("advantages"), _finite("values"),
        _null_turns, _turn_bounds, _turn_order, _step_reward_count, _finite("step_rewards", unit="turn"),
        _reward, _reward_components, _group_size, _group_id,
    )


def _row_error(table: str, row: int, column: str, what: str) -> InvalidArgument:
    return InvalidArgument(f"table {table!r}: row {row}, column {column!r}: {what}")


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise InvalidArgument(message)
