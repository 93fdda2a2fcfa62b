"""Trajectory protocol v1: schema, conform and validation (expstore.schema)."""

from __future__ import annotations

import copy
import math

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pytest
from hypothesis import given, settings, strategies as st, HealthCheck

from expstore import schema
from expstore.errors import InvalidArgument
from expstore.schema import (RESERVED_COLUMNS, TRAJECTORY_V1, TURN, conform, table_schema,
                             validate_trajectories)

T = "t"  # table name in every error


@pytest.fixture(autouse=True, params=["native", "python"])
def validators(request, monkeypatch):
    """Every test runs twice: with the native check in front of the Python checks
    (validate_native.cpp, test_validate_native.py), and with the Python checks alone, as
    where it is not built."""
    if request.param == "python":
        monkeypatch.setattr(schema, "native", None)
    return request.param


def make_row(i: int, n_tok: int | None = None) -> dict:
    """A valid trajectory with two turns (user prompt, assistant answer)."""
    n = 4 + i if n_tok is None else n_tok
    h = n // 2
    mask = [0] * h + [1] * (n - h)
    return {
        "traj_id": f"traj-{i}", "prompt_id": f"p{i // 2}", "group_id": f"g{i // 2}", "group_size": 2,
        "task": "math", "tokens": list(range(100, 100 + n)), "loss_mask": mask,
        "logprobs": [0.0 if m == 0 else -0.25 for m in mask], "policy_version": 3,
        "token_policy_version": [3 + (k % 2) for k in range(n)],
        "turns": [{"role": "user", "start": 0, "end": h},
                  {"role": "assistant", "start": h, "end": n, "tool_name": "python",
                   "tool_status": "ok", "latency_ms": 1.5}],
        "reward": 1.0, "step_rewards": [0.0, 1.0], "reward_components": [("pass", 1.0)],
        "advantages": [0.5] * n, "values": [0.1] * n, "finish_reason": "stop", "metadata": "{}",
    }


def rows(k: int = 5) -> list[dict]:
    return [make_row(i) for i in range(k)]


def table(rs: list[dict]) -> pa.Table:
    return pa.Table.from_pylist(rs, schema=TRAJECTORY_V1)  # does not check nullability


def error_of(rs: list[dict], **kw) -> str:
    with pytest.raises(InvalidArgument) as e:
        validate_trajectories(table(rs), table=T, **kw)
    return str(e.value)


def test_valid_batch_passes():
    validate_trajectories(table(rows()), table=T)
    r = rows()
    for k in ("group_id", "group_size", "token_policy_version", "turns", "reward", "step_rewards",
              "reward_components", "advantages", "values", "metadata"):
        r[1][k] = None  # every nullable column may be null
    r[2]["turns"] = r[2]["step_rewards"] = []
    r[3].update(tokens=[], loss_mask=[], logprobs=[], token_policy_version=[], advantages=[], values=[],
                turns=[{"start": 0, "end": 0}], step_rewards=[0.0])
    r[4]["group_size"] = None  # group_id without group_size is allowed
    validate_trajectories(table(r), table=T)
    validate_trajectories(table([]), table=T)


def _set(key, value):
    def f(r):
        r[key] = value(r) if callable(value) else value
    return f


def _item(key, k, value):
    def f(r):
        r[key][k] = value
    return f


