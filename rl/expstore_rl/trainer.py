"""The plumbing that GRPO and PPO share, so that grpo.py and ppo.py hold the algorithm
and little else: the common config and its CLI flags, building, publishing and
restoring models, the micro-batches FSDP needs, the store as the data source (source.py,
re-exported here), checkpoints, and a ``Run`` that carries a run from step to step
(start or resume, sample, commit, publish, checkpoint, log).

Nothing here computes a loss or an advantage: the objective is written out in the
algorithm files, from the terms of losses.py and advantages.py.

Concurrency: one thread per process. Under torchrun, rank 0 alone talks to the store
and to the weights location; every rank runs the same sequence of forward and backward
passes (FSDP's collectives need it), padding with zero-weight micro-batches where its
shard has fewer.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from . import checkpoint, hf, weights
from .batching import Rollouts, micro_batches
from .distributed import Dist, full_state_dict, shard
from .losses import kl, log_ratio
from .metrics import MetricsLog, plot
from .model import ModelConfig, build_model
from .source import Sampled, StoreSource, create_table  # noqa: F401 (the data source: source.py)


@dataclass
class TrainConfig:
    """Arguments common to GRPO and PPO. Each field is a CLI flag (``--clip-low 0.2``)."""

    target: str = "127.0.0.1:50051"
    """address of the expstore server, or of its shards: "host:port,host:port,..." """
    table: str = "rollouts"
    """trajectory table the producers insert into (created if missing)"""
    token: str = field(default_factory=lambda: os.environ.get("EXPSTORE_TOKEN", ""))
    """bearer token with the trainer role ("": the server has no auth); default: env
    EXPSTORE_TOKEN, which unlike a command line other local users cannot read"""
    weights_uri: str = "file:///tmp/expstore_rl/weights"
    """where versions are published (``<uri>/v<N>/``); a run starts from its newest version if any"""
    out: str = "runs/rl"
    """metrics.jsonl, metrics.png and checkpoints/ go here"""
    steps: int = 150
    """optimisation steps (one store batch each)"""
    seed: int = 0
    threads: int = 1
    """torch intra-op threads per process (1: two threads on two busy cores were 10x slower)"""
    model: str = ""
    """a Hugging Face causal LM directory to start from (AutoModelForCausalLM, fp32; its
    tokenizer files are published with every version: hf.py); "": the toy model below"""
    # the toy model (the tiny LlamaForCausalLM of model.py) when --model is not given
    hidden: int = 128
    layers: int = 2
    heads: int = 4
    intermediate: int = 256
    max_positions: int = 128
    # sampling distribution the producers use (logprobs are recomputed under it)
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    # optimisation
    lr: float = 1e-3
    weight_decay: float = 0.0
    max_grad_norm: float = 1.0
    """global gradient-norm clip (<= 0: off)"""
    update_epochs: int = 1
    """passes over each batch"""
    num_minibatches: int = 1
    """optimizer steps per pass (each over 1/num_minibatches of the batch)"""
    token_budget: int = 4096
    """rows x longest row per micro-batch; micro-batches of a minibatch accumulate gradients"""
    # objective
    clip_low: float = 0.2
    clip_high: float = 0.2
    loss_agg: str = "token-mean"
    """token-mean or seq-mean"""
    kl_coef: float = 0.0
    """weight of KL(policy || reference); 0 skips the reference model"""
    kl_estimator: str = "k3"
    """k1 or k3"""
    kl_in_reward: bool = False
    """subtract kl_coef * KL from the reward instead of adding it to the loss"""
    entropy_coef: float = 0.0
    is_cap: float = 2.0
    """truncation of the off-policy importance weights pi_prox / mu (<= 0: no correction)"""
    # store
    max_staleness: int = 4
    """items older than current version - max_staleness are dropped by the store"""
    samples_per_insert: float = 0.0
    """rate limiter between producers and trainer (0: none, the default; at most 1, as
    each row is sampled once; streaming needs 0). Off by default: rows the store drops
    as stale still count as inserts, so with a tight buffer a lagging producer could be
    held back while the sampler starves (seen in CI)"""
    sample_timeout: float = 120.0
    """seconds to wait for a batch"""
    stream: bool = False
    """read the table as a consumer group (each row once, in insertion order; GRPO: whole
    groups) and commit a training cut per step: exactly once across crashes of trainer
    and server (source.py; needs samples_per_insert 0). Off: sample the table, each row
    at most once"""
    stream_group: str = "trainer"
    """consumer group name; its offsets and cuts live on the server"""
    train_aborted: bool = False
    """train on rows with finish_reason "aborted" (partial rollouts) too"""
    store_retry_s: float = 300.0
    """seconds a store call that fails with UNAVAILABLE (a restarting server) is retried"""
    archive: bool = False
    """the table keeps the rows it drops (sampled, stale) in its archive on the store's
    remote tier, where queries and the console still find them (what step N trained on)"""
    sample_order: str = "lifo"
    """which rows (GRPO: whole groups) a sampled batch takes: "lifo", the newest (least
    stale; when producers outpace the trainer, older rows age out through max_staleness),
    "fifo", the oldest (every row is trained on unless it goes stale first), or
    "uniform" (any; the one order a sharded store can sample: docs/sharding.md)"""
    checkpoint_every: int = 50
    """steps between checkpoints (0: never; the last step always checkpoints)"""
    resume: bool = True
    """continue from <out>/checkpoints when one exists"""

    def model_config(self) -> ModelConfig:
        return ModelConfig(hidden=self.hidden, layers=self.layers, heads=self.heads,
                           intermediate=self.intermediate, max_positions=self.max_positions)


def parse(cls: type, argv: list[str] | None = None):
    """A config dataclass from CLI flags: each field is ``--field-name``; booleans take
    ``--flag`` / ``--no-flag``."""
    p = argparse.ArgumentParser(description=cls.__doc__)
    for f in dataclasses.fields(cls):
        flag = "--" + f.name.replace("_", "-")
        default = f.default_factory() if f.default is dataclasses.MISSING else f.default
        if f.type in (bool, "bool"):
            p.add_argument(flag, action=argparse.BooleanOptionalAction, default=default)
        else:
            p.add_argument(flag, type=type(default), default=default)
    return cls(**vars(p.parse_args(argv)))


# -- models ---------------------------------------------------------------------------


def build_policy(cfg: TrainConfig) -> torch.nn.Module:
    """The policy's architecture and initial weights: ``--model`` (from_pretrained, fp32)
    or the toy model of model.py, seeded."""
    return hf.load_model(cfg.model) if cfg.model else build_model(cfg.model_config(), cfg.seed)


def initial_policy(cfg: TrainConfig) -> tuple[torch.nn.Module, int]:
    """The starting policy and its version: the newest published version at
    ``weights_uri`` (a warm-started model, or a previous run) or ``build_policy``'s."""
    model = build_policy(cfg)
    version = weights.latest_version(cfg.weights_uri)
    if version is not None:
        model.load_state_dict(weights.load_state_dict(cfg.weights_uri, version))
    return model.train(), version if version is not None else -1


