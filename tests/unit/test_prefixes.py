"""Shared prompt prefixes (expstore/prefixes.py): a chunk stores each distinct prompt
prefix of its rows once, in memory and on the SSD, and every read returns exactly the
whole rows that were inserted: from memory, from SSD blocks after a restart, after a
compaction, and from the remote tier."""

from __future__ import annotations

from unittest import mock

import numpy as np
import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from expstore import codec, prefixes
from expstore.catalog import Catalog
from expstore.chunks import ChunkStore
from expstore.gather import take_rows
from expstore.spec import TableSpec
from expstore.synthetic import trajectories
from expstore.table import Table
from expstore.tiers.remote import RemoteTier

PROMPT, ANSWER, GROUP = 2048, 512, 16

SCHEMA = pa.schema([
    pa.field("tokens", pa.list_(pa.int32())),
    pa.field("loss_mask", pa.list_(pa.uint8())),
    pa.field("logprobs", pa.list_(pa.float32())),
    pa.field("advantages", pa.list_(pa.float32())),
    pa.field("step_rewards", pa.list_(pa.float32())),  # not per token: never split
    pa.field("id", pa.int64(), nullable=False, metadata={"note": "kept"}),
], metadata={"table": "t"})


def group(n: int = GROUP, groups: int = 1, shared: bool = True, seed: int = 0, prefix: str = "g") -> pa.Table:
    return trajectories(n, tokens=PROMPT + ANSWER, prompt_tokens=PROMPT, groups=groups,
                        shared_prompts=shared, seed=seed, id_prefix=prefix)


def batch(t: pa.Table) -> pa.RecordBatch:
    return t.combine_chunks().to_batches()[0]


@st.composite
def rows(draw):
    """Rows of every shape: prompts drawn from a small pool (so that rows share them),
    prompts without any generated token, empty and null lists, multi-turn masks (zeros
    after the first 1), null per-token columns, prompt logprobs equal or not."""
    pool = draw(st.lists(st.lists(st.integers(-2**31, 2**31 - 1), max_size=12), min_size=1, max_size=3))
    out = []
    for i in range(draw(st.integers(0, 10))):
        if draw(st.integers(0, 9)) == 0:
            out.append({"tokens": None, "loss_mask": None, "logprobs": None, "advantages": None,
                        "step_rewards": None, "id": i})
            continue
        prompt = draw(st.sampled_from(pool))
        answer = draw(st.lists(st.integers(0, 9), max_size=6))
        mask = [0] * len(prompt) + draw(st.lists(st.integers(0, 1), min_size=len(answer), max_size=len(answer)))
        prompt_logprobs = [0.0] * len(prompt) if draw(st.booleans()) else \
            draw(st.lists(st.sampled_from([-0.0, -1.5, 2.0]), min_size=len(prompt), max_size=len(prompt)))
        logprobs = prompt_logprobs + [-0.25] * len(answer)
        tokens = prompt + answer
        out.append({"tokens": tokens, "loss_mask": None if draw(st.integers(0, 9)) == 0 else mask,
                    "logprobs": logprobs, "advantages": None if draw(st.booleans()) else [1.0] * len(tokens),
                    "step_rewards": [0.5], "id": i})
    return pa.RecordBatch.from_pylist(out, schema=SCHEMA)


@settings(max_examples=300, deadline=None)
@given(rows(), st.data())
def test_any_rows_round_trip_exactly_through_every_slice_take_and_block(b, data):
    with mock.patch.object(prefixes, "MIN_SAVED_BYTES", 0), mock.patch.object(prefixes, "MIN_SAVED_SHARE", 0.0), \
            mock.patch.object(prefixes, "MIN_PROMPT_TOKENS", 0):  # share even tiny prefixes
        stored = prefixes.share(b)
    whole = prefixes.whole_rows(stored)
    assert whole.equals(b) and whole.schema.equals(b.schema, check_metadata=True)
    n = b.num_rows
    lo = data.draw(st.integers(0, n))
    k = data.draw(st.integers(0, n - lo))
    part = prefixes.compact(stored.slice(lo, k))  # an SSD block
    read = pa.ipc.read_record_batch(part.serialize(), stored.schema)
    assert prefixes.whole_rows(read).equals(b.slice(lo, k))
    assert prefixes.whole_rows(stored.slice(lo, k)).equals(b.slice(lo, k))
    picks = pa.array(data.draw(st.lists(st.integers(0, max(n - 1, 0)), max_size=8 if n else 0)), pa.int64())
    assert prefixes.whole_rows(stored.take(picks)).equals(b.take(picks))
    if len(picks):  # the native gather rebuilds them as it copies (a chunk and a slice of it)
        at = np.arange(len(picks)) % 2
        got = take_rows({0: stored, 1: stored.slice(0, n)}, at, picks.to_numpy(), b.schema)
        assert got.equals(b.take(picks)) and got.schema.equals(b.schema, check_metadata=True)