# (name, corruption of one row, column named, words in the message)
RULES = [
    ("required null", _set("tokens", None), "tokens", "required"),
    ("empty traj_id", _set("traj_id", ""), "traj_id", "empty"),
    ("loss_mask length", _set("loss_mask", lambda r: r["loss_mask"][:-1]), "loss_mask", "elements"),
    ("logprobs length", _set("logprobs", lambda r: r["logprobs"] + [0.0]), "logprobs", "elements"),
    ("tpv length", _set("token_policy_version", lambda r: r["token_policy_version"][1:]),
     "token_policy_version", "one per token"),
    ("advantages length", _set("advantages", [0.0]), "advantages", "one per token"),
    ("values length", _set("values", lambda r: r["values"] * 2), "values", "one per token"),
    ("null token", _item("tokens", 1, None), "tokens", "null"),
    ("null loss_mask item", _item("loss_mask", 0, None), "loss_mask", "null"),
    ("null logprob", _item("logprobs", 2, None), "logprobs", "null"),
    ("token < 0", _item("tokens", 2, -1), "tokens", "value -1 at token 2; expected >= 0"),
    ("token INT32_MIN", _item("tokens", 0, -2**31), "tokens", "value -2147483648 at token 0; expected >= 0"),
    ("loss_mask 2", _item("loss_mask", 1, 2), "loss_mask", "0 or 1"),
    ("logprob nan", _item("logprobs", 0, math.nan), "logprobs", "finite"),
    ("logprob -inf", _item("logprobs", 0, -math.inf), "logprobs", "finite"),
    ("logprob > 0", _item("logprobs", -1, 0.5), "logprobs", "<= 0"),
    ("policy_version < 0", _set("policy_version", -1), "policy_version", ">= 0"),
    ("tpv < 0", _item("token_policy_version", 0, -1), "token_policy_version", ">= 0"),
    ("tpv < policy_version", _item("token_policy_version", -1, 2), "token_policy_version",
     "below policy_version"),
    ("advantage inf", _item("advantages", 0, math.inf), "advantages", "finite"),
    ("value nan", _item("values", 0, math.nan), "values", "finite"),
    ("null turn", _item("turns", 1, None), "turns", "null"),
    ("turn without end", lambda r: r["turns"][0].update(end=None), "turns", "no end"),
    ("turn start < 0", lambda r: r["turns"][0].update(start=-1), "turns", "0 <= start"),
    ("turn end < start", lambda r: r["turns"][1].update(end=r["turns"][1]["start"] - 1), "turns", "<= end"),
    ("turn past tokens", lambda r: r["turns"][1].update(end=len(r["tokens"]) + 1), "turns", "length of tokens"),
    ("turns overlap", lambda r: r["turns"][1].update(start=r["turns"][0]["end"] - 1), "turns", "overlap"),
    ("turns unordered", lambda r: r["turns"].reverse(), "turns", "ordered"),
    ("step_rewards count", _set("step_rewards", [1.0]), "step_rewards", "one per turn"),
    ("step_reward nan", _item("step_rewards", 1, math.nan), "step_rewards", "finite"),
    ("null step_reward", _item("step_rewards", 1, None), "step_rewards", "null"),
    ("reward nan", _set("reward", math.nan), "reward", "finite"),
    ("reward component inf", _set("reward_components", [("a", 1.0), ("len", math.inf)]),
     "reward_components", "'len'"),
    ("reward component null", _set("reward_components", [("a", None)]), "reward_components", "finite"),
    ("group_size 0", _set("group_size", 0), "group_size", ">= 1"),
    ("group_size without group_id", _set("group_id", None), "group_id", "group_size"),
    ("empty group_id", _set("group_id", ""), "group_id", "empty"),
]


@pytest.mark.parametrize("corrupt,column,words", [r[1:] for r in RULES], ids=[r[0] for r in RULES])
def test_each_rule_names_row_and_column(corrupt, column, words):
    r = rows(6)
    corrupt(r[3])
    msg = error_of(r)
    assert msg.startswith(f"table 't': row 3, column '{column}': "), msg
    assert words in msg, msg
    assert error_of(r, row_offset=100).startswith(f"table 't': row 103, column '{column}'")


def test_duplicate_traj_id_names_the_earlier_row():
    r = rows(6)
    r[4]["traj_id"] = r[1]["traj_id"]
    msg = error_of(r)
    assert msg.startswith("table 't': row 4, column 'traj_id': 'traj-1' duplicates row 1"), msg


def test_first_row_wins_then_first_rule():
    r = rows(6)
    r[4]["loss_mask"][0] = 7     # a later row, an earlier rule
    r[2]["reward"] = math.inf    # an earlier row, a later rule
    r[2]["turns"][0]["start"] = -5
    assert error_of(r).startswith("table 't': row 2, column 'turns'")
    r[1]["traj_id"] = r[5]["traj_id"]  # the duplicate is the later row (5)
    assert error_of(r).startswith("table 't': row 2, column 'turns'")


