"""Multi-turn: multiply two two-digit numbers, which the tiny policy cannot do by itself,
so it must call the calculator: "37*58=" -> "<tool>calc 37*58</tool>" (observation
"<obs>2146</obs>", loss_mask 0) -> "2146<eos>". Reward 1 for the right final answer."""

from __future__ import annotations

import random

from .. import rewards


class Calculator:
    name = "calculator"
    tools: tuple[str, ...] = ("calc",)

    def __init__(self) -> None:
        self.task = None

    def sample_task(self, rng: random.Random) -> dict:
        a, b = rng.randint(10, 99), rng.randint(10, 99)
        return {"prompt_id": f"calc-{a}*{b}", "expr": f"{a}*{b}", "answer": str(a * b)}

    def reset(self, task: dict) -> str:
        self.task = task
        return task["expr"] + "="

    def step(self, action_text: str) -> tuple[str, float, bool]:
        return "", rewards.numeric_answer({"text": action_text, "answer": self.task["answer"]}).value, True

    def solution(self, task: dict) -> str:
        return f"<tool>calc {task['expr']}</tool><obs>{task['answer']}</obs>{task['answer']}<eos>"