def publish(policy: torch.nn.Module, cfg: TrainConfig, version: int, d: Dist) -> None:
    """Gather the full weights (every rank), rank 0 writes ``<weights_uri>/v<version>/``
    with ``--model``'s tokenizer files beside them; every rank returns once it is written
    (a barrier: at the start of a fresh run, every rank loads v0 as the KL reference
    next, and must not look before rank 0 has written it)."""
    sd = full_state_dict(policy)
    if d.main:
        weights.publish(sd, policy.config.to_dict(), cfg.weights_uri, version, hf.model_files(cfg.model))
    d.barrier()


def make_optimizer(model: torch.nn.Module, lr: float, weight_decay: float) -> torch.optim.Optimizer:
    return torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr,
                             weight_decay=weight_decay, betas=(0.9, 0.99))


def reference_model(cfg: TrainConfig, state: LoopState, d: Dist) -> torch.nn.Module | None:
    """The frozen reference for the KL term: the policy this run started from (its
    published version is kept in the loop state, so a resumed run gets the same one).
    None when kl_coef is 0."""
    if cfg.kl_coef <= 0:
        return None
    model = build_policy(cfg)
    model.load_state_dict(weights.load_state_dict(cfg.weights_uri, state.extra["reference_version"]))
    return shard(model.eval().requires_grad_(False), d)