@pytest.mark.parametrize("late,early,column", [
    (_set("loss_mask", [1]), _set("logprobs", [0.0]), "logprobs"),
    (_item("logprobs", 0, math.nan), _item("logprobs", -1, 0.5), "logprobs"),
    (_item("token_policy_version", 0, -1), _item("token_policy_version", -1, 0), "token_policy_version"),
    (lambda r: r["turns"][1].update(end=99), lambda r: r["turns"].reverse(), "turns"),
    (_set("reward", math.nan), _item("step_rewards", 0, math.inf), "step_rewards"),
    (_set("group_id", ""), _set("group_id", None), "group_id"),
])
def test_first_row_wins_among_related_rules(late, early, column):
    r = rows(6)
    late(r[4])
    early(r[2])
    assert error_of(r).startswith(f"table 't': row 2, column '{column}'")


def test_message_gives_value_and_position():
    r = rows(3)
    r[1]["loss_mask"][3] = 9
    assert "value 9 at token 3; expected 0 or 1" in error_of(r)
    r = rows(3)
    r[2]["turns"][1]["end"] = 99
    assert "turn 1 spans [3, 99); expected 0 <= start <= end <= 6" in error_of(r)


def test_token_ids_below_the_vocab_size():
    r = rows(4)  # row i holds tokens 100 .. 103 + i
    validate_trajectories(table(r), table=T, vocab_size=107)
    assert error_of(r, vocab_size=106, row_offset=10) == (
        "table 't': row 13, column 'tokens': value 106 at token 6; "
        "expected a token id in [0, 106) (the table's vocab_size)")
    r[1]["tokens"][0] = -5
    assert error_of(r, vocab_size=106).startswith("table 't': row 1, column 'tokens': value -5 at token 0")


def _batch_with_bad_outside(bad_rows: list[int]) -> pa.RecordBatch:
    r = rows(9)
    for i in bad_rows:  # invalid in ways that a slice-unaware check would blame on others
        r[i]["loss_mask"] = [5] * len(r[i]["loss_mask"])
        r[i]["logprobs"] = [math.nan] * len(r[i]["logprobs"])
        r[i]["token_policy_version"] = [-1] * len(r[i]["tokens"])
        r[i]["turns"] = [{"start": 50, "end": 1}]
        r[i]["step_rewards"] = [math.nan]
        r[i]["reward_components"] = [("x", math.inf)]
        r[i]["advantages"] = [math.nan] * len(r[i]["tokens"])
    return table(r).combine_chunks().to_batches()[0]


def test_sliced_batch_validates_its_own_rows():
    batch = _batch_with_bad_outside([0, 1, 2, 7, 8])
    part = batch.slice(3, 4)
    assert part.column("tokens").offset == 3
    validate_trajectories(part, table=T)
    validate_trajectories(pa.Table.from_batches([part]), table=T)
    with pytest.raises(InvalidArgument, match=r"row 2, column 'loss_mask'"):
        validate_trajectories(batch.slice(5, 3), table=T)  # rows 5, 6 ok, 7 bad


def test_sliced_row_is_reported_in_slice_coordinates():
    r = rows(8)
    r[5]["logprobs"][-1] = 0.25
    batch = table(r).to_batches()[0].slice(2, 5)
    with pytest.raises(InvalidArgument, match=r"^table 't': row 13, column 'logprobs'"):
        validate_trajectories(batch, table=T, row_offset=10)


def test_many_chunks_report_global_row():
    r = rows(8)
    r[6]["turns"][0]["end"] = 99
    t = pa.concat_tables([table(r[:3]), table(r[3:5]), table(r[5:])])
    assert t.column("tokens").num_chunks == 3
    with pytest.raises(InvalidArgument, match=r"row 6, column 'turns'"):
        validate_trajectories(t, table=T)
    r[6] = make_row(6)
    r[7]["traj_id"] = "traj-0"  # duplicates across chunks
    t = pa.concat_tables([table(r[:3]), table(r[3:])])
    with pytest.raises(InvalidArgument, match=r"row 7, column 'traj_id': 'traj-0' duplicates row 0"):
        validate_trajectories(t, table=T)


