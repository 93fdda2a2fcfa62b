"""The token-in/token-out agent loop: roll out one GRPO group (one task, group_size
episodes) as one batched engine session and return protocol-v1 rows.

``tok`` is the episode's ``chat.ChatFormat`` (CharTokenizer for the toy model, HFChat for
a model with a chat template): it gives the prompt ids, the stop ids and each
observation's ids. Per turn, every unfinished episode generates until a stop id (the
format's: <eos>, or </tool> when the toy environment has tools; a template's end of turn
or eos). A turn containing a tool call (parsed from the decoded generated ids) runs the
tool in the sandbox and appends the observation's ids (loss_mask 0, logprob 0); any
other turn goes to the environment's ``step``, whose observation, if it is not done, is
appended the same way (as a "user" message). The stored tokens are exactly the prompt
ids, the engine's output ids and the observation ids, in order, the same ids the
engine's session holds: nothing is decoded and encoded again (decoding is only for
parsing tool calls, for the environment and for rewards).

Every episode finishes with a finish_reason: "stop" / "length" (the engine's, on the
final turn), "max_turns", "timeout" (the group's deadline or an environment call's),
"env_crash" (reset or step raised). Failed episodes still produce a row, so that a group
is always complete in the store's group sampler.

Partial rollouts: a group interrupted (``interrupt``: the producer stops, or a weight
update) comes back at once with its unfinished episodes "aborted": their tokens,
logprobs and per-token versions as generated, a turn cut mid-generation included
(``metadata.partial.open_turn``). ``continue_group`` takes such a group and goes on from
exactly there.

Version span: with ``max_version_span = B`` no row's generated tokens come from more than
B policy versions (newest - oldest + 1, counted by version number). A row that would
generate under a version past its bound is restarted from its prompt under the version
now (its environment ``reset`` again): what it had generated is dropped, never mixed in,
and ``metadata.restarts`` records each restart (tokens dropped, the versions they spanned,
the version it restarted under).
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
from .engines.base import Engine, Generation, Interrupt, SamplingParams
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
    max_version_span: int | None = None  # policy versions one row's generated tokens may span; past it: restart

    def __post_init__(self) -> None:
        if self.max_version_span is not None and self.max_version_span < 1:
            raise ValueError("max_version_span must be >= 1 (or None: unbounded)")


@dataclass
class _Episode:
    """One row under construction (or restored from a stored partial row)."""
    tokens: list[int]
    loss_mask: list[int]
    logprobs: list[float]
    versions: list[int]
    turns: list[dict] = field(default_factory=list)
    step_rewards: list[float] = field(default_factory=list)
    finish_reason: str | None = None
    open_turn: bool = False  # its last assistant turn was cut mid-generation
    restarts: list[dict] = field(default_factory=list)  # each restart past the version span (metadata)

    def add(self, ids, role: str, version: int, logprobs=None, reward: float = 0.0, **tool) -> None:
        start = len(self.tokens)
        self._append(ids, version, logprobs)
        self.turns.append({"role": role, "start": start, "end": len(self.tokens), **tool})
        self.step_rewards.append(reward)

    def extend_turn(self, ids, version: int, logprobs) -> None:
        """More generated tokens for the open (last, assistant) turn."""
        self._append(ids, version, logprobs)
        self.turns[-1]["end"] = len(self.tokens)

    def _append(self, ids, version: int, logprobs) -> None:
        self.tokens += ids
        self.loss_mask += [1 if logprobs is not None else 0] * len(ids)
        self.logprobs += logprobs if logprobs is not None else [0.0] * len(ids)
        self.versions += [version] * len(ids)

    @property
    def turns_done(self) -> int:
        """Generate calls this episode took part in: one assistant turn each."""
        return sum(t["role"] == "assistant" for t in self.turns)

    def span(self, version: int) -> int:
        """Policy versions its generated tokens would span if it generated under ``version``."""
        generated = [v for v, m in zip(self.versions, self.loss_mask) if m]
        return version - min(generated) + 1 if generated else 1

    def restart(self, version: int) -> None:
        """Back to its prompt (turn 0), as under ``version``; the rest is dropped (recorded)."""
        generated = [v for v, m in zip(self.versions, self.loss_mask) if m]
        n = self.turns[0]["end"]
        self.restarts.append({"dropped_tokens": len(self.tokens) - n, "versions": [min(generated), max(generated)],
                              "restarted_under": version})
        self.tokens, self.loss_mask, self.logprobs = self.tokens[:n], self.loss_mask[:n], self.logprobs[:n]
        self.versions, self.turns, self.step_rewards = [version] * n, self.turns[:1], self.step_rewards[:1]
        self.open_turn = False

    def last_turn(self) -> list[int]:
        return self.tokens[self.turns[-1]["start"]:self.turns[-1]["end"]]

    @classmethod
    def from_row(cls, row: dict) -> "_Episode":
        versions = row["token_policy_version"] or [row["policy_version"]] * len(row["tokens"])
        turns = [{k: v for k, v in t.items() if v is not None} for t in row["turns"]]
        meta = json.loads(row["metadata"])
        return cls(list(row["tokens"]), list(row["loss_mask"]), list(row["logprobs"]), list(versions), turns,
                   list(row["step_rewards"]), open_turn=meta.get("partial", {}).get("open_turn", False),
                   restarts=list(meta.get("restarts", [])))


async def rollout_group(engine: Engine, envs: list[Env], task: dict, params: SamplingParams, tok, *,
                        group_id: str | None = None, config: AgentConfig = AgentConfig(),
                        gate: SwapGate | None = None,
                        before_generate: Callable[[], Awaitable[None]] | None = None,
                        interrupt: Interrupt | None = None) -> list[dict]:
    """Roll out ``task`` once per environment in ``envs`` (the group) and return the rows.
    ``before_generate`` runs before each turn's generation (the producer checks for new
    weights there); ``gate`` keeps weight swaps out of generate calls. Once
    ``interrupt()`` is true the group stops: its unfinished episodes come back with
    finish_reason "aborted" and what they have (``continue_group`` goes on from them)."""
    deadline = time.monotonic() + config.episode_timeout
    env = envs[0]
    params = _with_stops(params, tok, env)
    version0 = engine.version
    episodes = []
    for e in envs:
        prompt, failed = await call_env(e.reset, task, timeout=min(config.env_timeout, deadline - time.monotonic()))
        ep = _Episode([], [], [], [])
        ep.add(tok.prompt_ids(prompt if failed is None else ""), "user", version0)
        ep.finish_reason = failed
        episodes.append(ep)
    await _play(engine, envs, episodes, task, params, tok, deadline, config, gate or SwapGate(), before_generate,
                interrupt)
    return [_row(ep, task, env, params, group_id, len(envs), config) for ep in episodes]


async def continue_group(engine: Engine, env_factory: Callable[[], Env], rows: list[dict], params: SamplingParams,
                         tok, *, config: AgentConfig = AgentConfig(), gate: SwapGate | None = None,
                         before_generate: Callable[[], Awaitable[None]] | None = None,
                         interrupt: Interrupt | None = None) -> list[dict]:
    """Go on with a stored partial group (``rows``, in group order): each aborted row
    continues where it stopped, a cut turn with what is left of its token budget, under
    the engine's version now (its tokens keep the versions they were generated with), its
    environment brought back by replaying the stored turns (``reset`` and the ``step``
    of every finished turn that was not a tool call: environments must be deterministic).
    Rows that had finished come back unchanged. A continued row gets a new traj_id
    derived from the aborted one (the same for every attempt, so the store deduplicates a
    retried continuation) and ``metadata.continues`` = the aborted row's traj_id."""
    deadline = time.monotonic() + config.episode_timeout
    meta = json.loads(rows[0]["metadata"])
    task, envs = meta["task"], [env_factory() for _ in rows]
    params = _with_stops(params, tok, envs[0])
    episodes = []
    for env, row in zip(envs, rows):
        ep = _Episode.from_row(row)
        if row["finish_reason"] == "aborted":
            ep.finish_reason = await _replay(env, task, ep, tok, deadline, config)
        else:
            ep.finish_reason = row["finish_reason"]
        episodes.append(ep)
    await _play(engine, envs, episodes, task, params, tok, deadline, config, gate or SwapGate(), before_generate,
                interrupt)
    out = []
    for ep, row in zip(episodes, rows):
        old = {k: v for k, v in json.loads(row["metadata"]).items() if k != "partial"}
        if row["finish_reason"] != "aborted":
            out.append({**row, "metadata": json.dumps(old)})
            continue
        new = _row(ep, task, envs[0], params, row["group_id"], row["group_size"], config)
        made = json.loads(new["metadata"])  # partial: aborted again; restarts: so far
        new |= {"traj_id": continuation_id(row["traj_id"]), "prompt_id": row["prompt_id"],
                "metadata": json.dumps({**old, **{k: made[k] for k in ("partial", "restarts") if k in made},
                                        "continues": row["traj_id"], "continue_seed": params.seed})}
        out.append(new)
    return out