# -- micro-batches --------------------------------------------------------------------


def synced_micro_batches(rollouts: Rollouts, budget: int, d: Dist) -> list[tuple[torch.Tensor, float]]:
    """(row index, weight) per micro-batch, the same count on every rank: a rank with
    fewer repeats its first one with weight 0 (FSDP needs matching collectives)."""
    parts = micro_batches(rollouts.lengths, budget)
    n = int(d.all_reduce(torch.tensor([len(parts)], device=d.device), "max"))
    return [(p, 1.0) for p in parts] + [(parts[0][:1], 0.0)] * (n - len(parts))


@torch.no_grad()
def per_token(fn: Callable[[torch.Tensor], torch.Tensor], rollouts: Rollouts, budget: int, d: Dist) -> torch.Tensor:
    """fn(tokens (b, t)) -> (b, t) for every row, micro-batched within ``budget`` tokens,
    without gradients: (B, T) float32 on the CPU (0 beyond each micro-batch's width)."""
    out = torch.zeros(rollouts.tokens.shape, dtype=torch.float32)
    for index, weight in synced_micro_batches(rollouts, budget, d):
        mb = rollouts.select(index)
        values = fn(mb.tokens.to(d.device)).float().cpu()
        if weight:
            out[index, :values.shape[1]] = values
    return out


# -- metrics --------------------------------------------------------------------------


def token_means(sums: dict[str, torch.Tensor], tokens: torch.Tensor | float, d: Dist) -> dict[str, float]:
    """Sums over this rank's tokens -> means over all ranks' tokens."""
    names = sorted(sums)
    packed = torch.stack([torch.as_tensor(sums[k], dtype=torch.float64).reshape(()) for k in names]
                         + [torch.as_tensor(tokens, dtype=torch.float64).reshape(())])
    packed = d.all_reduce(packed)
    return {k: float(v / max(float(packed[-1]), 1.0)) for k, v in zip(names, packed[:-1])}


class StepTotals:
    """One step's optimisation metrics, added up over its micro-batches: a ``losses/...``
    sum is already divided by its minibatch's batch-wide count, so it is summed over
    ranks and averaged over the step's optimizer steps; any other sum is over tokens and
    becomes a mean over the generated tokens of every minibatch pass and rank.
    Zero-weight (padding) micro-batches add nothing."""

    def __init__(self) -> None:
        self.sums: dict[str, torch.Tensor] = {}
        self.tokens = 0.0

    def add(self, sums: dict[str, torch.Tensor], weight: float) -> None:
        """One micro-batch's sums."""
        for k, v in sums.items():
            self.sums[k] = self.sums.get(k, 0.0) + v.detach().cpu() * weight

    def count(self, loss_mask: torch.Tensor) -> None:
        """One minibatch pass's generated tokens."""
        self.tokens += float(loss_mask.sum())

    def means(self, optimizer_steps: int, d: Dist) -> dict[str, float]:
        losses = {k: v for k, v in self.sums.items() if k.startswith("losses/")}
        out = {k: float(d.all_reduce(torch.as_tensor(v, dtype=torch.float64).reshape(1))) / optimizer_steps
               for k, v in sorted(losses.items())}
        out.update(token_means({k: v for k, v in self.sums.items() if k not in losses}, self.tokens, d))
        return out