@settings(max_examples=300, deadline=None)
@given(rows(), st.data())
def test_a_rows_prompt_ends_at_its_first_generated_token(b, data):
    lo = data.draw(st.integers(0, b.num_rows))
    mask = b.column("loss_mask").slice(lo)  # a slice: its offsets do not start at 0
    expected = [0 if m is None else next((i for i, v in enumerate(m) if v == 1), len(m)) for m in mask.to_pylist()]
    assert prefixes.prompt_lengths(mask).tolist() == expected
    with mock.patch.object(prefixes, "native", None):  # numpy's search, where the gather is not built
        assert prefixes.prompt_lengths(mask).tolist() == expected


@pytest.mark.parametrize("scan", ["native", "numpy"])
@pytest.mark.parametrize("value_type", [pa.uint8(), pa.int8(), pa.bool_(), pa.int32()])
@pytest.mark.parametrize("masks, expected", [
    ([[1, 0], [0, 1]], [0, 1]),  # a row that begins with its answer
    ([[0, 1], [1, 1], [1]], [1, 0, 0]),  # ...right after a row that ended in one
    ([[], [0, 0], None, [0, 0, 1, 0, 1]], [0, 2, 0, 2]),  # no answer; a null row; several turns
])
def test_prompt_lengths_of_rows_that_begin_with_their_answer(masks, expected, value_type, scan):
    masks = [None if m is None else [bool(v) for v in m] for m in masks] if value_type == pa.bool_() else masks
    with mock.patch.object(prefixes, "native", prefixes.native if scan == "native" else None):
        assert prefixes.prompt_lengths(pa.array(masks, pa.list_(value_type))).tolist() == expected


@pytest.mark.skipif(prefixes.native is None, reason="the native gather is not built (no C++ compiler)")
def test_the_native_prompt_scan_refuses_rows_outside_its_values():
    values = np.array([0, 0, 1], np.uint8)
    assert prefixes.native.prompt_lengths(values, np.array([0, 1, 3]), np.array([3, 3, 3])).tolist() == [2, 1, 0]
    for starts, ends in [([0], [4]), ([-1], [2]), ([2], [1])]:
        with pytest.raises(IndexError, match="row 0 spans"):
            prefixes.native.prompt_lengths(values, np.array(starts), np.array(ends))
    with pytest.raises(ValueError, match="differ in length"):
        prefixes.native.prompt_lengths(values, np.array([0, 1]), np.array([3]))


def test_a_column_that_would_save_little_of_its_bytes_is_left_whole():
    b = batch(trajectories(256, tokens=4096, prompt_tokens=8))  # the prompts' zero logprobs: 8 KiB, 0.2% of them
    assert prefixes.share(b) is b


def test_a_group_stores_its_prompt_once_per_per_token_column():
    b = batch(group())
    stored = prefixes.share(b)
    for name in ("tokens", "loss_mask", "logprobs"):
        column = stored.column(name)
        assert len(column.field("prefix").values) == PROMPT, name  # one prompt for 16 rows
        assert len(column.field("rest").values) == GROUP * ANSWER, name
        assert column.field("prefix").sizes.to_pylist() == [PROMPT] * GROUP
    assert stored.column("traj_id").equals(b.column("traj_id"))
    assert stored.get_total_buffer_size() < b.get_total_buffer_size() / 3.5
    assert prefixes.whole_rows(stored).equals(b)


