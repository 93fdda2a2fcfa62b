"""The agent loop: token-in/token-out rows, tool observations masked, failures recorded."""

import asyncio
import json
import random
import threading

import pyarrow as pa
import torch

from expstore.schema import TRAJECTORY_V1, conform, validate_trajectories
from expstore_rl.agent import AgentConfig, rollout_group
from expstore_rl.engines import Generation, ResubmitSession, SamplingParams, TorchEngine
from expstore_rl.envs import Calculator, ReverseDigits
from expstore_rl.model import ModelConfig, build_model
from expstore_rl.tokenizer import CharTokenizer

torch.set_num_threads(1)
TOK = CharTokenizer()
TASK = {"prompt_id": "calc-12*7", "expr": "12*7", "answer": "84"}


class Scripted:
    """An engine that answers turn k of every row with script[k] (logprob -0.5 each)."""

    def __init__(self, script: list[str]) -> None:
        self.script, self.version, self.calls = script, 0, 0

    def generate(self, prompts, params):
        ids = TOK.encode(self.script[self.calls])
        self.calls += 1
        return [Generation(ids, [-0.5] * len(ids), "stop" if ids[-1] in params.stop_token_ids else "length")
                for _ in prompts]

    def session(self, prompts):
        return ResubmitSession(self, prompts)

    def load_weights(self, path_or_state_dict, version):
        self.version = version


def valid(rows):
    table = conform(pa.Table.from_pylist(rows, schema=TRAJECTORY_V1), TRAJECTORY_V1, table="t")
    validate_trajectories(table, table="t")
    return rows


def rollout(engine, envs, task=TASK, params=SamplingParams(max_tokens=20), **kw):
    return valid(asyncio.run(rollout_group(engine, envs, task, params, TOK, group_id="g1", **kw)))


def test_tito_tool_call_observation_masked_and_answer_scored():
    call, answer = "<tool>calc 12*7</tool>", "84<eos>"
    rows = rollout(Scripted([call, answer]), [Calculator(), Calculator()])
    prompt, c, obs, a = TOK.encode("<bos>12*7="), TOK.encode(call), TOK.encode("<obs>84</obs>"), TOK.encode(answer)
    for r in rows:
        assert r["tokens"] == prompt + c + obs + a  # exactly engine output + observation ids
        assert r["loss_mask"] == [0] * len(prompt) + [1] * len(c) + [0] * len(obs) + [1] * len(a)
        assert r["logprobs"] == [0.0] * len(prompt) + [-0.5] * len(c) + [0.0] * len(obs) + [-0.5] * len(a)
        assert [t["role"] for t in r["turns"]] == ["user", "assistant", "tool", "assistant"]
        tool = r["turns"][2]
        assert (tool["start"], tool["end"]) == (len(prompt + c), len(prompt + c + obs))
        assert (tool["tool_name"], tool["tool_args"], tool["tool_status"], tool["tool_result"].strip()) == \
            ("calc", "12*7", "ok", "84")
        assert tool["latency_ms"] > 0
        assert r["step_rewards"] == [0.0, 0.0, 0.0, 1.0] and r["reward"] == 1.0
        assert (r["finish_reason"], r["group_id"], r["group_size"], r["task"]) == ("stop", "g1", 2, "calculator")
        assert r["policy_version"] == 0 and r["token_policy_version"] is None
        meta = json.loads(r["metadata"])
        assert meta["answer"] == "84" and meta["engine"] == "torch"
        assert set(meta["sampling"]["stop_token_ids"]) == {TOK.eos_id, TOK.tool_end_id}
    assert rows[0]["traj_id"] != rows[1]["traj_id"]


def test_tito_with_the_torch_engine():
    engine = TorchEngine(build_model(ModelConfig(), seed=0))
    produced = []
    session = engine.session

    def recording_session(prompts):
        s = session(prompts)
        generate = s.generate
        s.generate = lambda params, rows, interrupt=None: produced.append(generate(params, rows)) or produced[-1]
        return s

    engine.session = recording_session
    task = ReverseDigits().sample_task(random.Random(1))
    rows = rollout(engine, [ReverseDigits() for _ in range(4)], task, SamplingParams(max_tokens=4, seed=0))
    prompt = [TOK.bos_id] + TOK.encode(task["digits"] + "=")
    for r, g in zip(rows, produced[0]):
        assert r["tokens"] == prompt + g.tokens and r["logprobs"][len(prompt):] == g.logprobs
        assert r["finish_reason"] == g.finish_reason


def test_failed_tools_become_observations():
    rows = rollout(Scripted(["<tool>calc 1/0</tool>", "<tool>python 1</tool>", "0<eos>"]), [Calculator()])
    r = rows[0]
    tools = [t for t in r["turns"] if t["role"] == "tool"]
    assert [t["tool_status"] for t in tools] == ["error", "denied"]
    assert TOK.decode(r["tokens"]).count("<obs>error</obs>") == 1 and "<obs>denied</obs>" in TOK.decode(r["tokens"])
    assert r["finish_reason"] == "stop" and r["reward"] == 0.0


def test_max_turns():
    rows = rollout(Scripted(["<tool>calc 1</tool>"] * 2), [Calculator()], config=AgentConfig(max_turns=2))
    assert rows[0]["finish_reason"] == "max_turns"


class Crashing(ReverseDigits):
    def step(self, action_text):
        raise RuntimeError("env bug")


class CrashingReset(ReverseDigits):
    def reset(self, task):
        raise RuntimeError("env bug")


def test_a_failing_env_records_its_reason_and_the_group_stays_complete():
    task = {"prompt_id": "reverse-123", "digits": "123", "answer": "321"}
    rows = rollout(Scripted(["321<eos>"]), [ReverseDigits(), Crashing(), CrashingReset()], task)
    assert [r["finish_reason"] for r in rows] == ["stop", "env_crash", "env_crash"]
    assert [r["reward"] for r in rows] == [1.0, 0.0, 0.0]
    assert rows[2]["tokens"] == [TOK.bos_id] and rows[2]["loss_mask"] == [0]
    assert {r["group_size"] for r in rows} == {3}


def test_a_hanging_env_times_out():
    release = threading.Event()

    class Hanging(ReverseDigits):
        def step(self, action_text):
            release.wait()
            return "", 1.0, True

    async def main():
        try:
            return await rollout_group(Scripted(["321<eos>"]), [Hanging(), ReverseDigits()],
                                       {"prompt_id": "r", "digits": "123", "answer": "321"},
                                       SamplingParams(max_tokens=4), TOK, config=AgentConfig(env_timeout=0.2))
        finally:
            release.set()

    rows = valid(asyncio.run(main()))
    assert [r["finish_reason"] for r in rows] == ["timeout", "stop"]


def test_weights_changing_mid_rollout_give_per_token_versions():
    engine = Scripted(["<tool>calc 12*7</tool>", "84<eos>"])

    async def newer_weights():
        if engine.calls == 1:
            engine.load_weights(None, 1)

    r = rollout(engine, [Calculator()], before_generate=newer_weights)[0]
    assert r["policy_version"] == 0
    tpv, mask = r["token_policy_version"], r["loss_mask"]
    first, second = (r["turns"][i] for i in (1, 3))
    assert set(tpv[first["start"]:first["end"]]) == {0} and set(tpv[second["start"]:second["end"]]) == {1}
    assert len(tpv) == len(mask)