def off_policy_metrics(rollouts: Rollouts, cfg: TrainConfig, d: Dist) -> dict[str, float]:
    """How far the behaviour policies mu are from the proximal one, from the extras
    ``proximal``, ``is_weights`` and (with a reference) ``ref`` (B, T): ``offpolicy/...``
    and ``kl/ref``, token means over every rank."""
    x, mask = rollouts.extras, rollouts.loss_mask
    raw = torch.exp(log_ratio(x["proximal"], rollouts.logprobs))  # (B, T) pi_prox / mu, untruncated
    sums = {"offpolicy/is_weight_mean": (x["is_weights"] * mask).sum(),
            "offpolicy/is_truncated_frac": ((raw > cfg.is_cap) * mask).sum() if cfg.is_cap > 0 else torch.zeros(()),
            "offpolicy/behaviour_kl": (kl(rollouts.logprobs, x["proximal"], "k3") * mask).sum()}
    if "ref" in x:
        sums["kl/ref"] = (kl(x["proximal"], x["ref"], cfg.kl_estimator) * mask).sum()
    out = token_means(sums, mask.sum(), d)
    out["offpolicy/is_weight_max"] = float(d.all_reduce((raw * mask).max().reshape(1), "max"))
    return out


def rollout_metrics(rollouts: Rollouts, version: int, sample_seconds: float) -> dict[str, float]:
    """What the batch says about the producers: reward, lengths, staleness."""
    staleness = (version - rollouts.policy_versions).float()
    return {"rollout/reward_mean": float(rollouts.rewards.mean()),
            "rollout/reward_std": float(rollouts.rewards.std()) if len(rollouts) > 1 else 0.0,
            "rollout/response_tokens": float(rollouts.loss_mask.sum(-1).mean()),
            "rollout/samples": float(len(rollouts)),
            "staleness/mean": float(staleness.mean()), "staleness/max": float(staleness.max()),
            "perf/sample_seconds": sample_seconds}


# -- start, resume, one step's end ----------------------------------------------------


def store_source(cfg: TrainConfig, d: Dist, batch_size: int, group_size: int | None = None) -> StoreSource:
    """The store at ``cfg.target`` as the data source (rank 0 connects), with the table
    created if missing (``create_table``)."""
    source = StoreSource(cfg, d, batch_size, group_size)
    if d.main:
        create_table(source.client, cfg, batch_size, group_size)
    return source


@dataclass
class LoopState:
    step: int = 0
    version: int = 0  # the newest published policy version
    extra: dict = field(default_factory=dict)  # reference_version, ...
    generator: torch.Generator = field(default_factory=torch.Generator)  # minibatch shuffles


def start(cfg: TrainConfig, pairs: checkpoint.Pairs, policy: torch.nn.Module, version: int,
          source: StoreSource | None, d: Dist) -> LoopState:
    """Resume from the newest checkpoint under <out>/checkpoints, or publish the initial
    policy as version 0 (a fresh model) or go on from the published ``version``; then
    tell the store the current version. A resumed run that finds versions newer than its
    checkpoint (it crashed between publishing and checkpointing) republishes its restored
    weights as the next version, so that versions only grow and producers follow.
    A streaming source resumes its consumer group at the checkpoint's cut; a fresh
    streaming run commits cut 0 and checkpoints step 0 before its first read, so that
    every restart finds a checkpoint whose cut the store holds."""
    ckpt = checkpoint.latest(f"{cfg.out}/checkpoints") if cfg.resume else None
    if ckpt is not None:
        s = checkpoint.load(ckpt, pairs)
        torch.set_rng_state(s["torch_rng"])
        state = LoopState(s["step"], s["version"], s["extra"])
        state.generator.set_state(s["generator"][d.rank])
        newest = weights.latest_version(cfg.weights_uri)
        if newest is not None and newest > state.version:
            state.version = newest + 1
            publish(policy, cfg, state.version, d)
    else:
        state = LoopState(0, max(version, 0), {"reference_version": max(version, 0)})
        state.generator.manual_seed(cfg.seed + d.rank)
        if version < 0:
            publish(policy, cfg, 0, d)
    if source is not None:
        source.start(state.step, resumed=ckpt is not None)
        source.set_policy_version(state.version)
        if ckpt is None and source.stream:
            save(cfg, pairs, state, d)
    return state



