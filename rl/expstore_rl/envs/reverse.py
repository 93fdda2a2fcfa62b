"""Reverse three digits: prompt "123=", correct output "321<eos>", reward 1 or 0."""

from __future__ import annotations

import random

from .. import rewards


class ReverseDigits:
    name = "reverse"
    tools: tuple[str, ...] = ()

    def __init__(self, digits: int = 3) -> None:
        self.digits, self.task = digits, None

    def sample_task(self, rng: random.Random) -> dict:
        d = "".join(rng.choice("0123456789") for _ in range(self.digits))
        return {"prompt_id": f"reverse-{d}", "digits": d, "answer": d[::-1]}

    def reset(self, task: dict) -> str:
        self.task = task
        return task["digits"] + "="

    def step(self, action_text: str) -> tuple[str, float, bool]:
        return "", rewards.exact_match({"text": action_text, "answer": self.task["answer"]}).value, True

    def solution(self, task: dict) -> str:
        return task["answer"] + "<eos>"