async def _replay(env: Env, task: dict, ep: _Episode, tok, deadline: float, config: AgentConfig) -> str | None:
    """Bring a new environment to where a stored episode left it: ``reset``, then ``step``
    with every finished assistant turn that was not followed by a tool observation.
    Returns None, or the finish_reason of a failed call."""
    timeout = lambda: min(config.env_timeout, deadline - time.monotonic())  # noqa: E731
    _, failed = await call_env(env.reset, task, timeout=timeout())
    turns = ep.turns
    for k, turn in enumerate(turns):
        closed = k < len(turns) - 1 or not ep.open_turn
        tool_call = k + 1 < len(turns) and turns[k + 1]["role"] == "tool"
        if failed is None and turn["role"] == "assistant" and closed and not tool_call:
            _, failed = await call_env(env.step, tok.decode(ep.tokens[turn["start"]:turn["end"]]), timeout=timeout())
    return failed


def continuation_id(traj_id: str) -> str:
    """The traj_id of the row that continues (supersedes) the aborted row ``traj_id``: the
    same for every attempt, so the store deduplicates a retried continuation."""
    return uuid.uuid5(uuid.NAMESPACE_OID, traj_id).hex


async def _play(engine: Engine, envs: list[Env], episodes: list[_Episode], task: dict, params: SamplingParams, tok,
                deadline: float, config: AgentConfig, gate: SwapGate,
                before_generate: Callable[[], Awaitable[None]] | None, interrupt: Interrupt | None) -> None:
    """Turns until every episode has finished (or the group is interrupted): rows that
    continue a cut turn generate first, with what is left of their budget. A row the
    version now would take past ``max_version_span`` is restarted first (the version is
    read under the gate, so it is the one the generate call would run)."""
    session = engine.session([ep.tokens for ep in episodes])
    try:
        while True:
            for ep in episodes:
                if ep.finish_reason is None and not ep.open_turn and ep.turns_done >= config.max_turns:
                    ep.finish_reason = "max_turns"
            rows = [i for i, ep in enumerate(episodes) if ep.finish_reason is None]
            if not rows:
                break
            if time.monotonic() >= deadline:
                for i in rows:
                    episodes[i].finish_reason = "timeout"
                break
            if before_generate is not None:
                await before_generate()
            cut = [i for i in rows if episodes[i].open_turn]
            if cut:
                used = len(episodes[cut[0]].last_turn())
                rows = [i for i in cut if len(episodes[i].last_turn()) == used]
                turn_params = SamplingParams(**{**params.__dict__, "max_tokens": max(0, params.max_tokens - used)})
            else:
                turn_params = params
            stale = []
            async with gate.generation():  # asked here, after any weight swap: a swap is no reason to stop
                stopped = interrupt is not None and interrupt()
                if not stopped:
                    version = engine.version
                    stale = [i for i in rows if config.max_version_span is not None
                             and episodes[i].span(version) > config.max_version_span]
                    if not stale:
                        gens = await asyncio.to_thread(session.generate, turn_params, rows, interrupt)
            if stale:  # outside the gate: resets call environments
                await _restart(envs, episodes, stale, task, version, deadline, config)
                session.close()
                session = engine.session([ep.tokens for ep in episodes])
                continue
            if not stopped:
                await asyncio.gather(*(_after_turn(episodes[i], envs[i], session, i, g, version, tok, deadline,
                                                   config) for i, g in zip(rows, gens)))
            if stopped or any(g.finish_reason == "aborted" for g in gens):
                for ep in episodes:
                    ep.finish_reason = ep.finish_reason or "aborted"
                break
    finally:
        session.close()