def save(cfg: TrainConfig, pairs: checkpoint.Pairs, state: LoopState, d: Dist) -> None:
    generators = d.all_gather_object(state.generator.get_state())
    checkpoint.save(f"{cfg.out}/checkpoints", state.step, pairs,
                    {"version": state.version, "torch_rng": torch.get_rng_state(), "extra": state.extra,
                     "generator": generators}, d)


class Run:
    """What a training loop carries from step to step besides the algorithm: the data
    source, the loop state (step, published version, minibatch generator), checkpoints,
    publishing and the metrics log. Creating one starts or resumes the run (``start``);
    then each step is ``sample()``, the algorithm's update, ``finish_step(metrics)``; at
    the end ``finish(title)`` plots the metrics."""

    def __init__(self, cfg: TrainConfig, pairs: checkpoint.Pairs, version: int, source: StoreSource,
                 d: Dist) -> None:
        """pairs: {"policy": (model, optimizer), ...} as checkpointed; version: the
        policy's published version (-1: a fresh model, published as v0)."""
        self.cfg, self.pairs, self.source, self.d = cfg, pairs, source, d
        self.policy = pairs["policy"][0]
        self.state = start(cfg, pairs, self.policy, version, source, d)
        self.log = MetricsLog(cfg.out, d.main)
        self.t_start: float | None = None  # the first step's start
        self.t0 = 0.0  # this step's start
        self.sampled: Sampled | None = None  # this step's batch

    @property
    def done(self) -> bool:
        return self.state.step >= self.cfg.steps

    def sample(self) -> tuple[Rollouts, dict[str, float]]:
        """The next step's whole batch (rank 0 reads it, every rank gets it) and what it
        says about the producers (``rollout_metrics``)."""
        self.t0 = time.perf_counter()
        if self.t_start is None:
            self.t_start = self.t0
        self.sampled = self.source.next(self.state.step + 1)
        rollouts = self.sampled.rollouts
        return rollouts, rollout_metrics(rollouts, self.state.version, self.sampled.seconds)

    def finish_step(self, metrics: dict[str, float]) -> None:
        """The end of every step, in this order: commit the step's cut (streams: its rows
        acked and its manifest recorded, before a new version can make them stale), publish
        version N+1, set it as the table's policy version, checkpoint when due (and at the
        last step), write the metrics. A restart from the checkpoint finds every cut it
        needs: the cut is in the store before the checkpoint that follows it."""
        cfg, state, sampled = self.cfg, self.state, self.sampled
        t1 = time.perf_counter()
        state.step += 1
        if sampled.commit is not None:
            sampled.commit()
        state.version += 1
        publish(self.policy, cfg, state.version, self.d)
        self.source.set_policy_version(state.version)
        if state.step == cfg.steps or (cfg.checkpoint_every and state.step % cfg.checkpoint_every == 0):
            save(cfg, self.pairs, state, self.d)
        elapsed = time.perf_counter() - self.t0
        metrics |= {"charts/policy_version": state.version, "perf/publish_seconds": time.perf_counter() - t1,
                    "perf/step_seconds": elapsed, "perf/samples_per_second": len(sampled.rollouts) / elapsed,
                    "perf/tokens_per_second": float(sampled.rollouts.attention_mask.sum()) / elapsed,
                    "charts/wall_seconds": time.perf_counter() - self.t_start,
                    "optim/lr": self.pairs["policy"][1].param_groups[0]["lr"]}
        self.log.write(state.step, metrics)
        if self.d.main:
            print(f"step {state.step:4d}  reward {metrics['rollout/reward_mean']:.3f}  "
                  f"staleness {metrics['staleness/mean']:.2f}  {elapsed:.2f}s", flush=True)

    def finish(self, title: str) -> LoopState:
        """Plot the metrics (rank 0: ``<out>/metrics.png``); returns the loop state."""
        if self.d.main and self.log.path.exists():
            plot(self.log.path, self.log.path.with_suffix(".png"), title)
        return self.state
