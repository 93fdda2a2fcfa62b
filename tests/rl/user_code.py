"""An environment and rewards as a user writes them, outside expstore_rl: the tests name
them by import path (``--env user_code:Countdown``, ``--reward user_code:digits``) with
this directory on the path."""

from __future__ import annotations

import random

from expstore_rl.rewards import RewardResult


class Countdown:
    """Multi-turn without tools: "count down from 57" -> "57", observation "next" ->
    "56", "next" -> "55". Reward: the fraction of the three said right."""

    name = "countdown"
    tools: tuple[str, ...] = ()
    turns = 3

    def __init__(self) -> None:
        self.task, self.said = None, []

    def sample_task(self, rng: random.Random) -> dict:
        n = rng.randint(20, 99)
        return {"prompt_id": f"countdown-{n}", "start": n, "answer": str(n - self.turns + 1)}

    def reset(self, task: dict) -> str:
        self.task, self.said = task, []
        return f"count down from {task['start']}"

    def step(self, action_text: str) -> tuple[str, float, bool]:
        self.said.append(action_text.strip())
        if len(self.said) < self.turns:
            return "next", 0.0, False
        want = [str(self.task["start"] - i) for i in range(self.turns)]
        return "", sum(a == b for a, b in zip(self.said, want)) / self.turns, True

    def solution(self, task: dict) -> str:
        return "<obs>next</obs>".join(str(task["start"] - i) for i in range(self.turns)) + "<eos>"


def digits(sample: dict) -> RewardResult:
    """The fraction of the generated characters that are digits."""
    text = sample["text"]
    v = sum(c.isdigit() for c in text) / max(len(text), 1)
    return RewardResult(v, {"digits": v})


def marked(sample: dict) -> RewardResult:
    """0.25 for a row of the countdown task, 0 for any other: a reward whose mean says
    whose rows a trainer saw."""
    v = 0.25 if sample["task"] == "countdown" else 0.0
    return RewardResult(v, {"marked": v})


class NotAnEnv:
    name = "broken"
