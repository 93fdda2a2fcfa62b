"""Partial-rollout scheduling: producers go completed -> partial -> fresh, partial groups
oldest policy version first; every token keeps the version that generated it; one row
spans at most ``max_version_span`` versions (past it, it restarts from its prompt); and
a producer killed mid-continuation loses nothing."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from expstore_rl.agent import AgentConfig, continuation_id, continue_group, rollout_group
from expstore_rl.engines import SamplingParams, TorchEngine
from expstore_rl.envs import ReverseDigits
from expstore_rl.model import ModelConfig, build_model
from expstore_rl.partials import Partials
from expstore_rl.producer import Producer, ProducerConfig
from expstore_rl.tokenizer import CharTokenizer

from .test_agent import Scripted, valid

torch.set_num_threads(1)
TOK = CharTokenizer()
PARAMS = SamplingParams(max_tokens=6, temperature=1.0)
TASK = {"prompt_id": "reverse-123", "digits": "123", "answer": "321"}


class Answers(ReverseDigits):
    """Ends after ``n`` answers (reward 1 with the last); the count lives in the
    environment, so a row that restarts must have it reset."""

    n = 3

    def reset(self, task):
        self.answers = 0
        return super().reset(task)

    def step(self, action_text):
        self.answers += 1
        return ("again", 0.0, False) if self.answers < self.n else ("", 1.0, True)


class TwoAnswers(Answers):
    n = 2


def versions_by_turn(row, version_of_turn):
    """The per-token versions a row must carry: every token of turn k (the prompt, an
    answer, the observation after it) has the version its turn ran under."""
    out = []
    for k, turn in enumerate(row["turns"]):
        out += [version_of_turn(k)] * (turn["end"] - turn["start"])
    return out


def test_every_token_keeps_the_version_it_was_generated_under_across_weight_updates():
    engine = Scripted(["1<eos>", "2<eos>", "3<eos>"])

    async def new_version_each_turn():
        engine.version = engine.calls  # turn k runs under version k

    row = valid(asyncio.run(rollout_group(engine, [Answers()], TASK, PARAMS, TOK, group_id="g",
                                          before_generate=new_version_each_turn)))[0]
    assert TOK.decode(row["tokens"]) == "<bos>123=1<eos>again2<eos>again3<eos>"
    assert [t["role"] for t in row["turns"]] == ["user", "assistant", "env", "assistant", "env", "assistant"]
    # prompt (v0), answer 0 and its observation (v0), answer 1 and its observation (v1), answer 2 (v2)
    assert row["token_policy_version"] == versions_by_turn(row, lambda k: max(0, (k - 1) // 2))
    assert row["policy_version"] == 0 and "restarts" not in json.loads(row["metadata"])


def test_a_row_past_its_version_span_restarts_from_its_prompt_under_the_version_now():
    engine = Scripted(["1<eos>", "2<eos>", "3<eos>", "4<eos>", "5<eos>"])

    async def new_version_each_turn():
        engine.version = min(engine.calls, 2)  # versions 0, 1, then 2 for good

    row = valid(asyncio.run(rollout_group(engine, [Answers()], TASK, PARAMS, TOK, group_id="g",
                                          config=AgentConfig(max_version_span=2),
                                          before_generate=new_version_each_turn)))[0]
    # turns under v0 and v1 were played; v2 would make three versions: the row started over
    # under v2, its environment reset (three more answers were needed), nothing of v0/v1 kept
    assert TOK.decode(row["tokens"]) == "<bos>123=3<eos>again4<eos>again5<eos>"
    assert row["reward"] == 1.0 and row["finish_reason"] == "stop"
    assert row["policy_version"] == 2 and row["token_policy_version"] is None  # one version: all v2
    dropped = len(TOK.encode("1<eos>again2<eos>again"))
    assert json.loads(row["metadata"])["restarts"] == [
        {"dropped_tokens": dropped, "versions": [0, 1], "restarted_under": 2}]


def aborted_group(version: int, group_id: str, env=ReverseDigits, task=TASK) -> list[dict]:
    """A group of two interrupted under ``version`` (after ``env`` answered once for
    multi-turn ones, else before generating anything)."""
    engine = Scripted(["1<eos>"] * 4)
    engine.version = version
    envs = [env(), env()]
    stop = (lambda: engine.calls >= 1) if env is not ReverseDigits else (lambda: True)
    rows = valid(asyncio.run(rollout_group(engine, envs, task, PARAMS, TOK, group_id=group_id, interrupt=stop)))
    assert {r["finish_reason"] for r in rows} == {"aborted"}
    return rows


@pytest.mark.parametrize("version, restarted", [(1, False), (5, True)])
def test_a_continuation_within_the_span_goes_on_and_one_past_it_restarts(version, restarted):
    rows = aborted_group(0, "g", env=TwoAnswers)  # answered "1" under v0, then stopped
    engine = Scripted(["2<eos>", "3<eos>"])
    engine.version = version
    out = valid(asyncio.run(continue_group(engine, TwoAnswers, rows, PARAMS, TOK,
                                           config=AgentConfig(max_version_span=2))))
    for row, aborted in zip(out, rows):
        meta = json.loads(row["metadata"])
        assert row["traj_id"] == continuation_id(aborted["traj_id"]) and meta["continues"] == aborted["traj_id"]
        assert row["reward"] == 1.0 and row["finish_reason"] == "stop"
        if restarted:  # v0..v5 is six versions: started over under v5 (two answers again)
            assert TOK.decode(row["tokens"]) == "<bos>123=2<eos>again3<eos>"
            assert row["policy_version"] == version and row["token_policy_version"] is None
            assert meta["restarts"] == [{"dropped_tokens": len(TOK.encode("1<eos>again")), "versions": [0, 0],
                                         "restarted_under": version}]
        else:  # v0..v1: the aborted prefix kept, its versions too
            assert TOK.decode(row["tokens"]) == "<bos>123=1<eos>again2<eos>"
            assert row["tokens"][:len(aborted["tokens"])] == aborted["tokens"]
            assert row["token_policy_version"] == versions_by_turn(row, lambda k: 0 if k < 3 else 1)
            assert row["policy_version"] == 0 and "restarts" not in meta


def test_a_producer_goes_completed_then_partial_oldest_version_first_then_fresh(client, shared_server, table_name):
    client.create_table(table_name, sampler="fifo")
    parts = Partials.open(shared_server.address, None, table_name, "producers")
    try:
        done_before = aborted_group(0, "gC")  # its continuation was stored; then its producer died
        for rows in (done_before, aborted_group(2, "g2"), aborted_group(0, "g0"), aborted_group(1, "g1")):
            parts.put(rows)  # the partial table's order: gC, g2, g0, g1
        dead = Scripted(["9<eos>"])
        dead.version = 3
        client.insert(table_name, asyncio.run(continue_group(dead, ReverseDigits, done_before, PARAMS, TOK)))
    finally:
        parts.close()

    engine = Scripted(["9<eos>"] * 10)
    engine.version = 3
    producer = Producer(shared_server.address, table_name, engine, ReverseDigits, group_size=2, params=PARAMS,
                        config=ProducerConfig(concurrency=1, partial_claim=8))
    stats = producer.run(num_groups=1)
    assert stats["producer/completed_partial_groups"] == 1 and stats["producer/continued_groups"] == 3
    assert engine.calls == 4  # g0, g1, g2 and one fresh group: gC was not generated again
    rows = client.get(table_name, list(range(1, 11))).data.to_pylist()
    groups = [r["group_id"] for r in rows]
    assert groups[:8] == ["gC", "gC", "g0", "g0", "g1", "g1", "g2", "g2"]  # concurrency 1: the store's order is the run's
    assert len(set(groups[8:])) == 1 and groups[8] not in groups[:8]  # then the fresh group
    partial = table_name + "_partial"
    assert client.stats(partial)[partial]["group.producers.acked"] == 8  # all four groups done


def continued(client, table: str) -> list[dict]:
    n = client.describe(table).num_items
    return client.get(table, list(range(1, n + 1))).data.to_pylist() if n else []


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_producer_killed_while_continuing_loses_nothing(client, shared_server, table_name):
    client.create_table(table_name, sampler="fifo")
    parts = Partials.open(shared_server.address, None, table_name, "producers")
    aborted = []
    try:
        for g in range(6):
            task = {"prompt_id": f"reverse-{g}23", "digits": f"{g}23", "answer": f"32{g}"}
            aborted += aborted_group(0, f"g{g}", task=task)
            parts.put(aborted[-2:])
    finally:
        parts.close()

    here = Path(__file__).resolve().parent  # slow_env.py: each reset takes 0.5 s
    env = {**os.environ, "PYTHONPATH": f"{here}{os.pathsep}{os.environ.get('PYTHONPATH', '')}", "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "expstore_rl.producer", "--server", shared_server.address,
                             "--table", table_name, "--env", "slow_env:SlowReverse", "--group-size", "2",
                             "--num-groups", "0", "--concurrency", "1", "--max-tokens", "4", "--log-every", "0",
                             "--partial-visibility-s", "1"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env)
    try:
        deadline = time.monotonic() + 120
        while client.describe(table_name).num_items < 2:
            assert proc.poll() is None, proc.stderr.read()
            assert time.monotonic() < deadline, "the producer continued nothing"
            time.sleep(0.05)
        proc.send_signal(signal.SIGKILL)  # mid-run: one group or more still claimed or waiting
        proc.wait()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert client.describe(table_name).num_items < len(aborted)

    restarted = Producer(shared_server.address, table_name, TorchEngine(build_model(ModelConfig(), seed=0)),
                         ReverseDigits, group_size=2, params=PARAMS,
                         config=ProducerConfig(partial_visibility_s=1.0))
    deadline = time.monotonic() + 120
    while len(continued(client, table_name)) < len(aborted):  # what the killed one held comes back after 1 s
        assert time.monotonic() < deadline, "a partial group was lost"
        restarted.run(num_groups=0)
        time.sleep(0.2)
    rows = continued(client, table_name)
    assert sorted(json.loads(r["metadata"])["continues"] for r in rows) == sorted(
        r["traj_id"] for r in aborted)  # each aborted row continued exactly once
    assert sorted(r["traj_id"] for r in rows) == sorted(continuation_id(r["traj_id"]) for r in aborted)
    assert all(r["finish_reason"] != "aborted" for r in rows)
    partial = table_name + "_partial"
    assert client.stats(partial)[partial]["group.producers.acked"] == len(aborted)
