"""Token-in, token-out checks at ingest (expstore/ingest_checks.py): turns agree with the
loss mask, an episode's rows extend each other token for token, a group's members share
their prompt. A violating insert is refused whole, naming the row, the column and the
first differing token with both values; nothing is stored."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest

from expstore import ingest_checks
from expstore.errors import InvalidArgument, Unavailable
from expstore.schema import TRAJECTORY_V1
from expstore.spec import SamplerSpec, TableSpec
from expstore.catalog import Catalog
from expstore.table import Table

pytestmark = pytest.mark.timeout(60)
TURN = TRAJECTORY_V1.field("turns").type


def row(traj_id: str, prompt: list[int], turns: list[tuple[str, list[int]]], *, episode: str | None = None,
        prompt_id: str = "p", group: str | None = None, mask: list[int] | None = None,
        with_turns: bool = True) -> dict:
    """A trajectory: the prompt (outside every turn), then each (role, tokens) turn;
    assistant tokens have loss_mask 1 unless ``mask`` says otherwise."""
    tokens, loss, spans = list(prompt), [0] * len(prompt), []
    for role, ids in turns:
        spans.append({"role": role, "start": len(tokens), "end": len(tokens) + len(ids)})
        tokens += ids
        loss += [1 if role == "assistant" else 0] * len(ids)
    loss = loss if mask is None else mask
    r = {"traj_id": traj_id, "prompt_id": prompt_id, "task": "t", "tokens": tokens, "loss_mask": loss,
         "logprobs": [-0.5 if m else 0.0 for m in loss], "policy_version": 0, "finish_reason": "stop",
         "turns": spans if with_turns else None, "group_id": group}
    if episode is not None:
        r["episode_id"] = episode
    return r


def rows(*rs: dict) -> pa.Table:
    t = pa.Table.from_pylist(list(rs))
    turns = pa.array([r["turns"] for r in rs], type=TURN)
    return t.set_column(t.schema.get_field_index("turns"), "turns", turns)


def table(*checks: str, **kw) -> Table:
    return Table(TableSpec("t", ingest_checks=list(checks), **kw))


# ---------------------------------------------------------------- turns_mask

def test_turns_mask_agrees_with_loss_mask():
    t = table("turns_mask")
    ok = row("a", [1, 2], [("assistant", [3, 4]), ("tool", [5]), ("assistant", [6])])
    t.insert(rows(ok))
    bad = row("b", [1, 2], [("assistant", [3, 4]), ("tool", [5]), ("assistant", [6, 7, 8])],
              mask=[0, 0, 1, 1, 0, 1, 0, 1])
    with pytest.raises(InvalidArgument) as e:
        t.insert(rows(row("c", [9], [("assistant", [9])]), bad))
    assert str(e.value) == ("table 't': row 1, column 'loss_mask': value 0 at token 6, inside turn 2 (role "
                            "'assistant', tokens [5, 8)); expected 1: assistant turns have loss_mask 1, every other "
                            "token 0 (ingest check 'turns_mask')")
    tool = row("d", [1], [("assistant", [2]), ("tool", [3, 4])], mask=[0, 1, 0, 1])
    with pytest.raises(InvalidArgument, match=r"row 0, column 'loss_mask': value 1 at token 3, inside turn 1 "
                                              r"\(role 'tool', tokens \[2, 4\)\); expected 0"):
        t.insert(rows(tool))
    prompt = row("e", [1, 2], [("assistant", [3])], mask=[0, 1, 1])
    with pytest.raises(InvalidArgument, match="value 1 at token 1, outside every turn; expected 0"):
        t.insert(rows(prompt))
    assert len(t) == 1  # refused whole
    t.insert(rows(row("f", [1, 2], [("assistant", [3])], mask=[1, 1, 0], with_turns=False)))  # no turns: unchecked
    assert len(t) == 2


def test_turns_mask_counts_rows_over_the_whole_call():
    t = table("turns_mask")
    good = rows(row("a", [1], [("assistant", [2])]))
    bad = rows(row("b", [1], [("assistant", [2])], mask=[0, 0]))
    with pytest.raises(InvalidArgument, match="row 1, column 'loss_mask'"):
        t.insert([good, bad])


# ---------------------------------------------------------------- extends

def turns_of(n: int) -> list[tuple[str, list[int]]]:
    out = []
    for k in range(n):
        out += [("assistant", [100 + k, 101 + k])] + ([("tool", [200 + k])] if k < n - 1 else [])
    return out


def test_rows_of_an_episode_extend_each_other_token_for_token():
    t = table("extends")
    assert t.schema.field("episode_id").type == pa.string()
    r = t.insert(rows(row("e1-t1", [1, 2], turns_of(1), episode="e1")))
    t.insert(rows(row("e1-t2", [1, 2], turns_of(2), episode="e1"), row("e1-t3", [1, 2], turns_of(3), episode="e1")))
    first = int(r.item_ids[0])
    bad = row("e1-t4", [1, 2], turns_of(3), episode="e1")
    bad["tokens"][5] = 999  # retokenised: one id differs
    with pytest.raises(InvalidArgument) as e:
        t.insert(rows(bad))
    assert str(e.value) == ("table 't': row 0, column 'tokens': token 5 is 999, but the episode's earlier row "
                            f"(item {first + 2}) has 101 there; a row must extend its episode's earlier rows "
                            "token for token (ingest check 'extends')")
    short = row("e1-t4", [1, 2], turns_of(1), episode="e1")
    with pytest.raises(InvalidArgument, match=r"row 0, column 'tokens': 4 tokens, fewer than the episode's earlier "
                                              r"row \(item \d+\), whose token 4 is 200"):
        t.insert(rows(short))
    within = [row("e2-t1", [1, 2], turns_of(1), episode="e2"), row("e2-t2", [1, 3], turns_of(2), episode="e2")]
    with pytest.raises(InvalidArgument, match=r"row 1, column 'tokens': token 1 is 3, but the episode's earlier row "
                                              r"\(row 0 of this insert\) has 2 there"):
        t.insert(rows(*within))
    assert len(t) == 3


def test_episodes_are_keyed_by_prompt_and_episode_id():
    t = table("extends")
    t.insert(rows(row("a", [1, 2], turns_of(2), episode="e", prompt_id="p1")))
    t.insert(rows(row("b", [7, 8], turns_of(1), episode="e", prompt_id="p2"),  # another episode
                  row("c", [7, 8], turns_of(1), prompt_id="p1")))              # no episode: unchecked
    assert len(t) == 3


def test_an_episode_is_compared_with_its_latest_row_while_it_is_in_the_table():
    t = Table(TableSpec("t", ingest_checks=["extends"], sampler=SamplerSpec("fifo"), max_times_sampled=1))
    t.insert(rows(row("t1", [1], turns_of(1), episode="e")))
    t.sample(1, timeout=0)  # the reference leaves the table
    t.insert(rows(row("t2", [5], turns_of(2), episode="e")))  # nothing to compare with
    with pytest.raises(InvalidArgument, match="token 0 is 6, but the episode's earlier row"):
        t.insert(rows(row("t3", [6], turns_of(3), episode="e")))


def test_a_hash_collision_never_refuses_a_row(monkeypatch):
    monkeypatch.setattr(ingest_checks, "_hash", lambda key: 7)  # every episode shares one hash
    t = table("extends")
    t.insert(rows(row("a", [1, 2], turns_of(2), episode="x")))
    t.insert(rows(row("b", [9], turns_of(1), episode="y")))
    assert len(t) == 2


def test_a_concurrent_insert_of_the_same_episode_is_refused_at_commit():
    t = table("extends")
    t.insert(rows(row("t1", [1], turns_of(1), episode="e")))
    a = t.prepare_insert(rows(row("t2a", [1], turns_of(2), episode="e")))
    t.insert(rows(row("t2b", [1], turns_of(2), episode="e")))  # commits between a's check and commit
    with pytest.raises(InvalidArgument, match="got a row .* from another insert while this one was checked"):
        t.commit_insert(a)
    t.abandon_insert(a)
    assert len(t) == 2


def test_references_that_cannot_be_read_leave_the_rows_unchecked(monkeypatch):
    t = table("extends")
    t.insert(rows(row("t1", [1], turns_of(1), episode="e")))
    gather = Table.read

    def down(self, snap, columns=None):
        if columns is not None and "loss_mask" in columns:  # the references' read
            raise Unavailable("the remote tier is down")
        return gather(self, snap, columns)
    monkeypatch.setattr(Table, "read", down)
    t.insert(rows(row("t2", [5], turns_of(2), episode="e")))
    assert t.stats()["ingest_unchecked"] == 1


def test_references_are_rebuilt_after_a_restart(tmp_path):
    store = Catalog(tmp_path / "d")
    t = store.create_table(TableSpec("t", ingest_checks=["extends", "group_prefix"]))
    ids = t.insert(rows(row("t1", [1, 2], turns_of(2), episode="e"),
                        row("g1", [4, 5], [("assistant", [6])], group="g"))).item_ids
    store.close()
    store = Catalog(tmp_path / "d")
    t = store.table("t")
    with pytest.raises(InvalidArgument, match=rf"the episode's earlier row \(item {ids[0]}\)"):
        t.insert(rows(row("t2", [1, 3], turns_of(3), episode="e")))
    with pytest.raises(InvalidArgument, match=rf"group 'g''s first member \(item {ids[1]}\)"):
        t.insert(rows(row("g2", [4, 6], [("assistant", [6])], group="g")))
    t.insert(rows(row("t2", [1, 2], turns_of(3), episode="e"), row("g2", [4, 5], [("assistant", [7, 8])], group="g")))
    store.close()


# ---------------------------------------------------------------- group_prefix

def test_group_members_share_their_prompt():
    t = table("group_prefix")
    t.insert(rows(row("m0", [1, 2, 3], [("assistant", [4])], group="g"),
                  row("m1", [1, 2, 3], [("assistant", [9, 9])], group="g")))
    with pytest.raises(InvalidArgument) as e:
        t.insert(rows(row("m2", [1, 2, 7], [("assistant", [4])], group="g")))
    assert str(e.value) == (
        "table 't': row 0, column 'tokens': the prompt (the tokens before the first loss_mask = 1) differs from "
        "that of group 'g''s first member (item 1) at token 2: 7 here, 3 there; the members of a group share "
        "their prompt (ingest check 'group_prefix')")
    with pytest.raises(InvalidArgument, match=r"at token 3: 8 here, the end of the prompt there"):
        t.insert(rows(row("m2", [1, 2, 3, 8], [("assistant", [4])], group="g")))
    with pytest.raises(InvalidArgument, match=r"group 'h''s first member \(row 1 of this insert\) at token 1: "
                                              r"the end of the prompt here, 6 there"):
        t.insert(rows(row("x", [1], [("assistant", [2])]),
                      row("h0", [5, 6], [("assistant", [2])], group="h"),
                      row("h1", [5], [("assistant", [2])], group="h")))
    t.insert(rows(row("h0", [5, 6], [("assistant", [2])], group="h"), row("other", [8], [("assistant", [2])])))
    assert len(t) == 4


def test_config_of_the_checks():
    with pytest.raises(InvalidArgument, match="ingest_checks must be one of"):
        TableSpec("t", ingest_checks=["extend"])
    with pytest.raises(InvalidArgument, match="trajectory tables"):
        TableSpec("t", kind="generic", schema=pa.schema([("x", pa.int32())]), key_column="x",
                  ingest_checks=["turns_mask"])
    a = TableSpec.from_dict({"name": "t", "ingest_checks": ["turns_mask", "extends", "turns_mask"]})
    assert a.ingest_checks == ("extends", "turns_mask") and TableSpec.from_dict(a.to_dict()) == a
    assert TableSpec("t", ingest_checks=[]) == TableSpec("t")
    with pytest.raises(InvalidArgument, match="'episode_id' is defined by the table's config"):
        Table(TableSpec("t", ingest_checks=["extends"], schema=pa.schema([("episode_id", pa.int64())])))
