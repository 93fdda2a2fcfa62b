import importlib
import json

import pytest

from expstore_rl import rewards
from expstore_rl.rewards import RewardResult
from expstore_rl.tokenizer import CharTokenizer

TOK = CharTokenizer()


def row(prompt: str, generated: str, answer: str, turns=None) -> dict:
    """A stored row as the store returns it: no text, the answer in metadata."""
    p, g = TOK.encode(prompt), TOK.encode(generated)
    return {"tokens": p + g, "loss_mask": [0] * len(p) + [1] * len(g), "turns": turns or [],
            "metadata": json.dumps({"answer": answer})}


def test_exact_match_decodes_a_stored_row():
    assert rewards.exact_match(row("<bos>123=", "321<eos>", "321")) == RewardResult(1.0, {"exact_match": 1.0})
    assert rewards.exact_match(row("<bos>123=", "32<eos>", "321")).value == 0.0
    assert rewards.exact_match({"text": "321", "answer": "321"}).value == 1.0  # cut off before <eos>


def test_a_row_the_rewards_cannot_score_is_an_error_that_says_why():
    # token ids of another tokenizer (expstore.synthetic's rows: ids up to 50,000)
    foreign = {"tokens": [1, 20000, 4000, 7], "loss_mask": [0, 1, 1, 1], "metadata": json.dumps({"answer": "1"})}
    for fn in (rewards.exact_match, rewards.numeric_answer, rewards.eos_format):
        with pytest.raises(ValueError, match="token id 20000 is not in the CharTokenizer vocabulary"):
            fn(foreign)
    with pytest.raises(ValueError, match="no reference answer"):
        rewards.exact_match({"text": "1<eos>", "metadata": None})
    with pytest.raises(ValueError, match="no reference answer"):
        rewards.numeric_answer({"text": "1<eos>", "metadata": json.dumps({"task": "x"})})


def test_numeric_answer_after_the_last_observation():
    s = {"text": "<tool>calc 6*7</tool><obs>42</obs>it is 42<eos>", "answer": "42"}
    assert rewards.numeric_answer(s).value == 1.0
    assert rewards.numeric_answer({"text": "<tool>calc 6*7</tool><obs>42</obs><eos>", "answer": "42"}).value == 0.0
    assert rewards.numeric_answer({"text": "14/4<eos>", "answer": "7/2"}).value == 1.0
    assert rewards.numeric_answer({"text": "no number<eos>", "answer": "1"}).value == 0.0


def test_format_rewards():
    assert rewards.eos_format({"text": "<tool>calc 1+2</tool><obs>3</obs>3<eos>"}).value == 1.0
    assert rewards.eos_format({"text": "3"}).value == 0.0
    digits = rewards.format_regex(r"\d+<eos>", "digits")
    assert digits({"text": "12<eos>"}) == RewardResult(1.0, {"digits": 1.0})


def test_code_unit_tests_run_in_the_sandbox():
    tests = ["assert f(1) == 2", "assert f(2) == 3", "assert f(0) == 99"]
    assert rewards.code_unit_tests({"text": "def f(x):\n    return x + 1<eos>", "tests": tests}).value == 2 / 3
    assert rewards.code_unit_tests({"text": "this is not python", "tests": tests}).value == 0.0
    hang = rewards.code_unit_tests({"text": "while True: pass", "tests": tests})
    assert hang.value == 0.0


def test_penalties_and_combine():
    r = row("<bos>1=", "1<eos>", "1", turns=[{"role": "tool", "start": 0, "end": 1, "tool_name": "calc",
                                              "latency_ms": 500.0}])
    assert rewards.length_penalty(r).value == -2.0
    assert rewards.cost_penalty(r).value == -1.5
    total = rewards.combine(exact_match=1.0, length_penalty=0.1, mine=(lambda s: RewardResult(2.0), 0.5))(r)
    assert total.value == 1.0 - 0.2 + 1.0
    assert total.components == {"exact_match": 1.0, "length_penalty": -0.2, "mine": 1.0}


def test_step_and_trajectory_level():
    p, a1, o, a2 = (TOK.encode(t) for t in ("<bos>2=", "<tool>calc 2</tool>", "<obs>2</obs>", "2<eos>"))
    tokens = p + a1 + o + a2
    bounds = [0, len(p), len(p + a1), len(p + a1 + o), len(tokens)]
    turns = [{"role": role, "start": s, "end": e} for role, s, e in
             zip(["user", "assistant", "tool", "assistant"], bounds, bounds[1:])]
    sample = {"tokens": tokens, "loss_mask": [0] * len(tokens), "turns": turns, "answer": "2"}
    steps = rewards.step_level(rewards.exact_match)(sample)
    assert steps == [0.0, 0.0, 0.0, 1.0]
    assert rewards.sum_step_rewards({"step_rewards": steps}).value == 1.0


def test_importable_by_module_colon_function_as_the_audit_cli_does():
    for spec in ("expstore_rl.rewards:exact_match", "expstore_rl.rewards:reverse_reward",
                 "expstore_rl.rewards:calculator_reward", "expstore_rl.rewards:eos_format"):
        module, func = spec.split(":")
        fn = getattr(importlib.import_module(module), func)
        assert isinstance(fn(row("<bos>12=", "21<eos>", "21")), RewardResult)
