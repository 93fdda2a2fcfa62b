"""Your own model, environment and reward: a Hugging Face model directory made offline
(tests/rl/hf_model.py: a BPE tokenizer trained here, a ChatML template with a tool role,
a tiny Qwen2) as the policy of the agent loop, the torch engine, the producer and the
trainers; an environment and rewards of tests/rl/user_code.py named by import path."""

from __future__ import annotations

import asyncio
import json
import random
import shutil
from pathlib import Path

import pyarrow as pa
import pytest
import torch
import transformers

from expstore.schema import TRAJECTORY_V1, conform, validate_trajectories
from expstore_rl import chat, demo, grpo, hf, launch, plugins, ppo, producer, tools, trainer, weights
from expstore_rl.agent import AgentConfig, rollout_group
from expstore_rl.batching import Rollouts
from expstore_rl.distributed import Dist
from expstore_rl.engines import Generation, ResubmitSession, SamplingParams, TorchEngine
from expstore_rl.envs import Calculator
from expstore_rl.model import token_logprobs
from expstore_rl.tokenizer import CharTokenizer

from .test_fsdp import FakeSource

torch.set_num_threads(1)
HERE = Path(__file__).resolve().parent
TASK = {"prompt_id": "calc-12*7", "expr": "12*7", "answer": "84"}
CALL = '<tool_call>{"name": "calc", "arguments": {"expression": "12*7"}}</tool_call>'


@pytest.fixture(scope="module")
def fmt(hf_model_dir):
    return chat.HFChat.from_pretrained(str(hf_model_dir))


@pytest.fixture
def user_code(monkeypatch):
    """tests/rl on the path, as a user's own package would be."""
    monkeypatch.syspath_prepend(str(HERE))


def render(fmt, messages, **kw) -> str:
    return fmt.tokenizer.apply_chat_template(messages, tokenize=False, **kw)


def valid(rows):
    table = conform(pa.Table.from_pylist(rows, schema=TRAJECTORY_V1), TRAJECTORY_V1, table="t")
    validate_trajectories(table, table="t")
    return rows


# -- the chat format ----------------------------------------------------------------------


def test_prompts_are_the_chat_templates_ids(fmt):
    tok = fmt.tokenizer
    assert fmt.prompt_ids("12*7=") == tok.apply_chat_template(
        [{"role": "user", "content": "12*7="}], tokenize=True, add_generation_prompt=True, return_dict=False)
    messages = [{"role": "system", "content": "Answer with a number."}, {"role": "user", "content": "1+2="}]
    ids = fmt.prompt_ids(messages)
    assert tok.decode(ids) == render(fmt, messages, add_generation_prompt=True)
    assert tok.decode(ids).endswith("<|im_start|>assistant\n")


def test_observations_are_the_templates_framing_around_text_encoded_once(fmt):
    tok, end = fmt.tokenizer, tok_id(fmt, "<|im_end|>")
    assert fmt.end_of_turn == end and fmt.stop_ids(tools=True) == (end,)
    ids = fmt.prompt_ids("12*7=") + fmt.encode(CALL) + [end]  # a turn that stopped at <|im_end|>
    ids += fmt.observation_ids("84", "tool", end)
    ids += fmt.encode("84") + [end]
    ids += fmt.observation_ids("are you sure", "user", end)
    conversation = [{"role": "user", "content": "12*7="}, {"role": "assistant", "content": CALL},
                    {"role": "tool", "content": "84"}, {"role": "assistant", "content": "84"},
                    {"role": "user", "content": "are you sure"}]
    assert tok.decode(ids) == render(fmt, conversation, add_generation_prompt=True)
    # a turn cut by max_tokens has not closed itself: the framing closes it
    cut = fmt.observation_ids("84", "tool", tok_id(fmt, "7"))
    assert cut[0] == end and cut[1:] == fmt.observation_ids("84", "tool", end)
    assert fmt.decode(fmt.encode("84") + [end]) == "84"  # special tokens left out for envs and rewards


