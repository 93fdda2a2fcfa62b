"""The token-in/token-out agent loop: roll out one GRPO group (one task, group_size
episodes) as one batched engine session and return protocol-v1 rows.

Per turn, every unfinished episode generates until a stop token (<eos>, or </tool> when
its environment has tools). A turn containing a tool call runs the tool in the sandbox
and appends the observation's ids (loss_mask 0, logprob 0); any other turn goes to the
environment's ``step``, whose observation, if it is not done, is appended the same way.
The stored tokens are exactly the prompt ids, the engine's output ids and the
observation ids, in order: nothing is decoded and encoded again (decoding is only for
parsing tool calls and for rewards).

Every episode finishes with a finish_reason: "stop" / "length" (the engine's, on the
final turn), "max_turns", "timeout" (the group's deadline or an environment call's),
"env_crash" (reset or step raised). Failed episodes still produce a row, so that a group
is always complete in the store's group sampler.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Awaitable, Callable

from . import tools
from .engines.base import Engine, Generation, SamplingParams
from .envs.base import Env
from .envs.pool import call_env


class SwapGate:
    """Generations run together; a weight swap waits for the running ones and holds new
    ones back, so a generate call never spans two versions (asyncio, one event loop)."""

    def __init__(self) -> None:
        self._cond = asyncio.Condition()
        self._running, self._swapping = 0, False

    @asynccontextmanager
    async def generation(self):
        async with self._cond:
            await self._cond.wait_for(lambda: not self._swapping)
            self._running += 1
        try:
            yield
        finally:
            async with self._cond:
                self._running -= 1
                self._cond.notify_all()

    @asynccontextmanager
    async def swap(self):
        async with self._cond:
            await self._cond.wait_for(lambda: not self._swapping)
            self._swapping = True
            await self._cond.wait_for(lambda: self._running == 0)
        try:
            yield
        finally:
            async with self._cond:
                self._swapping = False
                self._cond.notify_all()


@dataclass
class AgentConfig:
    max_turns: int = 4  # policy turns per episode
    episode_timeout: float = 60.0  # seconds for the whole group, from its start
    env_timeout: float = 10.0  # seconds for one reset or step call
    engine_name: str = "torch"  # recorded in metadata


@dataclass
class _Episode:
    """One row under construction."""
    tokens: list[int]
    loss_mask: list[int]
    logprobs: list[float]
    versions: list[int]
    turns: list[dict] = field(default_factory=list)
    step_rewards: list[float] = field(default_factory=list)
    finish_reason: str | None = None

    def add(self, ids, role: str, version: int, logprobs=None, reward: float = 0.0, **tool) -> None:
        start = len(self.tokens)
        self.tokens += ids
        self.loss_mask += [1 if logprobs is not None else 0] * len(ids)
        self.logprobs += logprobs if logprobs is not None else [0.0] * len(ids)
        self.versions += [version] * len(ids)
        self.turns.append({"role": role, "start": start, "end": len(self.tokens), **tool})
        self.step_rewards.append(reward)


async def rollout_group(engine: Engine, envs: list[Env], task: dict, params: SamplingParams, tok, *,
                        group_id: str | None = None, config: AgentConfig = AgentConfig(),
                        gate: SwapGate | None = None,
                        before_generate: Callable[[], Awaitable[None]] | None = None) -> list[dict]:
    """Roll out ``task`` once per environment in ``envs`` (the group) and return the rows.
    ``before_generate`` runs before each turn's generation (the producer checks for new
    weights there); ``gate`` keeps weight swaps out of generate calls."""
    gate = gate or SwapGate()
    deadline = time.monotonic() + config.episode_timeout
    env = envs[0]
    stops = set(params.stop_token_ids) | {tok.eos_id} | ({tok.encode("</tool>")[-1]} if env.tools else set())
    params = SamplingParams(**{**params.__dict__, "stop_token_ids": tuple(sorted(stops))})

    version0 = engine.version
    episodes = []
    for e in envs:
        prompt, failed = await call_env(e.reset, task, timeout=min(config.env_timeout, deadline - time.monotonic()))
        ep = _Episode([], [], [], [])
        ep.add([tok.bos_id] + (tok.encode(prompt) if failed is None else []), "user", version0)
        ep.finish_reason = failed
        episodes.append(ep)
    session = engine.session([ep.tokens for ep in episodes])
    try:
        for _ in range(config.max_turns):
            rows = [i for i, ep in enumerate(episodes) if ep.finish_reason is None]
            if not rows:
                break
            if time.monotonic() >= deadline:
                for i in rows:
                    episodes[i].finish_reason = "timeout"
                break
            if before_generate is not None:
                await before_generate()
            async with gate.generation():
                version = engine.version
                gens = await asyncio.to_thread(session.generate, params, rows)
            await asyncio.gather(*(_after_turn(episodes[i], envs[i], session, i, g, version, tok, deadline, config)
                                   for i, g in zip(rows, gens)))
        for ep in episodes:
            ep.finish_reason = ep.finish_reason or "max_turns"
    finally:
        session.close()
    return [_row(ep, task, env, params, group_id, len(envs), config) for ep in episodes]


async def _after_turn(ep: _Episode, env: Env, session, row: int, gen: Generation, version: int, tok,
                      deadline: float, config: AgentConfig) -> None:
    ep.add(gen.tokens, "assistant", version, logprobs=gen.logprobs)
    text = tok.decode(gen.tokens)
    call = tools.parse_call(text) if env.tools else None
    if call is not None and gen.finish_reason == "stop":
        result = await tools.call(*call, allow=env.tools)
        obs = tok.encode(tools.observation(result))
        session.append(row, obs)
        ep.add(obs, "tool", version, tool_name=result.name, tool_args=result.args, tool_result=result.output,
               tool_status=result.status, latency_ms=result.latency_ms)
        return
    out, failed = await call_env(env.step, text, timeout=min(config.env_timeout, deadline - time.monotonic()))
    if failed is not None:
        ep.finish_reason = failed
        return
    obs, reward, done = out
    ep.step_rewards[-1] = float(reward)
    if done:
        ep.finish_reason = gen.finish_reason
    elif obs:
        ids = tok.encode(obs)
        session.append(row, ids)
        ep.add(ids, "env", version)


def _row(ep: _Episode, task: dict, env: Env, params: SamplingParams, group_id: str | None, group_size: int,
         config: AgentConfig) -> dict:
    generated = [v for v, m in zip(ep.versions, ep.loss_mask) if m]
    policy_version = min(generated, default=ep.versions[0])
    reward = float(sum(ep.step_rewards))
    return {
        "traj_id": uuid.uuid4().hex, "prompt_id": task["prompt_id"],
        "group_id": group_id, "group_size": group_size if group_id else None, "task": env.name,
        "tokens": ep.tokens, "loss_mask": ep.loss_mask, "logprobs": ep.logprobs,
        "policy_version": policy_version,
        "token_policy_version": ep.versions if len(set(generated)) > 1 else None,
        "turns": ep.turns, "reward": reward, "step_rewards": ep.step_rewards,
        "reward_components": {"env": reward}, "finish_reason": ep.finish_reason,
        "metadata": json.dumps({"sampling": params.to_dict(), "seed": params.seed, "engine": config.engine_name,
                                "answer": task.get("answer"), "task": task}),
    }