def test_rows_whose_prompts_differ_keep_their_own():
    two = prefixes.share(batch(group(groups=2)))  # two prompts, interleaved rows
    assert len(two.column("tokens").field("prefix").values) == 2 * PROMPT
    mixed = prefixes.share(batch(group(shared=False)))  # every prompt differs ...
    assert not prefixes.is_shared(mixed.schema)  # ... so no column is split,
    # not even loss_mask and logprobs, whose prompt zeros are the same: not worth a rebuild
    assert prefixes.whole_rows(two).equals(batch(group(groups=2)))
    assert prefixes.whole_rows(mixed).equals(batch(group(shared=False)))


def test_an_ssd_block_keeps_only_the_prompts_its_rows_use():
    b = batch(group(4 * GROUP, groups=4))  # rows round-robin over four prompts
    stored = prefixes.share(b)
    assert len(stored.column("tokens").field("prefix").values) == 4 * PROMPT
    # rows 3 and 4 use the last prompt and the first: IPC alone would write all four
    block = pa.ipc.read_record_batch(prefixes.compact(stored.slice(3, 2)).serialize(), stored.schema)
    assert len(block.column("tokens").field("prefix").values) == 2 * PROMPT
    assert prefixes.whole_rows(block).equals(b.slice(3, 2))


def test_the_ssd_tier_writes_each_block_with_only_the_prompts_its_rows_use(tmp_path):
    store = Catalog(tmp_path / "d")
    t = store.create_table(TableSpec("t"))
    t.insert(group(4 * GROUP, groups=4).sort_by("group_id"))  # four prompts, each on its rows in a row
    placement = t.parts.placement
    stored, layout = placement.memory.get_one(0), placement.ssd.layout(0)
    assert prefixes.is_shared(stored.schema) and len(layout.offsets) > 2
    offsets = layout.offsets.tolist()
    slices = [stored.slice(lo, hi - lo) for lo, hi in zip(offsets[:-1], offsets[1:])]
    compact = sum(len(codec.encode_block(prefixes.compact(s))) for s in slices)
    assert layout.stored == compact < sum(len(codec.encode_block(s)) for s in slices)
    store.close()


@pytest.mark.parametrize("forms", ["shared", "mixed"])
def test_take_rows_returns_whole_rows_from_shared_and_mixed_chunks(forms, gathers):
    chunks = {k: batch(group(seed=k, prefix=f"g{k}")) for k in range(3)}
    stored = {k: b if forms == "mixed" and k == 1 else prefixes.share(b) for k, b in chunks.items()}
    rng = np.random.default_rng(0)
    picks_chunk, picks_row = rng.integers(0, 3, 64), rng.integers(0, GROUP, 64)
    picks_chunk[:5], picks_row[:5] = 2, [3, 4, 5, 9, 0]  # a run and a jump in one segment
    expected = pa.Table.from_batches([chunks[c].slice(r, 1) for c, r in zip(picks_chunk, picks_row)])
    got = take_rows(stored, picks_chunk, picks_row, chunks[0].schema)
    assert pa.Table.from_batches([got]).equals(expected.combine_chunks())
    only = take_rows({k: b.select(["tokens", "loss_mask"]) for k, b in stored.items()}, picks_chunk, picks_row,
                     chunks[0].schema)  # a read of some columns: all of them shared
    assert pa.Table.from_batches([only]).equals(expected.select(["tokens", "loss_mask"]).combine_chunks())


def test_chunks_of_short_prompts_are_stored_as_sent():
    short = batch(trajectories(512, tokens=20, prompt_tokens=8, groups=4, shared_prompts=True))
    assert prefixes.share(short) is short  # 40% of the tokens are prompt, but 8 tokens a row
    with mock.patch.object(prefixes, "MIN_PROMPT_TOKENS", 8):
        assert prefixes.is_shared(prefixes.share(short).schema)


def test_a_user_struct_of_the_stored_type_is_not_taken_for_a_shared_column():
    stored = prefixes.share(batch(group()))
    assert prefixes.is_shared(stored.schema)  # remembered ...
    unmarked = pa.schema([f.remove_metadata() for f in stored.schema])  # ... yet the same types unmarked
    assert not prefixes.is_shared(unmarked)