async def _restart(envs: list[Env], episodes: list[_Episode], rows: list[int], task: dict, version: int,
                   deadline: float, config: AgentConfig) -> None:
    """Rows ``rows`` start over from their prompts, their environments reset (the prompt
    is the stored one: environments are deterministic, as for continuations). The caller
    then opens a new engine session, so the group's other rows prefill their prefixes
    again: a restart is rare, and sessions cannot rewind one row."""
    for i in rows:
        episodes[i].restart(version)
        _, episodes[i].finish_reason = await call_env(envs[i].reset, task,
                                                      timeout=min(config.env_timeout, deadline - time.monotonic()))


def _with_stops(params: SamplingParams, tok, env: Env) -> SamplingParams:
    """Generation stops at the format's stop ids (CharTokenizer: <eos>, and </tool> when
    the environment has tools) and at those ``params`` names."""
    stops = set(params.stop_token_ids) | set(tok.stop_ids(bool(env.tools)))
    return SamplingParams(**{**params.__dict__, "stop_token_ids": tuple(sorted(stops))})


async def _after_turn(ep: _Episode, env: Env, session, row: int, gen: Generation, version: int, tok,
                      deadline: float, config: AgentConfig) -> None:
    if ep.open_turn:
        ep.extend_turn(gen.tokens, version, gen.logprobs)
    elif gen.tokens or gen.finish_reason != "aborted":
        ep.add(gen.tokens, "assistant", version, logprobs=gen.logprobs)
    if gen.finish_reason == "aborted":
        ep.open_turn = ep.open_turn or bool(gen.tokens)
        ep.finish_reason = "aborted"
        return
    ep.open_turn = False
    turn = ep.last_turn()
    text = tok.decode(turn)
    call = tools.parse_call(text) if env.tools else None
    if call is not None and gen.finish_reason == "stop":
        result = await tools.call(*call, allow=env.tools)
        obs = tok.observation_ids(tools.observation(result), "tool", turn[-1])
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
    else:  # a chat template frames even an empty observation: the next turn needs its header
        ids = tok.observation_ids(obs or "", "user", turn[-1] if turn else None)
        if ids:
            session.append(row, ids)
            ep.add(ids, "env", version)


