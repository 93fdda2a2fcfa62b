"""Synthetic trajectories that satisfy protocol v1, built with vectorised Arrow calls.

For tests, benchmarks and demos: ``trajectories(256, tokens=4096)`` is about 36 KiB a row
(int32 tokens, float32 logprobs, uint8 mask), the payload of a long LLM rollout.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa

from .schema import TRAJECTORY_V1


def trajectories(n: int, *, tokens: int | tuple[int, int] = 64, prompt_tokens: int = 8,
                 groups: int | None = None, tasks: tuple[str, ...] = ("math",), policy_version: int = 0,
                 reward: np.ndarray | None = None, seed: int = 0, id_prefix: str = "traj",
                 shared_prompts: bool = False) -> pa.Table:
    """n rows; ``tokens`` is a length or a (low, high) range; with ``groups``, rows are
    spread round-robin over that many GRPO groups of size n // groups. With
    ``shared_prompts``, rows of one prompt_id (a group's members) have the same prompt
    tokens, as a GRPO group's do; otherwise every token is drawn at random."""
    rng = np.random.default_rng(seed)
    if isinstance(tokens, tuple):
        lengths = rng.integers(tokens[0], tokens[1] + 1, n)
    else:
        lengths = np.full(n, tokens)
    lengths = np.maximum(lengths, prompt_tokens + 1)
    offsets = np.zeros(n + 1, dtype=np.int32)
    np.cumsum(lengths, out=offsets[1:])
    total = int(offsets[-1])
    position = np.arange(total) - np.repeat(offsets[:-1], lengths)
    mask = (position >= prompt_tokens).astype(np.uint8)
    logprobs = np.where(mask == 1, -rng.exponential(1.0, total), 0.0).astype(np.float32)

    def lists(values: np.ndarray) -> pa.ListArray:
        return pa.ListArray.from_arrays(pa.array(offsets), pa.array(values))

    tokens = rng.integers(0, 50_000, total, dtype=np.int32)
    prompts = np.arange(n) % max(groups or n, 1)  # each row's prompt
    if shared_prompts:
        table = rng.integers(0, 50_000, (max(groups or n, 1), prompt_tokens), dtype=np.int32)
        at = position < prompt_tokens
        tokens[at] = table[np.repeat(prompts, lengths)[at], position[at]]
    ids = np.char.add(f"{id_prefix}-", np.arange(n).astype(str))
    if groups:
        group_size = n // groups
        g = np.arange(n) % groups
        group_id = pa.array(np.char.add(f"{id_prefix}-g", g.astype(str)))
        group_sizes = pa.array(np.full(n, group_size, dtype=np.int32))
    else:
        group_id = pa.nulls(n, pa.string())
        group_sizes = pa.nulls(n, pa.int32())
    turns_type = TRAJECTORY_V1.field("turns").type
    turns = pa.array([[{"role": "assistant", "start": prompt_tokens, "end": int(l)}] for l in lengths],
                     type=turns_type) if n <= 4096 else pa.nulls(n, turns_type)
    columns = {
        "traj_id": pa.array(ids),
        "prompt_id": pa.array(np.char.add("prompt-", prompts.astype(str))),
        "group_id": group_id,
        "group_size": group_sizes,
        "task": pa.array(np.array(tasks)[np.arange(n) % len(tasks)]),
        "tokens": lists(tokens),
        "loss_mask": lists(mask),
        "logprobs": lists(logprobs),
        "policy_version": pa.array(np.full(n, policy_version, dtype=np.int64)),
        "turns": turns,
        "reward": pa.array(rng.random(n).astype(np.float32) if reward is None else np.asarray(reward, np.float32)),
        "finish_reason": pa.array(np.full(n, "stop")),
    }
    return pa.table(columns).cast(pa.schema([TRAJECTORY_V1.field(k) for k in columns]))