def test_generation_stops_at_the_models_other_eos_ids_too(hf_model_dir, fmt, tmp_path):
    model_dir = tmp_path / "qwen-like"  # a generation config listing <|endoftext|> too, as Qwen2.5's does
    shutil.copytree(hf_model_dir, model_dir)
    eos = [tok_id(fmt, "<|im_end|>"), tok_id(fmt, "<|endoftext|>")]
    transformers.GenerationConfig(eos_token_id=eos).save_pretrained(model_dir)
    assert chat.HFChat.from_pretrained(str(model_dir)).stop_ids(tools=False) == tuple(sorted(eos))
    assert fmt.stop_ids(tools=False) == (eos[0],)


def tok_id(fmt, piece: str) -> int:
    ids = fmt.encode(piece)
    assert len(ids) == 1, piece
    return ids[0]


def test_a_tokenizer_without_a_template_or_a_tool_role_is_refused(hf_model_dir):
    tok = transformers.AutoTokenizer.from_pretrained(str(hf_model_dir))
    tok.chat_template = None
    with pytest.raises(ValueError, match="has no chat template"):
        chat.HFChat(tok, "tok")
    tok.chat_template = ("{%- for m in messages %}{%- if m['role'] == 'tool' %}{{ raise_exception('no tools') }}"
                         "{%- endif %}{{ m['role'] + ': ' + m['content'] + '<|im_end|>' }}{%- endfor %}"
                         "{%- if add_generation_prompt %}assistant: {% endif %}")
    fmt = chat.HFChat(tok, "tok")  # fine without tools
    assert fmt.end_of_turn == tok.convert_tokens_to_ids("<|im_end|>")
    with pytest.raises(ValueError, match="cannot render a 'tool' message"):
        fmt.observation_ids("84", "tool", None)


def test_tool_calls_in_either_form_are_parsed():
    assert tools.parse_call(CALL) == ("calc", "12*7")
    assert tools.parse_call('<tool_call>\n{"name": "python", "arguments": "print(1)"}\n</tool_call>') == \
        ("python", "print(1)")
    assert tools.parse_call('<tool_call>{"name": "f", "arguments": {"a": 1, "b": "x"}}</tool_call>') == \
        ("f", '{"a": 1, "b": "x"}')
    assert tools.parse_call("<tool>calc 1+2</tool> then <tool_call>{\"name\": \"x\"}</tool_call>") == ("calc", "1+2")
    assert tools.parse_call("<tool_call>not json</tool_call>") is None
    assert tools.parse_call('<tool_call>{"name": 3}</tool_call>') is None


# -- token-in, token-out with a real tokenizer ------------------------------------------


class Scripted:
    """An engine answering turn k with script[k] encoded once (logprob -0.5 each), the
    turn closed with the template's end of turn, as a chat model would."""

    def __init__(self, fmt, script: list[str]) -> None:
        self.fmt, self.script, self.version, self.calls, self.sessions = fmt, script, 0, 0, []

    def generate(self, prompts, params):
        ids = self.fmt.encode(self.script[self.calls]) + [self.fmt.end_of_turn]
        self.calls += 1
        return [Generation(ids, [-0.5] * len(ids), "stop") for _ in prompts]

    def session(self, prompts):
        self.sessions.append(ResubmitSession(self, prompts))
        return self.sessions[-1]

    def load_weights(self, path_or_state_dict, version):
        self.version = version


def test_multi_turn_tool_use_stores_exactly_the_engines_history(fmt):
    engine = Scripted(fmt, [CALL, "84"])
    rows = valid(asyncio.run(rollout_group(engine, [Calculator(), Calculator()], TASK, SamplingParams(max_tokens=40),
                                           fmt, group_id="g")))
    history = engine.sessions[0].tokens
    end = fmt.end_of_turn
    prompt, call, answer = fmt.prompt_ids("12*7="), fmt.encode(CALL) + [end], fmt.encode("84") + [end]
    obs = fmt.observation_ids("84", "tool", end)
    for i, r in enumerate(rows):
        assert r["tokens"] == history[i] == prompt + call + obs + answer
        assert r["loss_mask"] == [0] * len(prompt) + [1] * len(call) + [0] * len(obs) + [1] * len(answer)
        assert [t["role"] for t in r["turns"]] == ["user", "assistant", "tool", "assistant"]
        assert (r["turns"][2]["tool_name"], r["turns"][2]["tool_args"], r["turns"][2]["tool_status"]) == \
            ("calc", "12*7", "ok")
        assert r["reward"] == 1.0 and r["finish_reason"] == "stop"
        conversation = [{"role": "user", "content": "12*7="}, {"role": "assistant", "content": CALL},
                        {"role": "tool", "content": "84"}, {"role": "assistant", "content": "84"}]
        assert fmt.tokenizer.decode(r["tokens"]) + "\n" == render(fmt, conversation)
        assert set(json.loads(r["metadata"])["sampling"]["stop_token_ids"]) == {end}