def _row(ep: _Episode, task: dict, env: Env, params: SamplingParams, group_id: str | None, group_size: int,
         config: AgentConfig) -> dict:
    generated = [v for v, m in zip(ep.versions, ep.loss_mask) if m]
    policy_version = min(generated, default=ep.versions[0])
    reward = float(sum(ep.step_rewards))
    aborted = ep.finish_reason == "aborted"
    meta = {"sampling": params.to_dict(), "seed": params.seed, "engine": config.engine_name,
            "answer": task.get("answer"), "task": task}
    if aborted:  # what continue_group needs besides the tokens: was the last turn cut?
        meta["partial"] = {"open_turn": ep.open_turn}
    if ep.restarts:
        meta["restarts"] = ep.restarts
    return {
        "traj_id": uuid.uuid4().hex, "prompt_id": task["prompt_id"],
        "group_id": group_id, "group_size": group_size if group_id else None, "task": env.name,
        "tokens": ep.tokens, "loss_mask": ep.loss_mask, "logprobs": ep.logprobs,
        "policy_version": policy_version,
        "token_policy_version": ep.versions if len(set(generated)) > 1 or aborted else None,
        "turns": ep.turns, "reward": reward, "step_rewards": ep.step_rewards,
        "reward_components": {"env": reward}, "finish_reason": ep.finish_reason,
        "metadata": json.dumps(meta),
    }
