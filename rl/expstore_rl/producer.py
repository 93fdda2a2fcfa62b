"""A rollout producer: sample a task, roll out a GRPO group of ``group_size`` episodes,
score it, insert it into the store, and pick up new policy weights between generations.

The loop, in one asyncio event loop: up to ``concurrency`` groups are in flight
(envs.pool.EnvPool); each is one batched engine session (agent.rollout_group). Before
every generation the producer looks for a newer version under ``weights_uri`` (at most
once per ``weights_poll_s``) and, if there is one, swaps it in between generate calls
(agent.SwapGate); rows record the version of every token (policy_version,
token_policy_version). A whole group is inserted in one Insert (all or none), so the
store's group sampler sees it complete at once; into a sharded store ("host:port,..."),
a group goes whole to the shard of its group_id.

Partial rollouts (partials.py): a stop (``stop_event``, SIGTERM for the program) or,
with ``interrupt_on_update``, a new version interrupts the groups in flight at the next
token; each is stored whole in ``<table>_partial`` with its unfinished rows "aborted".
The order of work: completed groups go to the store as they finish (before the next job
starts); then stored partial groups, claimed ``partial_claim`` at a time and continued
oldest policy version first (agent.continue_group; a claimed group whose continuation
is already stored is acked, not generated again); then fresh groups. The trainer's
table gets the finished group, and the partial one is done. Trainers never see aborted
rows. ``agent.max_version_span`` bounds the versions one row spans (past it the row
restarts from its prompt).

Run as a program::

    python -m expstore_rl.producer --server 127.0.0.1:50051 --table rollouts \\
        --weights-uri file:///tmp/weights --env reverse --engine torch --group-size 8
    python -m expstore_rl.producer ... --model ./my-qwen --env mypkg.envs:Countdown \\
        --reward mypkg.rewards:score --engine vllm      # your model, environment and reward

Without ``--model`` the policy is the toy model of model.py with CharTokenizer; with it,
any Hugging Face causal LM directory (hf.py), its tokenizer and chat template (chat.py).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import random
import signal
import sys
import threading
import time
import uuid
from collections import Counter
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from functools import partial
from typing import AsyncIterator, Awaitable, Callable

import grpc
from expstore_client import AsyncClient, ShardedClient, names_shards

from . import agent, chat, hf, plugins, weights
from .engines.base import Engine, SamplingParams
from .pace import Pace
from .partials import VISIBILITY_S, Claimed, Partials
from .envs.base import Env
from .envs.pool import EnvPool, EpisodeError
from .rewards import Reward
from .tokenizer import CharTokenizer

log = logging.getLogger(__name__)


@dataclass
class ProducerConfig:
    concurrency: int = 4  # groups in flight at once
    seed: int = 0  # task sampling; group k samples with seed * 1_000_003 + k
    weights_poll_s: float = 1.0  # least seconds between two looks for new weights
    insert_retries: int = 3  # an Insert is retried (safe: traj_id is idempotent) before giving up
    log_every: int = 0  # print the metrics as one JSON line every N groups (0: never)
    partials: bool = True  # store interrupted groups in <table>_partial and continue them (partials.py)
    interrupt_on_update: bool = False  # a new version interrupts the generations running (their groups go on under it)
    partial_group: str = "producers"  # the producers' consumer group on the partial table
    partial_claim: int | None = None  # partial groups claimed per look, continued oldest version first (None: concurrency)
    partial_visibility_s: float = VISIBILITY_S  # a claimed group not done by then goes back to the producers
    agent: agent.AgentConfig = field(default_factory=agent.AgentConfig)


Insert = Callable[[str, list[dict]], Awaitable[object]]  # (table, rows) -> InsertResult


@asynccontextmanager
async def inserter(target: str, token: str | None) -> AsyncIterator[Insert]:
    """The producer's insert: AsyncClient's for one server; for shards ("a:1,b:2") a
    ShardedClient's, on a thread (it blocks while its parts go to their shards)."""
    if names_shards(target):
        with ShardedClient(target, token) as client:
            yield partial(asyncio.to_thread, client.insert)
    else:
        async with AsyncClient(target, token) as client:
            yield client.insert