def overfit(model_dir, fmt, task, steps=80):
    """The model, taught one task's solution (teacher forcing) so that greedy decoding
    reproduces it: a real model that calls the tool."""
    env = Calculator()
    ids, mask = demo.solution_ids(fmt, env.reset(task), env.solution(task), tools=True)
    b = 4
    examples = Rollouts(torch.tensor([ids] * b), torch.ones(b, len(ids)), torch.tensor([mask] * b).float(),
                        torch.zeros(b, len(ids)), torch.zeros(b), torch.arange(b), torch.zeros(b, dtype=torch.long))
    model = hf.load_model(str(model_dir))
    demo.supervised_warmup(model, examples, steps, lr=5e-3, batch=b)
    return model.eval()


def test_the_torch_engine_calls_the_tool_and_rows_equal_its_kv_session(hf_model_dir, fmt):
    task = Calculator().sample_task(random.Random(0))
    model = overfit(hf_model_dir, fmt, task)
    engine, sessions = TorchEngine(model), []
    open_session = engine.session
    engine.session = lambda prompts: sessions.append(open_session(prompts)) or sessions[-1]
    params = SamplingParams(max_tokens=24, top_k=1, seed=0)
    rows = valid(asyncio.run(rollout_group(engine, [Calculator(), Calculator()], task, params, fmt, group_id="g")))
    for i, r in enumerate(rows):
        assert [t["role"] for t in r["turns"]] == ["user", "assistant", "tool", "assistant"], fmt.decode(r["tokens"])
        assert r["tokens"] == sessions[0].tokens[i]  # the engine's history, token for token
        assert r["reward"] == 1.0 and r["finish_reason"] == "stop"
        t = torch.tensor([r["tokens"]])
        with torch.no_grad():
            lp = token_logprobs(model(t).logits, t, top_k=1)[0]
        mask = torch.tensor(r["loss_mask"], dtype=torch.bool)
        torch.testing.assert_close(torch.tensor(r["logprobs"])[mask], lp[mask], rtol=0, atol=1e-5)


# -- warm-up, environments and rewards by import path -----------------------------------


def test_warmup_examples_of_your_env_in_your_template(fmt, user_code):
    examples = demo.warmup_examples("user_code:Countdown", 3, seed=0, tok=fmt)
    end = fmt.end_of_turn
    for row, mask, n in zip(examples.tokens, examples.loss_mask, examples.lengths):
        ids, mask = row[:n].tolist(), mask[:n].tolist()
        text = fmt.tokenizer.decode(ids)
        start = int(text.split("count down from ", 1)[1].split("<", 1)[0])
        said = [str(start - k) for k in range(3)]
        conversation = [{"role": "user", "content": f"count down from {start}"}]
        for k, s in enumerate(said):
            conversation += [{"role": "assistant", "content": s}] + ([{"role": "user", "content": "next"}] if k < 2 else [])
        assert text + "\n" == render(fmt, conversation)
        generated = [t for t, m in zip(ids, mask) if m]
        assert generated == sum((fmt.encode(s) + [end] for s in said), [])  # the policy's turns, nothing else


def test_the_toy_warmup_examples_are_unchanged():
    tok = CharTokenizer()
    examples = demo.warmup_examples("calculator", 2, seed=3)
    env, rng = Calculator(), random.Random(3)
    for row, mask, n in zip(examples.tokens, examples.loss_mask, examples.lengths):
        task = env.sample_task(rng)
        prompt, answer = [tok.bos_id] + tok.encode(env.reset(task)), tok.encode(env.solution(task))
        assert row[:n].tolist() == prompt + answer
        obs = tok.encode(f"<obs>{task['answer']}</obs>")
        call = tok.encode(f"<tool>calc {task['expr']}</tool>")
        assert mask[:n].tolist() == [0] * len(prompt) + [1] * len(call) + [0] * len(obs) + \
            [1] * (len(answer) - len(call) - len(obs))


