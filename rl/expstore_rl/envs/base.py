"""The environment interface. An environment instance runs one episode at a time; the
agent loop makes one per member of a group (``env_factory()``).

``reset(task)`` returns the prompt text (with a chat template, also a list of messages);
``step(action_text)`` takes the text of one policy turn that is not a tool call (special
tokens left out) and returns (observation text, reward, done). The observation of a step
that is not done is appended as tokens with loss_mask 0 (with a chat template, as a
"user" message). Tool calls never reach ``step``: the agent runs them (tools.py) among
``tools``. Texts must be encodable by the tokenizer in use (CharTokenizer: the toy
alphabet). Your own environment is named ``--env module:Class`` (plugins.py).
"""

from __future__ import annotations

import random
from typing import Protocol


class Env(Protocol):
    name: str  # the trajectory's ``task`` column
    tools: tuple[str, ...]  # the tool allowlist of this environment

    def sample_task(self, rng: random.Random) -> dict:
        """A task: a dict with at least ``prompt_id`` and ``answer`` (stored in metadata)."""

    def reset(self, task: dict) -> str: ...

    def step(self, action_text: str) -> tuple[str, float, bool]: ...

    def solution(self, task: dict) -> str:
        """A correct policy output for ``task``, for supervised warm-up: the policy's turns,
        each observation between two of them written ``<obs>...</obs>``, optionally a final
        ``<eos>`` (demo.solution_ids turns it into ids in any chat format)."""