class Producer:
    def __init__(self, client_target: str, table: str, engine: Engine, env_factory: Callable[[], Env], *,
                 group_size: int, weights_uri: str | None = None, params: SamplingParams, token: str | None = None,
                 tokenizer=None, reward_fn: Reward | None = None, config: ProducerConfig = ProducerConfig()) -> None:
        if group_size < 1:
            raise ValueError("group_size must be >= 1")
        self.target, self.table, self.engine, self.env_factory = client_target, table, engine, env_factory
        self.group_size, self.weights_uri, self.params, self.token = group_size, weights_uri, params, token
        self.tok, self.reward_fn, self.config = tokenizer or CharTokenizer(), reward_fn, config
        self.rng = random.Random(config.seed)
        self.gate = agent.SwapGate()
        self.metrics: Counter = Counter()
        self._last_poll = float("-inf")
        self._groups_started = 0
        self._partials: Partials | None = None
        self._pace: Pace | None = None  # the table's reservations, when it is paced (pace.py)
        self._look_for_partials = False
        self._claimed: list[Claimed] = []  # claimed, not started yet: oldest version first
        self._stop: threading.Event | None = None
        self._updating = False  # a new version waits for the generations running: they stop
        self._reloading: asyncio.Lock | None = None  # one look for new weights at a time (per event loop)

    def run(self, num_groups: int | None = None, stop_event: threading.Event | None = None) -> dict:
        """Produce ``num_groups`` groups (None: until ``stop_event`` is set); returns the
        metrics (docs/rl.md, "Producers")."""
        return asyncio.run(self.run_async(num_groups, stop_event))

    async def run_async(self, num_groups: int | None = None, stop_event: threading.Event | None = None) -> dict:
        """Groups stored as partial by earlier runs (or other producers) are continued
        first. Setting ``stop_event`` interrupts the groups in flight: they are stored as
        partial (partials.py), and the run returns."""
        self._stop, self._reloading = stop_event, None
        if self.config.partials:
            self._partials = await asyncio.to_thread(Partials.open, self.target, self.token, self.table,
                                                     self.config.partial_group, self.config.partial_visibility_s)
        self._look_for_partials = self._partials is not None
        self._pace = await asyncio.to_thread(Pace.open, self.target, self.token, self.table, stop_event)
        watcher = None
        try:
            async with inserter(self.target, self.token) as insert:
                await self.maybe_reload(force=True)
                if self.config.interrupt_on_update and self._partials is not None and self.weights_uri:
                    watcher = asyncio.ensure_future(self._watch_weights())
                pool, fresh = EnvPool(self.config.concurrency), num_groups
                while True:
                    async for result in pool.run(self._jobs(fresh, stop_event)):
                        if isinstance(result, EpisodeError):  # a bug outside any environment call
                            self.metrics["producer/failed_groups"] += 1
                            continue
                        await self._finish(insert, *result)
                    if not self._look_for_partials or (stop_event and stop_event.is_set()):
                        break
                    fresh = 0  # groups a new version interrupted after the last job started
        finally:
            if watcher is not None:
                watcher.cancel()
            if self._partials is not None:
                self._partials.close()
            if self._pace is not None:
                self._pace.close()
        return self.stats()

    def _jobs(self, num_groups: int | None, stop_event: threading.Event | None):
        """Claimed partial groups first, oldest version first (a claim is made when none
        is left: at the start, and after a group was stored as partial; it is one short
        blocking read), then ``num_groups`` new ones. Claimed groups a stop leaves
        unstarted go back to the producers after ``partial_visibility_s``."""
        started = 0
        while not (stop_event and stop_event.is_set()):
            if not self._claimed and self._look_for_partials:
                self._claimed, completed = self._partials.claim(self.config.partial_claim or self.config.concurrency,
                                                                self.group_size)
                self.metrics["producer/completed_partial_groups"] += completed
                self._look_for_partials = bool(self._claimed or completed)
            if self._claimed:
                claimed = self._claimed.pop(0)
                self.metrics["producer/continued_groups"] += 1
                yield partial(self._continue, claimed.rows, claimed.first)
                continue
            if num_groups is not None and started >= num_groups:
                return
            started += 1
            self._groups_started += 1  # over all runs: the seed of each group differs
            yield partial(self._group, self._groups_started)

    async def _group(self, k: int) -> tuple[list[dict], None]:
        env = self.env_factory()
        task = env.sample_task(self.rng)
        group_id = uuid.uuid4().hex
        if self._pace is not None:  # a paced table admits the group before it starts
            await asyncio.to_thread(self._pace.reserve, group_id, self.group_size)
        rows = await agent.rollout_group(
            self.engine, [env] + [self.env_factory() for _ in range(self.group_size - 1)], task, self._params(k),
            self.tok, group_id=group_id, config=self.config.agent, gate=self.gate,
            before_generate=self.maybe_reload, interrupt=self._interrupt())
        return rows, None

    async def _continue(self, rows: list[dict], first: int) -> tuple[list[dict], int]:
        """Continue a stored partial group; returns the rows and its index-0 row's id."""
        self._groups_started += 1
        rows = await agent.continue_group(
            self.engine, self.env_factory, rows, self._params(self._groups_started), self.tok,
            config=self.config.agent, gate=self.gate, before_generate=self.maybe_reload, interrupt=self._interrupt())
        return rows, first

    def _params(self, k: int) -> SamplingParams:
        return SamplingParams(**{**self.params.__dict__, "seed": self.config.seed * 1_000_003 + k})

    def _interrupt(self):
        """What interrupts a group's generations: a stop, or a new version (with
        interrupt_on_update); None when interrupted groups cannot be stored."""
        if self._partials is None:
            return None
        return lambda: self._updating or (self._stop is not None and self._stop.is_set())

    async def _finish(self, insert: Insert, rows: list[dict], continued: int | None) -> None:
        """A whole group into the table, or, interrupted, into the partial table; then a
        continued group's partial rows are done."""
        if any(r["finish_reason"] == "aborted" for r in rows):
            if self._pace is not None:  # whoever continues it reserves again
                await asyncio.to_thread(self._pace.give_back, rows[0]["group_id"])
            await asyncio.to_thread(self._partials.put, rows)
            self.metrics["producer/aborted_groups"] += 1
            self._look_for_partials = not (self._stop is not None and self._stop.is_set())
        else:
            if self.reward_fn is not None:
                await asyncio.to_thread(self._score, rows)
            if self._pace is not None:
                rows = await asyncio.to_thread(self._pace.stamp, rows)
            await self._insert(insert, rows)
        if continued is not None:
            await asyncio.to_thread(self._partials.done, continued)

    def _score(self, rows: list[dict]) -> None:
        for row in rows:
            sample = {**row, "text": self.tok.decode(t for t, m in zip(row["tokens"], row["loss_mask"]) if m)}
            result = self.reward_fn(sample)
            row["reward"], row["reward_components"] = float(result.value), {
                **row["reward_components"], **{k: float(v) for k, v in result.components.items()}}

    async def maybe_reload(self, force: bool = False) -> None:
        """Load the newest published version if it is newer than the engine's. With
        interrupt_on_update the generations running are interrupted rather than waited
        for (their groups are stored as partial and continued under the new version)."""
        if self.weights_uri is None or (not force and time.monotonic() - self._last_poll < self.config.weights_poll_s):
            return
        self._reloading = self._reloading or asyncio.Lock()
        async with self._reloading:
            await self._reload()

    async def _reload(self) -> None:
        self._last_poll = time.monotonic()
        latest = await asyncio.to_thread(weights.latest_version, self.weights_uri)
        if latest is None or latest <= self.engine.version:
            return
        path = await asyncio.to_thread(weights.local_path, self.weights_uri, latest)
        self._updating = self.config.interrupt_on_update
        try:
            async with self.gate.swap():
                self._updating = False
                if latest > self.engine.version:  # another task may have swapped meanwhile
                    await asyncio.to_thread(self.engine.load_weights, path, latest)
                    self.metrics["producer/weight_reloads"] += 1
                    log.info("loaded policy version %d", latest)
        finally:
            self._updating = False

    async def _watch_weights(self) -> None:
        """With interrupt_on_update: look for new versions while generations run too."""
        while True:
            await asyncio.sleep(self.config.weights_poll_s)
            await self.maybe_reload()

    async def _insert(self, insert: Insert, rows: list[dict]) -> None:
        for attempt in range(self.config.insert_retries + 1):
            try:
                await insert(self.table, rows)
                break
            except grpc.RpcError as e:
                if e.code() == grpc.StatusCode.INVALID_ARGUMENT or attempt == self.config.insert_retries:
                    raise
                log.warning("insert failed (%s), retrying", e.code())
                await asyncio.sleep(0.5 * 2 ** attempt)
        m = self.metrics
        m["producer/groups"] += 1
        m["producer/trajectories"] += len(rows)
        m["producer/tokens"] += sum(len(r["tokens"]) for r in rows)
        m["producer/generated_tokens"] += sum(sum(r["loss_mask"]) for r in rows)
        m["producer/reward_sum"] += sum(r["reward"] for r in rows)
        m.update(f"producer/finish/{r['finish_reason']}" for r in rows)
        m["producer/restarted_rows"] += sum("restarts" in json.loads(r["metadata"]) for r in rows)
        if self.config.log_every and m["producer/groups"] % self.config.log_every == 0:
            print(json.dumps(self.stats()), flush=True)

    def stats(self) -> dict:
        m = dict(self.metrics)
        n = max(1, m.get("producer/trajectories", 0))
        m["producer/reward_mean"] = m.get("producer/reward_sum", 0.0) / n
        m["producer/policy_version"] = self.engine.version
        return m