def test_environments_and_rewards_by_import_path(user_code):
    import user_code as code

    assert plugins.env_factory("user_code:Countdown") is code.Countdown
    assert plugins.env_factory("calculator") is Calculator
    assert plugins.reward("user_code:digits") is code.digits
    from expstore_rl import rewards
    assert plugins.reward("exact_match") is rewards.exact_match
    for spec, msg in [("nosuch_module_xyz:Env", "cannot import"), ("user_code:Nope", "has no attribute"),
                      ("user_code:NotAnEnv", "not an environment class"), ("countdown", "not a built-in"),
                      ("user_code", "not a built-in")]:
        with pytest.raises(ValueError, match=msg):
            plugins.env_factory(spec)
    for spec, msg in [("no_such_reward", "not a reward"), ("user_code:Countdown.turns", "not callable")]:
        with pytest.raises(ValueError, match=msg):
            plugins.reward(spec)


def test_the_producer_cli_takes_your_model_env_and_reward(hf_model_dir, user_code, capsys, tmp_path):
    p, _ = producer.from_args(["--table", "t", "--model", str(hf_model_dir), "--env", "user_code:Countdown",
                               "--reward", "user_code:digits"])
    assert isinstance(p.tok, chat.HFChat) and isinstance(p.engine.model, transformers.Qwen2ForCausalLM)
    assert p.engine.version == 0 and p.env_factory().name == "countdown" and p.reward_fn.__name__ == "digits"
    no_tools = tmp_path / "no-tools"  # a template that renders no tool role: refused for calculator, fine for reverse
    shutil.copytree(hf_model_dir, no_tools)
    (no_tools / "chat_template.jinja").write_text(
        "{%- for m in messages %}{%- if m['role'] == 'tool' %}{{ raise_exception('no tool role') }}{%- endif %}"
        "{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{%- endfor %}"
        "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{%- endif %}")
    producer.from_args(["--table", "t", "--model", str(no_tools), "--env", "reverse"])
    for argv, msg in [(["--env", "user_code:Nope"], "has no attribute"), (["--model", "/nonexistent"], "not a directory"),
                      (["--model", str(no_tools), "--env", "calculator"], "cannot render a 'tool' message")]:
        with pytest.raises(SystemExit):
            producer.from_args(["--table", "t", *argv])
        assert msg in capsys.readouterr().err


# -- the trainers -------------------------------------------------------------------------


def test_ppo_trains_your_model_and_publishes_whole_model_directories(hf_model_dir, tmp_path):
    cfg = ppo.PPOConfig(model=str(hf_model_dir), weights_uri=f"file://{tmp_path}/weights", out=str(tmp_path / "run"),
                        steps=1, batch_size=16, kl_coef=0.1, checkpoint_every=0)
    ppo.train(cfg, FakeSource())
    v0, v1 = (Path(weights.local_path(cfg.weights_uri, v)) for v in (0, 1))
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json"):
        assert (v1 / name).read_bytes() == (hf_model_dir / name).read_bytes(), name
    model = transformers.AutoModelForCausalLM.from_pretrained(str(v1))
    assert isinstance(model, transformers.Qwen2ForCausalLM)
    base = hf.load_model(str(hf_model_dir))
    moved = (model.model.embed_tokens.weight - base.model.embed_tokens.weight).abs().max()
    assert moved > 0 and torch.equal(hf.load_model(str(v0)).model.norm.weight, base.model.norm.weight)
    assert chat.HFChat.from_pretrained(str(v1)).prompt_ids("1+2=") == chat.HFChat.from_pretrained(
        str(hf_model_dir)).prompt_ids("1+2=")
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert rows[0]["ppo/value_mean"] == 0 and rows[0]["losses/value"] > 0


def recording(source: trainer.StoreSource) -> list:
    """The raw batches ``source`` samples (their rows keep token_policy_version)."""
    seen, sample = [], source.client.sample
    source.client.sample = lambda *a, **k: seen.append(sample(*a, **k)) or seen[-1]
    return seen