def test_batches_without_tokens_and_loss_mask_and_user_structs_are_left_alone():
    t = pa.record_batch({"tokens": pa.array([[1, 2, 3]] * 64, pa.list_(pa.int32()))})
    assert prefixes.share(t) is t
    stored_type = prefixes.share(batch(group())).schema.field("tokens").type
    user = pa.record_batch([pa.nulls(2, stored_type)], names=["tokens"])  # same type, no mark
    assert prefixes.whole_rows(user) is user


def tables(**kw) -> dict[bool, Table]:
    return {share: Table(TableSpec(f"t{int(share)}", share_prefixes=share, **kw), seed=0) for share in (True, False)}


def all_rows(table: Table, n: int) -> pa.RecordBatch:
    return table.get(np.arange(1, n + 1)).data


def test_a_table_stores_a_group_in_under_a_third_of_the_bytes_and_samples_whole_rows():
    t = tables()
    groups = [group(seed=s, prefix=f"g{s}") for s in range(4)]
    for table in t.values():
        for g in groups:
            table.insert(g)
    on, off = t[True].stats()["memory_bytes"], t[False].stats()["memory_bytes"]
    assert off >= 4 * GROUP * (PROMPT + ANSWER) * 9  # int32 + float32 + uint8 per token, per row
    assert on * 3 < off
    expected = pa.Table.from_batches([all_rows(t[False], 64)])
    assert pa.Table.from_batches([all_rows(t[True], 64)]).equals(expected)
    by_id = {r["traj_id"]: r for r in expected.to_pylist()}
    sampled = t[True].sample(24).data
    assert sampled.schema.equals(expected.schema)
    assert [by_id[r["traj_id"]] for r in sampled.to_pylist()] == sampled.to_pylist()


def test_compacted_chunks_keep_sharing_and_return_whole_rows(monkeypatch):
    monkeypatch.setattr(ChunkStore, "MERGE_BYTES", 200 << 10)
    t = tables()
    for table in t.values():
        for s in range(6):
            table.insert(group(seed=s, prefix=f"g{s}"))
        table.wait_for_background()  # compaction copies rows on the table's background thread
    s_on, s_off = t[True].stats(), t[False].stats()
    assert s_on["compactions"] and s_on["chunks"] < 6
    assert s_on["memory_bytes"] * 3 < s_off["memory_bytes"]
    assert all_rows(t[True], 96).equals(all_rows(t[False], 96))


def test_rows_read_back_exactly_from_ssd_blocks_after_a_restart(tmp_path):
    store = Catalog(tmp_path / "d")
    t = {share: store.create_table(TableSpec(f"t{int(share)}", share_prefixes=share, memory_bytes=1))
         for share in (True, False)}
    for table in t.values():
        for s in range(2):  # four groups in a chunk, as the server coalesces four inserts
            table.insert(pa.concat_tables([group(seed=4 * s + k, prefix=f"g{4 * s + k}") for k in range(4)]).combine_chunks())
    on, off = t[True].stats()["ssd_bytes"], t[False].stats()["ssd_bytes"]
    assert on * 3 < off  # each SSD block keeps the prompts its rows use
    before = all_rows(t[False], 128)
    assert all_rows(t[True], 128).equals(before)
    store.close()

    store = Catalog(tmp_path / "d")
    again = store.table("t1")
    assert again.stats()["ssd_bytes"] == on
    assert all_rows(again, 128).equals(before)
    picks = np.array([127, 3, 20, 3, 1, 70])
    assert again.get(picks).data.equals(before.take(pa.array(picks - 1)))
    store.close()


def test_chunks_demoted_to_the_remote_tier_read_back_as_whole_rows(tmp_path):
    uri = (tmp_path / "remote").as_uri()
    store = Catalog(tmp_path / "d", remote=lambda name: RemoteTier(uri, name))
    table = store.create_table(TableSpec("t", tiers="remote", memory_bytes=1, ssd_bytes=1))
    for s in range(3):
        table.insert(group(seed=s, prefix=f"g{s}"))
    while table.demote():
        pass
    assert table.stats()["items_remote"] == 48
    expected = pa.Table.from_batches([batch(group(seed=s, prefix=f"g{s}")) for s in range(3)])
    got = pa.Table.from_batches([all_rows(table, 48)]).select(expected.column_names)
    assert got.equals(expected.cast(got.schema))
    store.close()