def test_null_row_owning_a_segment_is_ignored():
    t = table(rows(3))
    n_tok = pc.list_value_length(t.column("tokens")).to_numpy()
    offsets = np.concatenate([[0], np.cumsum(n_tok)]).astype(np.int32)
    values = np.full(offsets[-1], 0.5, np.float32)
    values[offsets[1]:offsets[2]] = np.nan  # row 1 is null but its segment holds NaN
    adv = pa.ListArray.from_arrays(pa.array(offsets), pa.array(values),
                                   mask=pa.array([False, True, False]))
    t = t.set_column(t.schema.get_field_index("advantages"), TRAJECTORY_V1.field("advantages"), adv)
    validate_trajectories(t, table=T)


# ---------------------------------------------------------------------------- conform

def minimal(n: int = 3) -> dict:
    return {k: [r[k] for r in rows(n)] for k in
            ("traj_id", "prompt_id", "task", "tokens", "loss_mask", "logprobs", "policy_version",
             "finish_reason")}


def test_conform_fills_nullable_columns_and_orders():
    cols = minimal()
    data = pa.table(dict(reversed(list(cols.items()))))
    out = conform(data, TRAJECTORY_V1, table=T)
    assert out.schema == TRAJECTORY_V1
    assert out.column("reward").null_count == 3 and out.column("turns").null_count == 3
    assert out.column("tokens").to_pylist() == cols["tokens"]
    validate_trajectories(out, table=T)


def test_conform_record_batch_and_extra_columns():
    schema = table_schema("trajectory", pa.schema([("score", pa.float64())]), table=T)
    rb = pa.RecordBatch.from_pydict({**minimal(), "score": [1.0, 2.0, 3.0]})
    out = conform(rb, schema, table=T)
    assert out.schema.names[-1] == "score" and out.column("score").to_pylist() == [1.0, 2.0, 3.0]


def _addresses(col: pa.ChunkedArray) -> list[int]:
    return [b.address for c in col.chunks for b in c.buffers() if b is not None]


def test_conform_does_not_copy_matching_data():
    t = table(rows(4))
    out = conform(t, TRAJECTORY_V1, table=T)
    for name in TRAJECTORY_V1.names:
        assert _addresses(out.column(name)) == _addresses(t.column(name)), name
    rb = t.combine_chunks().to_batches()[0].slice(1, 2)
    out = conform(rb, TRAJECTORY_V1, table=T)
    assert _addresses(out.column("logprobs")) == _addresses(pa.chunked_array([rb.column("logprobs")]))


def test_conform_safe_casts():
    cols = minimal()
    data = pa.table({
        **cols,
        "tokens": pa.array(cols["tokens"], pa.list_(pa.int64())),
        "loss_mask": pa.array(cols["loss_mask"], pa.large_list(pa.int64())),
        "logprobs": pa.array(cols["logprobs"], pa.list_(pa.float64())),
        "traj_id": pa.array(cols["traj_id"], pa.large_string()),
        "task": pa.array(cols["task"]).dictionary_encode(),
        "policy_version": pa.array(cols["policy_version"], pa.int32()),
        "reward": pa.array([0.1, None, 2.0], pa.float64()),
        "reward_components": pa.array([[("a", 1.0)], None, []], pa.map_(pa.string(), pa.float64())),
        "turns": pa.array([[{"start": 0, "end": 1}], None, []],
                          pa.list_(pa.struct([("start", pa.int64()), ("end", pa.int64())]))),
    })
    out = conform(data, TRAJECTORY_V1, table=T)
    assert out.schema == TRAJECTORY_V1
    assert out.column("tokens").to_pylist() == cols["tokens"]
    assert out.column("turns")[0].as_py() == [{**dict.fromkeys(TURN.names), "start": 0, "end": 1}]
    validate_trajectories(out, table=T)