def assert_behaviour_logprobs_recomputed(rows: list[dict], uri: str, cfg: trainer.TrainConfig) -> set[int]:
    """Every generated token before a row's first weight swap has the logprob that its
    version, loaded from the published directory, gives it (a later token was generated
    on a KV cache of the older version). Returns the versions seen."""
    models, seen = {}, set()
    for r in rows:
        versions = r["token_policy_version"] or [r["policy_version"]] * len(r["tokens"])
        v = r["policy_version"]
        seen.add(v)
        model = models.setdefault(v, hf.load_model(weights.local_path(uri, v)))
        t = torch.tensor([r["tokens"]])
        with torch.no_grad():
            lp = token_logprobs(model(t).logits, t, cfg.temperature, cfg.top_k, cfg.top_p)[0]
        swap = next((i for i, u in enumerate(versions) if u != v), len(versions))
        mask = torch.tensor(r["loss_mask"][:swap], dtype=torch.bool)
        assert mask.any()
        torch.testing.assert_close(torch.tensor(r["logprobs"][:swap])[mask], lp[:swap][mask], rtol=0, atol=1e-4)
    return seen


def test_producer_and_grpo_on_your_model_env_and_reward(hf_model_dir, shared_server, client, table_name, tmp_path,
                                                        user_code):
    cfg = grpo.GRPOConfig(model=str(hf_model_dir), target=shared_server.address, table=table_name,
                          weights_uri=f"file://{tmp_path}/weights", out=str(tmp_path / "run"), steps=1, group_size=2,
                          groups_per_step=2, checkpoint_every=0, sample_timeout=60, temperature=0.9, top_k=50,
                          sample_order="fifo")
    flags = launch.build_parser().parse_args(["--env", "user_code:Countdown", "--reward", "user_code:digits",
                                              "--max-tokens", "5", "--max-turns", "3"])
    launch.prepare(flags, cfg)  # the table, and v0 from --model with its tokenizer files
    assert client.describe(table_name).config["metadata"] == {"tokenizer": f"hf:{hf_model_dir}"}  # for the console
    source = trainer.StoreSource(cfg, Dist(), 4, 2)
    batches = recording(source)
    for steps in (1, 2):  # each step trains on 2 groups the producer made with the newest version
        made, _ = producer.from_args(launch.producer_argv(flags, cfg, 0) + ["--num-groups", "2", "--no-partials"])
        assert made.run(2)["producer/trajectories"] == 4 and made.engine.version == steps - 1
        cfg.steps = steps
        grpo.train(cfg, source)  # step 2 resumes from step 1's checkpoint
    assert weights.versions(cfg.weights_uri) == [0, 1, 2]
    rows = [r for b in batches for r in b.data.to_pylist()]
    assert len(rows) == 8 and {r["task"] for r in rows} == {"countdown"}
    assert all(set(dict(r["reward_components"])) == {"env", "digits"} for r in rows)
    assert all([t["role"] for t in r["turns"]] == ["user"] + ["assistant", "env"] * 2 + ["assistant"] for r in rows)
    assert assert_behaviour_logprobs_recomputed(rows, cfg.weights_uri, cfg) == {0, 1}
    metrics = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    for m in metrics:  # the trainer's own recomputation: the behaviour policy is the proximal one
        assert m["staleness/max"] == 0 and m["offpolicy/behaviour_kl"] < 1e-8
        assert m["offpolicy/is_weight_max"] == pytest.approx(1.0, abs=1e-3)


def test_the_launcher_refuses_code_it_cannot_import_before_anything_starts(shared_server, client, table_name,
                                                                         tmp_path, user_code, capsys):
    flags = ["--target", shared_server.address, "--table", table_name, "--weights-uri", f"file://{tmp_path}/w"]
    for argv, msg in [(["--env", "user_code:Nope"], "has no attribute 'Nope'"),
                      (["--reward", "no_such_module_xyz:f"], "cannot import 'no_such_module_xyz'"),
                      (["--", "--model", str(tmp_path)], "no config.json")]:
        cut = argv.index("--") if "--" in argv else len(argv)
        with pytest.raises(SystemExit, match=msg):
            launch.run(["--producers", "1", *argv[:cut], "--", *flags, *argv[cut + 1:]])
    assert table_name not in {t.name for t in client.list_tables()} and weights.versions(f"file://{tmp_path}/w") == []
