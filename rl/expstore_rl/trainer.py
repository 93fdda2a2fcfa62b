"""Pieces shared by the GRPO and PPO loops (grpo.py, ppo.py, each readable top to
bottom): the common config, micro-batched forward passes, the optimisation loop with
gradient accumulation, weight publishing and the start/resume logic. The data source
(store -> rank 0 -> every rank, and the training cuts back) is source.py.

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
from typing import Any, Callable

import numpy as np
import torch

from . import checkpoint, hf, weights
from .batching import Rollouts, micro_batches, minibatches
from .distributed import Dist, clip_grad_norm, full_state_dict, gradient_sync, shard
from .losses import aggregate, entropy, importance_weights, kl, log_ratio, normaliser, policy_loss
from .model import ModelConfig, build_model, process_logits, token_logprobs
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


def logits_and_logprobs(model: torch.nn.Module, tokens: torch.Tensor, cfg: TrainConfig):
    """Raw logits (B, T, V) and the logprobs (B, T) of ``tokens`` under the sampling
    distribution. No attention mask: rows are right-padded, so causal attention keeps
    real tokens from seeing the padding."""
    logits = model(input_ids=tokens).logits
    return logits, token_logprobs(logits, tokens, cfg.temperature, cfg.top_k, cfg.top_p)


def synced_micro_batches(rollouts: Rollouts, budget: int, d: Dist) -> list[tuple[torch.Tensor, float]]:
    """(row index, weight) per micro-batch, the same count on every rank: a rank with
    fewer repeats its first one with weight 0 (FSDP needs matching collectives)."""
    parts = micro_batches(rollouts.lengths, budget)
    n = int(d.all_reduce(torch.tensor([len(parts)], device=d.device), "max"))
    return [(p, 1.0) for p in parts] + [(parts[0][:1], 0.0)] * (n - len(parts))


@torch.no_grad()
def score(model: torch.nn.Module, rollouts: Rollouts, cfg: TrainConfig, d: Dist,
          fn: Callable[[torch.nn.Module, torch.Tensor], torch.Tensor] | None = None) -> torch.Tensor:
    """fn(model, tokens) -> (b, t) for every row, micro-batched; default: logprobs."""
    fn = fn or (lambda m, tokens: logits_and_logprobs(m, tokens, cfg)[1])
    out = torch.zeros(rollouts.tokens.shape, dtype=torch.float32)
    for index, weight in synced_micro_batches(rollouts, cfg.token_budget, d):
        mb = rollouts.select(index)
        values = fn(model, mb.tokens.to(d.device)).float().cpu()
        if weight:
            out[index, :values.shape[1]] = values
    return out


# -- the policy objective -------------------------------------------------------------


def policy_terms(policy: torch.nn.Module, mb: Rollouts, cfg: TrainConfig, norm: float):
    """The policy's loss on one micro-batch and token sums for metrics. Needs extras
    proximal, is_weights, advantages (B, T) and, with a KL loss, ref."""
    logits, logp = logits_and_logprobs(policy, mb.tokens, cfg)
    mask, x = mb.loss_mask, mb.extras
    loss, diag = policy_loss(logp, x["proximal"], x["advantages"], mask, clip_low=cfg.clip_low,
                             clip_high=cfg.clip_high, is_weights=x["is_weights"], agg=cfg.loss_agg, norm=norm)
    sums = {"losses/policy": loss.detach(), "policy/clip_frac": (diag["clipped"] * mask).sum(),
            "policy/ratio_mean": (diag["ratio"] * mask).sum()}
    if cfg.kl_coef > 0 and not cfg.kl_in_reward:
        k = kl(logp, x["ref"], cfg.kl_estimator)
        kl_loss = aggregate(k, mask, cfg.loss_agg, norm)
        loss = loss + cfg.kl_coef * kl_loss
        sums["losses/kl"] = kl_loss.detach()
    processed = process_logits(logits[:, :-1], cfg.temperature, cfg.top_k, cfg.top_p)
    ent = torch.nn.functional.pad(entropy(processed), (1, 0))  # (B, T): of the step that chose token t
    if cfg.entropy_coef > 0:
        ent_loss = aggregate(ent, mask, cfg.loss_agg, norm)
        loss = loss - cfg.entropy_coef * ent_loss
    sums["policy/entropy"] = (ent.detach() * mask).sum()
    return loss, sums


def off_policy_extras(rollouts: Rollouts, policy: torch.nn.Module, reference: torch.nn.Module | None,
                      cfg: TrainConfig, d: Dist) -> dict[str, float]:
    """Recompute the proximal (pre-update) and reference logprobs into ``extras`` and
    the truncated IS weights pi_prox / mu; returns their metrics."""
    x, mask = rollouts.extras, rollouts.loss_mask
    x["proximal"] = score(policy, rollouts, cfg, d)
    if reference is not None:
        x["ref"] = score(reference, rollouts, cfg, d)
    x["is_weights"] = importance_weights(x["proximal"], rollouts.logprobs, cfg.is_cap)
    raw = torch.exp(log_ratio(x["proximal"], rollouts.logprobs))
    sums = {"offpolicy/is_weight_mean": (x["is_weights"] * mask).sum(),
            "offpolicy/is_truncated_frac": ((raw > cfg.is_cap) * mask).sum() if cfg.is_cap > 0 else torch.zeros(()),
            "offpolicy/behaviour_kl": (kl(rollouts.logprobs, x["proximal"], "k3") * mask).sum()}
    if reference is not None:
        sums["kl/ref"] = (kl(x["proximal"], x["ref"], cfg.kl_estimator) * mask).sum()
    out = token_means(sums, mask.sum(), d)
    out["offpolicy/is_weight_max"] = float(d.all_reduce((raw * mask).max().reshape(1), "max"))
    return out


def token_means(sums: dict[str, torch.Tensor], tokens: torch.Tensor | float, d: Dist) -> dict[str, float]:
    """Sums over this rank's tokens -> means over all ranks' tokens."""
    names = sorted(sums)
    packed = torch.stack([torch.as_tensor(sums[k], dtype=torch.float64).reshape(()) for k in names]
                         + [torch.as_tensor(tokens, dtype=torch.float64).reshape(())])
    packed = d.all_reduce(packed)
    return {k: float(v / max(float(packed[-1]), 1.0)) for k, v in zip(names, packed[:-1])}


Objective = Callable[[Rollouts, float], tuple[torch.Tensor, dict[str, torch.Tensor]]]


def optimise(rollouts: Rollouts, objective: Objective, models: list[torch.nn.Module],
             optimizers: list[torch.optim.Optimizer], cfg: TrainConfig, d: Dist,
             generator: torch.Generator) -> dict[str, float]:
    """update_epochs x num_minibatches optimizer steps over this rank's rows. Each
    minibatch's micro-batches accumulate gradients; losses are normalised by the
    minibatch's batch-wide count (all ranks) so accumulation and sharding are exact.
    objective(micro_batch, norm) -> (loss, sums): sums of losses are added as they are
    (already normalised); other sums are per-token and become token means."""
    sums: dict[str, torch.Tensor] = {}
    grad_norms: list[list[float]] = [[] for _ in models]
    tokens = 0.0
    for _ in range(cfg.update_epochs):
        for rows in minibatches(len(rollouts), cfg.num_minibatches, generator, rollouts.group_index):
            mini = rollouts.select(rows)
            norm = float(d.all_reduce(torch.tensor([normaliser(mini.loss_mask, cfg.loss_agg)])))
            for opt in optimizers:
                opt.zero_grad(set_to_none=True)
            parts = synced_micro_batches(mini, cfg.token_budget, d)
            for i, (index, weight) in enumerate(parts):
                for model in models:  # reduce-scatter once per minibatch, after its last backward
                    gradient_sync(model, i == len(parts) - 1)
                loss, part = objective(mini.select(index).to(d.device), norm)
                (loss * weight * d.loss_scale).backward()
                for k, v in part.items():
                    sums[k] = sums.get(k, 0.0) + v.detach().cpu() * weight
            tokens += float(mini.loss_mask.sum())
            for i, (model, opt) in enumerate(zip(models, optimizers)):
                grad_norms[i].append(clip_grad_norm(list(model.parameters()), cfg.max_grad_norm))
                opt.step()
    steps = cfg.update_epochs * cfg.num_minibatches
    losses = {k: v for k, v in sums.items() if k.startswith("losses/")}
    out = {k: float(d.all_reduce(torch.as_tensor(v, dtype=torch.float64).reshape(1))) / steps
           for k, v in sorted(losses.items())}
    out.update(token_means({k: v for k, v in sums.items() if k not in losses}, tokens, d))
    for i, norms in enumerate(grad_norms):
        out["optim/grad_norm" if i == 0 else f"optim/grad_norm_{i}"] = float(np.mean(norms))
    return out


# -- start / resume -------------------------------------------------------------------


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


def reference_model(cfg: TrainConfig, state: LoopState, d: Dist) -> torch.nn.Module | None:
    """The frozen reference for the KL term: the policy this run started from (its
    published version is kept in the loop state, so a resumed run gets the same one).
    None when kl_coef is 0."""
    if cfg.kl_coef <= 0:
        return None
    model = build_policy(cfg)
    model.load_state_dict(weights.load_state_dict(cfg.weights_uri, state.extra["reference_version"]))
    return shard(model.eval().requires_grad_(False), d)


def save(cfg: TrainConfig, pairs: checkpoint.Pairs, state: LoopState, d: Dist) -> None:
    generators = d.all_gather_object(state.generator.get_state())
    checkpoint.save(f"{cfg.out}/checkpoints", state.step, pairs,
                    {"version": state.version, "torch_rng": torch.get_rng_state(), "extra": state.extra,
                     "generator": generators}, d)


def finish_step(cfg: TrainConfig, policy: torch.nn.Module, pairs: checkpoint.Pairs, state: LoopState,
                source, sampled: Sampled, metrics: dict[str, float], t0: float, t_start: float,
                log, d: Dist) -> None:
    """The end of every step: commit the step's cut (streams: its rows acked and its
    manifest recorded, before a new version can make them stale), publish version N+1,
    set it as the table's policy version, checkpoint when due (and at the last step),
    write the metrics."""
    t1 = time.perf_counter()
    state.step += 1
    if sampled.commit is not None:
        sampled.commit()
    state.version += 1
    publish(policy, cfg, state.version, d)
    source.set_policy_version(state.version)
    if state.step == cfg.steps or (cfg.checkpoint_every and state.step % cfg.checkpoint_every == 0):
        save(cfg, pairs, state, d)
    elapsed = time.perf_counter() - t0
    metrics |= {"charts/policy_version": state.version, "perf/publish_seconds": time.perf_counter() - t1,
                "perf/step_seconds": elapsed, "perf/samples_per_second": len(sampled.rollouts) / elapsed,
                "perf/tokens_per_second": float(sampled.rollouts.attention_mask.sum()) / elapsed,
                "charts/wall_seconds": time.perf_counter() - t_start,
                "optim/lr": pairs["policy"][1].param_groups[0]["lr"]}
    log.write(state.step, metrics)
    if d.main:
        print(f"step {state.step:4d}  reward {metrics['rollout/reward_mean']:.3f}  "
              f"staleness {metrics['staleness/mean']:.2f}  {elapsed:.2f}s", flush=True)


def rollout_metrics(rollouts: Rollouts, version: int, sample_seconds: float) -> dict[str, float]:
    """What the batch says about the producers: reward, lengths, staleness."""
    staleness = (version - rollouts.policy_versions).float()
    return {"rollout/reward_mean": float(rollouts.rewards.mean()),
            "rollout/reward_std": float(rollouts.rewards.std()) if len(rollouts) > 1 else 0.0,
            "rollout/response_tokens": float(rollouts.loss_mask.sum(-1).mean()),
            "rollout/samples": float(len(rollouts)),
            "staleness/mean": float(staleness.mean()), "staleness/max": float(staleness.max()),
            "perf/sample_seconds": sample_seconds}