@pytest.mark.parametrize("name,arr,words", [
    ("tokens", pa.array([[2 ** 40]], pa.list_(pa.int64())), "list<item: int64> to list<item: int32>"),
    ("loss_mask", pa.array([[-1]], pa.list_(pa.int64())), "list<item: uint8>"),
    ("policy_version", pa.array(["3"]), "string to int64"),
    ("traj_id", pa.array([7]), "int64 to string"),
    ("tokens", pa.array([1]), "int64 to list<item: int32>"),
])
def test_conform_refuses_unsafe_casts(name, arr, words):
    data = pa.table({**minimal(1), name: arr})
    with pytest.raises(InvalidArgument, match=rf"^table 't': column '{name}': cannot convert") as e:
        conform(data, TRAJECTORY_V1, table=T)
    assert words in str(e.value)


def test_conform_refusals():
    with pytest.raises(InvalidArgument, match=r"required column 'logprobs'"):
        conform(pa.table({k: v for k, v in minimal().items() if k != "logprobs"}), TRAJECTORY_V1, table=T)
    with pytest.raises(InvalidArgument, match=r"unknown column\(s\) \['scroe'\]; known columns: \['traj_id'"):
        conform(pa.table({**minimal(), "scroe": [1, 2, 3]}), TRAJECTORY_V1, table=T)
    with pytest.raises(InvalidArgument, match=r"\['priority'\] are server-owned"):
        conform(pa.table({**minimal(), "priority": [1.0, 2.0, 3.0]}), TRAJECTORY_V1, table=T)
    cols = minimal()
    cols["prompt_id"][2] = None
    with pytest.raises(InvalidArgument, match=r"^table 't': row 2, column 'prompt_id': null"):
        conform(pa.table(cols), TRAJECTORY_V1, table=T)
    dup = pa.Table.from_arrays([pa.array(["a"]), pa.array(["b"])], names=["traj_id", "traj_id"])
    with pytest.raises(InvalidArgument, match="duplicate"):
        conform(dup, TRAJECTORY_V1, table=T)


def test_conform_generic_schema():
    schema = table_schema("generic", pa.schema([pa.field("x", pa.int32(), nullable=False),
                                                ("y", pa.string())]), table=T)
    out = conform(pa.table({"x": pa.array([1, 2], pa.int64())}), schema, table=T)
    assert out.schema == schema and out.column("y").null_count == 2
    with pytest.raises(InvalidArgument, match="row 1, column 'x'"):
        conform(pa.table({"x": [1, None]}), schema, table=T)


def test_table_schema():
    assert table_schema("trajectory", None, table=T) == TRAJECTORY_V1
    s = table_schema("trajectory", pa.schema([("score", pa.float32()), TRAJECTORY_V1.field("reward")]), table=T)
    assert s.names == TRAJECTORY_V1.names + ["score"]
    with pytest.raises(InvalidArgument, match="'reward' is part of trajectory protocol v1"):
        table_schema("trajectory", pa.schema([("reward", pa.float64())]), table=T)
    with pytest.raises(InvalidArgument, match="'traj_id' is part"):
        table_schema("trajectory", pa.schema([("traj_id", pa.string())]), table=T)  # nullable
    for kind in ("trajectory", "generic"):
        for name in RESERVED_COLUMNS:
            with pytest.raises(InvalidArgument, match="server-owned"):
                table_schema(kind, pa.schema([(name, pa.int64())]), table=T)
        with pytest.raises(InvalidArgument, match="duplicate"):
            table_schema(kind, pa.schema([("a", pa.int64()), ("a", pa.int64())]), table=T)
    for empty in (None, pa.schema([])):
        with pytest.raises(InvalidArgument, match="needs a schema"):
            table_schema("generic", empty, table=T)
    with pytest.raises(InvalidArgument, match="kind"):
        table_schema("tensor", None, table=T)


# ---------------------------------------------------------------------------- properties