def build_engine(kind: str, weights_uri: str | None, device: str, seed: int, model: str | None = None) -> Engine:
    """The CLI's engine: the newest published version under ``weights_uri``; else, as
    version 0, the ``model`` directory, or (torch only) a fresh toy model (vLLM waits
    for a published version then)."""
    latest = weights.latest_version(weights_uri) if weights_uri else None
    if kind == "vllm":
        from .engines.vllm_engine import VLLMEngine
        while latest is None and model is None:  # vLLM loads from a model directory
            log.info("waiting for a published version under %s", weights_uri)
            time.sleep(1.0)
            latest = weights.latest_version(weights_uri)
        if latest is None:
            return VLLMEngine(str(hf.require_model_dir(model)), version=0)
        return VLLMEngine(weights.local_path(weights_uri, latest), version=latest)
    from .engines.torch_engine import TorchEngine
    if latest is not None:
        return TorchEngine(hf.load_model(weights.local_path(weights_uri, latest)), device, version=latest)
    if model is not None:
        return TorchEngine(hf.load_model(model), device, version=0)
    from .model import ModelConfig, build_model
    return TorchEngine(build_model(ModelConfig(), seed), device, version=0)


def build_parser() -> argparse.ArgumentParser:
    from .envs import ENVS
    p = argparse.ArgumentParser(prog="python -m expstore_rl.producer", description=__doc__.split("\n\n")[0])
    p.add_argument("--server", default="127.0.0.1:50051")
    p.add_argument("--table", required=True)
    p.add_argument("--token", default=os.environ.get("EXPSTORE_TOKEN"),
                   help="bearer token with the producer role (env EXPSTORE_TOKEN: a command line is readable by "
                        "every local user, the environment is not)")
    p.add_argument("--weights-uri", default=None, help="fsspec uri of published versions (weights.publish)")
    p.add_argument("--model", default=None,
                   help="a Hugging Face causal LM directory (its tokenizer and chat template too); default: the toy model")
    p.add_argument("--env", default="reverse",
                   help=f"a built-in environment ({', '.join(sorted(ENVS))}) or module:Class")
    p.add_argument("--engine", choices=["torch", "vllm"], default="torch")
    p.add_argument("--device", default="cpu")
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--num-groups", type=int, default=None, help="stop after this many groups (default: never)")
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--max-turns", type=int, default=4)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--reward", default=None,
                   help="a reward of expstore_rl.rewards by name, or module:function (default: the env's)")
    p.add_argument("--log-every", type=int, default=10, help="print metrics as JSON every N groups")
    p.add_argument("--partials", action=argparse.BooleanOptionalAction, default=True,
                   help="store groups interrupted by a stop in <table>_partial and continue stored ones first")
    p.add_argument("--interrupt-on-update", action="store_true",
                   help="a new policy version interrupts the generations running; their groups go on under it")
    p.add_argument("--max-version-span", type=int, default=None,
                   help="policy versions one rollout's generated tokens may span; a rollout past it restarts from "
                        "its prompt (default: unbounded)")
    p.add_argument("--partial-visibility-s", type=float, default=VISIBILITY_S,
                   help="seconds a claimed partial group stays with its producer before the others may take it")
    return p


