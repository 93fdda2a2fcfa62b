"""The native check in front of the trajectory rules (validate_native.cpp): it says a
batch is clean exactly when the Python checks find nothing, so that skipping them changes
no answer. Its errors are never its own: where it says no, the Python checks run
(test_schema.py runs every validation test with and without it)."""

from __future__ import annotations

import copy
import math

import numpy as np
import pyarrow as pa
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from expstore import schema
from expstore.errors import InvalidArgument
from expstore.synthetic import trajectories
from test_schema import CORRUPTIONS, RULES, T, _grow, batch, make_row, rows, table

native = schema.native


def test_the_native_check_is_built():
    assert native is not None, "expstore._validate_native is missing: reinstall with a C++ compiler"


def test_the_rules_it_repeats_are_the_python_rules():
    """validate_native.cpp repeats schema.py's rules; a rule added there without its twin
    here would be skipped for every clean batch. These are the rules it was written for."""
    assert len(schema._batch_checks(None)) == 30
    assert [f.name for f in schema.TRAJECTORY_V1 if not f.nullable] == [
        "traj_id", "prompt_id", "task", "tokens", "loss_mask", "logprobs", "policy_version", "finish_reason"]


def python_passes(t: pa.Table, vocab_size: int | None = None) -> bool:
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(schema, "native", None)
        try:
            schema.validate_trajectories(t, table=T, vocab_size=vocab_size)
        except InvalidArgument:
            return False
    return True


def clean(t: pa.Table, vocab_size: int | None = None) -> bool:
    return native.clean(t.to_batches(), vocab_size)


@pytest.mark.parametrize("corrupt", [r[1] for r in RULES], ids=[r[0] for r in RULES])
def test_each_rule_makes_a_batch_unclean(corrupt):
    r = rows(6)
    assert clean(table(r))
    corrupt(r[3])
    assert not clean(table(r))


def test_clean_batches_of_every_shape():
    assert clean(table([]))
    assert clean(schema.conform(trajectories(8, tokens=20), schema.TRAJECTORY_V1, table=T))
    r = rows(5)
    for k in ("group_id", "group_size", "token_policy_version", "turns", "reward", "step_rewards",
              "reward_components", "advantages", "values", "metadata"):
        r[1][k] = None
    r[2]["turns"] = r[2]["step_rewards"] = []
    r[3].update(tokens=[], loss_mask=[], logprobs=[], token_policy_version=[], advantages=[], values=[],
                turns=[{"start": 0, "end": 0}], step_rewards=[0.0])
    assert clean(table(r))


def test_traj_ids_are_unique_across_batches():
    r = rows(6)
    r[5]["traj_id"] = r[0]["traj_id"]
    t = pa.concat_tables([table(r[:3]), table(r[3:])])
    assert [b.num_rows for b in t.to_batches()] == [3, 3]
    assert not clean(t)
    assert clean(t.slice(1))  # the first row, and its id, cut off


def test_tokens_below_the_vocab_size():
    t = table(rows(4))  # tokens 100 .. 103 + i
    assert clean(t, 107) and not clean(t, 106) and clean(t, None)
    assert not clean(t, -1)  # no token is below a negative size: the Python checks say so


def test_slices_see_only_their_rows():
    r = rows(9)
    for i in (0, 1, 7, 8):
        r[i]["loss_mask"] = [5] * len(r[i]["loss_mask"])
        r[i]["turns"] = [{"start": 50, "end": 1}]
        r[i]["reward_components"] = [("x", math.inf)]
    whole = table(r).combine_chunks()
    assert clean(whole.slice(2, 5)) and not clean(whole.slice(2, 6)) and not clean(whole.slice(1, 3))


def test_a_null_row_owning_a_segment_is_ignored_and_null_elements_go_to_python():
    t = table(rows(3))
    offsets = np.concatenate([[0], np.cumsum([len(make_row(i)["tokens"]) for i in range(3)])]).astype(np.int32)
    values = np.full(offsets[-1], 0.5, np.float32)
    values[offsets[1]:offsets[2]] = np.nan  # row 1 is null but its segment holds NaN
    adv = pa.ListArray.from_arrays(pa.array(offsets), pa.array(values), mask=pa.array([False, True, False]))
    i = t.schema.get_field_index("advantages")
    assert clean(t.set_column(i, schema.TRAJECTORY_V1.field("advantages"), adv))
    # A null element in a null row's segment is allowed too, but only the Python checks
    # tell it from one in a valid row's: not clean here, and the Python checks pass it.
    nulls = pa.array(values, mask=np.isnan(values))
    t = t.set_column(i, schema.TRAJECTORY_V1.field("advantages"),
                     pa.ListArray.from_arrays(pa.array(offsets), nulls, mask=pa.array([False, True, False])))
    assert not clean(t) and python_passes(t)


def test_columns_of_other_types_go_to_python():
    t = table(rows(3))
    i = t.schema.get_field_index("policy_version")
    assert not clean(t.set_column(i, "policy_version", t.column(i).cast(pa.int32())))
    assert not clean(t.drop_columns(["reward"]))


def test_refuses_what_is_not_record_batches():
    with pytest.raises(TypeError):
        native.clean([table(rows(2))])


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(batch(), st.sampled_from([None, *sorted(CORRUPTIONS)]), st.sampled_from([None, 1, 30, 60]), st.data())
def test_clean_exactly_when_the_python_checks_pass(rs, corruption, vocab_size, data):
    r = copy.deepcopy(rs)
    if corruption is not None:
        row = data.draw(st.integers(0, len(r) - 1))
        _grow(r[row])
        CORRUPTIONS[corruption](r[row])
    t = table(r)
    offset = data.draw(st.integers(0, 2))
    if offset:  # the rows sliced out of a longer batch
        t = pa.concat_tables([table([make_row(100 + i) for i in range(offset)]), t]).combine_chunks().slice(offset)
    assert clean(t, vocab_size) == python_passes(t, vocab_size)