@st.composite
def trajectory(draw, i: int) -> dict:
    n = draw(st.integers(0, 50))
    mask = draw(st.lists(st.integers(0, 1), min_size=n, max_size=n))
    pv = draw(st.integers(0, 5))
    cuts = sorted(draw(st.lists(st.integers(0, n), max_size=8)))
    cuts = cuts[: len(cuts) // 2 * 2]  # pairs of cut points: ordered turns, gaps allowed
    turns = [{"role": "assistant", "start": a, "end": b} for a, b in zip(cuts[::2], cuts[1::2])]
    has = draw(st.lists(st.booleans(), min_size=5, max_size=5))
    lp = st.floats(-20, 0, allow_nan=False, width=32)
    return {
        "traj_id": f"t{i}", "prompt_id": "p", "task": "x", "tokens": list(range(n)), "loss_mask": mask,
        "logprobs": [draw(lp) if m else 0.0 for m in mask], "policy_version": pv,
        "token_policy_version": [pv + draw(st.integers(0, 2)) for _ in range(n)] if has[0] else None,
        "turns": turns if has[1] else None,
        "step_rewards": [draw(st.floats(-1, 1, width=32)) for _ in turns] if has[1] and has[2] else None,
        "reward": draw(st.floats(-1, 1, width=32)) if has[3] else None,
        "group_id": "g" if has[4] else None, "group_size": 4 if has[4] else None,
        "advantages": [0.0] * n if has[2] else None, "values": None, "finish_reason": "length",
    }


@st.composite
def batch(draw) -> list[dict]:
    k = draw(st.integers(2, 6))
    return [draw(trajectory(i)) for i in range(k)]


def _grow(r: dict) -> None:
    """Make sure the row has a token with loss_mask 1 and a turn (keeps it valid)."""
    r["tokens"].append(1)
    r["loss_mask"].append(1)
    r["logprobs"].append(-1.0)
    for k in ("token_policy_version", "advantages", "values"):
        if r[k] is not None:
            r[k].append(r["policy_version"] if k == "token_policy_version" else 0.0)
    if r["turns"] is None:
        r["turns"], r["step_rewards"] = [], None
    n = len(r["tokens"])
    r["turns"].append({"start": n - 1, "end": n})
    if r["step_rewards"] is not None:
        r["step_rewards"].append(0.0)


CORRUPTIONS = {
    "loss_mask": lambda r: r["loss_mask"].__setitem__(-1, 3),
    "logprobs": lambda r: r["logprobs"].__setitem__(-1, 0.5),
    "policy_version": lambda r: r.__setitem__("policy_version", -2),
    "turns": lambda r: r["turns"][-1].__setitem__("end", len(r["tokens"]) + 1),
    "traj_id": lambda r: r.__setitem__("traj_id", "t0"),
    "token_policy_version": lambda r: r.__setitem__(
        "token_policy_version", [r["policy_version"]] * (len(r["tokens"]) - 1) + [r["policy_version"] - 1]),
    "step_rewards": lambda r: r.__setitem__("step_rewards", [0.0] * (len(r["turns"]) + 1)),
    "reward": lambda r: r.__setitem__("reward", math.inf),
}


# too_slow; function_scoped_fixture: the validators fixture holds for every example alike.
SUPPRESSED = [HealthCheck.too_slow, HealthCheck.function_scoped_fixture]


@settings(max_examples=60, deadline=None, suppress_health_check=SUPPRESSED)
@given(batch())
def test_random_valid_batches_pass(rs):
    validate_trajectories(table(rs), table=T)


@settings(max_examples=120, deadline=None, suppress_health_check=SUPPRESSED)
@given(batch(), st.sampled_from(sorted(CORRUPTIONS)), st.data())
def test_first_corruption_is_reported_at_its_row(rs, column, data):
    row = data.draw(st.integers(1, len(rs) - 1))
    r = copy.deepcopy(rs)
    _grow(r[row])
    validate_trajectories(table(r), table=T)  # still valid after growing
    CORRUPTIONS[column](r[row])
    if row + 1 < len(r):  # a second, later corruption must not be the one reported
        later = data.draw(st.integers(row + 1, len(r) - 1))
        _grow(r[later])
        CORRUPTIONS[data.draw(st.sampled_from(sorted(CORRUPTIONS)))](r[later])
    offset = data.draw(st.integers(0, 3))
    t = table(r)
    if offset:  # the same rows at the end of a longer batch, sliced
        t = pa.concat_tables([table([make_row(100 + i) for i in range(offset)]), t]).combine_chunks()
        t = t.slice(offset)
    with pytest.raises(InvalidArgument) as e:
        validate_trajectories(t, table=T, row_offset=7)
    assert str(e.value).startswith(f"table 't': row {7 + row}, column '{column}': "), str(e.value)
