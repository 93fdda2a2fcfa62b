"""Reward functions over one trajectory row.

Signature of every reward: ``reward(sample: dict) -> RewardResult``, a plain top-level
function, so that ``expstore audit --reward expstore_rl.rewards:exact_match`` can import
it and recompute rewards of stored rows. ``sample`` holds the trajectory columns as Python
values (tokens, loss_mask, turns, metadata, ...) and optionally:

- "text": the policy's generated text (else decoded from the tokens where loss_mask = 1
  with CharTokenizer);
- "answer": the reference answer (else ``metadata["answer"]``, which producers record);
- "tests": unit tests for ``code_unit_tests`` (else ``metadata["tests"]``).

Base rewards return raw values (1/0, a count); ``combine`` weights and sums them and
records each weighted part under its name in ``components`` (stored as the row's
``reward_components``). ``step_level`` turns a reward into one value per turn (the
``step_rewards`` column); ``sum_step_rewards`` is the trajectory reward of those.

>>> combine(exact_match=1.0, length_penalty=0.01)({"text": "321<eos>", "answer": "321", ...})
RewardResult(value=0.96, components={'exact_match': 1.0, 'length_penalty': -0.04})
"""

from __future__ import annotations

import json
import re
import sys
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Callable

from . import sandbox
from .tokenizer import CharTokenizer

EOS = "<eos>"
_TOK = CharTokenizer()
_NUMBER = re.compile(r"-?\d+(?:/\d+)?")


@dataclass(frozen=True)
class RewardResult:
    value: float
    components: dict[str, float] = field(default_factory=dict)


Reward = Callable[[dict], RewardResult]


def _metadata(sample: dict) -> dict:
    meta = sample.get("metadata")
    return json.loads(meta) if isinstance(meta, str) and meta else dict(meta or {})


def text(sample: dict) -> str:
    """The generated text: ``sample["text"]`` or the decoded tokens with loss_mask 1.
    Tokens that are not CharTokenizer ids raise a ValueError saying so (an audit records
    it as that row's error)."""
    if "text" in sample:
        return sample["text"]
    try:
        return _TOK.decode(t for t, m in zip(sample["tokens"], sample["loss_mask"]) if m)
    except ValueError as e:
        raise ValueError(f"cannot decode the generated tokens: {e}; these rewards score rows tokenized "
                         "with expstore_rl's CharTokenizer (or given a 'text')") from None


def final_answer(sample: dict) -> str:
    """The text after the last observation, up to the first <eos>, stripped."""
    t = text(sample).rsplit("</obs>", 1)[-1]
    return t.split(EOS, 1)[0].strip()


def answer(sample: dict) -> str:
    """The reference answer: ``sample["answer"]``, else ``metadata["answer"]``; a
    ValueError when there is neither."""
    if "answer" in sample:
        return str(sample["answer"])
    meta = _metadata(sample)
    if meta.get("answer") is None:
        raise ValueError("no reference answer: the row has no 'answer' and its metadata none either")
    return str(meta["answer"])


def exact_match(sample: dict) -> RewardResult:
    """1.0 when the final answer equals the reference exactly."""
    v = float(final_answer(sample) == answer(sample))
    return RewardResult(v, {"exact_match": v})


def numeric_answer(sample: dict) -> RewardResult:
    """1.0 when the last number (integer or fraction a/b) of the final answer equals the
    reference numerically."""
    found, reference = _NUMBER.findall(final_answer(sample)), answer(sample)
    try:
        v = float(bool(found) and Fraction(found[-1]) == Fraction(reference))
    except (ValueError, ZeroDivisionError):
        v = 0.0
    return RewardResult(v, {"numeric_answer": v})


def format_regex(pattern: str, name: str = "format") -> Reward:
    """A reward of 1.0 when the whole generated text matches ``pattern``."""
    compiled = re.compile(pattern, re.S)

    def reward(sample: dict) -> RewardResult:
        v = float(compiled.fullmatch(text(sample)) is not None)
        return RewardResult(v, {name: v})

    reward.__name__ = name
    return reward


eos_format = format_regex(r"[^<]*(<tool>[^<]*</tool><obs>[^<]*</obs>)*[^<]*<eos>", "eos_format")
"""1.0 when the text is (tool call, observation)* then an answer ending in <eos>."""


def code_unit_tests(sample: dict) -> RewardResult:
    """The fraction of unit tests (a list of Python assert statements) that the generated
    code passes, run in the sandbox; 0.0 when the code does not even load."""
    tests = sample.get("tests") or _metadata(sample).get("tests") or []
    if not tests:
        return RewardResult(0.0, {"tests_passed": 0.0})
    harness = ("import sys\nns = {}\ntry:\n    exec(open('solution.py').read(), ns)\nexcept BaseException:\n"
               "    print(0); sys.exit(0)\npassed = 0\nfor t in " + repr(list(tests)) + ":\n    try:\n"
               "        exec(t, ns); passed += 1\n    except BaseException:\n        pass\nprint(passed)\n")
    code = text(sample).split(EOS, 1)[0]
    r = sandbox.run([sandbox.PYTHON, "-I", "-S", "test.py"], files={"solution.py": code, "test.py": harness})
    out = r.output.split()
    passed = int(out[-1]) if r.status == "ok" and out and out[-1].isdigit() else 0
    v = passed / len(tests)
    return RewardResult(v, {"tests_passed": v})


def length_penalty(sample: dict) -> RewardResult:
    """Minus the number of generated tokens (weight it in ``combine``)."""
    v = -float(sum(sample["loss_mask"]))
    return RewardResult(v, {"length": v})


def cost_penalty(sample: dict) -> RewardResult:
    """Minus the number of tool calls plus their latency in seconds (weight it)."""
    calls = [t for t in sample.get("turns") or [] if t.get("tool_name")]
    v = -float(len(calls) + sum((t.get("latency_ms") or 0.0) for t in calls) / 1000)
    return RewardResult(v, {"cost": v})


def sum_step_rewards(sample: dict) -> RewardResult:
    """The trajectory reward as the sum of its step rewards."""
    v = float(sum(sample.get("step_rewards") or []))
    return RewardResult(v, {"step_rewards": v})


def combine(**weighted: float | tuple[Reward, float]) -> Reward:
    """sum(weight * reward.value) over the named rewards: ``name=weight`` for a reward of
    this module, ``name=(fn, weight)`` for any other. components: name -> weighted value."""
    parts = {name: (w if isinstance(w, tuple) else (getattr(sys.modules[__name__], name), w))
             for name, w in weighted.items()}

    def reward(sample: dict) -> RewardResult:
        comps = {name: w * fn(sample).value for name, (fn, w) in parts.items()}
        return RewardResult(sum(comps.values()), comps)

    return reward


def step_level(fn: Reward) -> Callable[[dict], list[float]]:
    """fn applied to the text of each assistant turn alone; 0.0 for the other turns."""
    def rewards(sample: dict) -> list[float]:
        out = []
        for t in sample.get("turns") or []:
            if t["role"] != "assistant":
                out.append(0.0)
                continue
            ids = sample["tokens"][t["start"]:t["end"]]
            out.append(fn({**sample, "text": _TOK.decode(ids)}).value)
        return out

    return rewards


reverse_reward = combine(exact_match=1.0)
"""The reverse-digits task's reward (what envs.reverse.ReverseDigits gives)."""

calculator_reward = combine(numeric_answer=1.0)
"""The calculator task's reward (what envs.calculator.Calculator gives)."""