def from_args(argv: list[str] | None = None, token: str | None = None) -> tuple[Producer, int | None]:
    """The producer the CLI flags describe (engine loaded), and its ``--num-groups``;
    ``token``, when given, instead of ``--token`` / EXPSTORE_TOKEN."""
    parser = build_parser()
    a = parser.parse_args(argv)
    try:
        env_factory = plugins.env_factory(a.env)
        reward_fn = plugins.reward(a.reward) if a.reward else None
        tokenizer = chat.HFChat.from_pretrained(str(hf.require_model_dir(a.model))) if a.model else CharTokenizer()
        if env_factory().tools:  # a template that cannot frame a tool result fails now, not in every episode
            tokenizer.observation_ids("", "tool", None)
    except ValueError as e:
        parser.error(str(e))
    engine = build_engine(a.engine, a.weights_uri, a.device, a.seed, a.model)
    params = SamplingParams(max_tokens=a.max_tokens, temperature=a.temperature, top_k=a.top_k, top_p=a.top_p)
    config = ProducerConfig(concurrency=a.concurrency, seed=a.seed, log_every=a.log_every, partials=a.partials,
                            interrupt_on_update=a.interrupt_on_update, partial_visibility_s=a.partial_visibility_s,
                            agent=agent.AgentConfig(max_turns=a.max_turns, engine_name=a.engine,
                                                    max_version_span=a.max_version_span))
    producer = Producer(a.server, a.table, engine, env_factory, group_size=a.group_size, weights_uri=a.weights_uri,
                        params=params, token=token or a.token, tokenizer=tokenizer, reward_fn=reward_fn, config=config)
    return producer, a.num_groups


def main(argv: list[str] | None = None) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    import torch
    torch.set_num_threads(1)
    producer, num_groups = from_args(argv)
    stop = threading.Event()  # SIGTERM (e.g. the launcher's): the groups in flight are stored as partial
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    print(json.dumps(producer.run(num_groups, stop)), flush=True)


if __name__ == "__main__":
    sys.exit(main())
