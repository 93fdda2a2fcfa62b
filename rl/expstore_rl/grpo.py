"""GRPO against an expstore table: whole groups from the group sampler (or, with
``--stream``, from a consumer group, exactly once), group-normalised advantages, the
decoupled clipped surrogate with truncated importance weights, versioned weight
publishing.

    python -m expstore_rl.grpo --target 127.0.0.1:50051 --table rollouts --group-size 8
    python -m expstore_rl.grpo ... --stream                  # every group exactly once
    torchrun --nproc-per-node 2 -m expstore_rl.grpo ...      # FSDP2 over 2 processes
    python -m expstore_rl.grpo ... --model ./my-qwen         # a Hugging Face model directory

Producers (``python -m expstore_rl.producer``) fill the table with groups of
``group_size`` answers per prompt and reload weights as versions appear.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from . import distributed, trainer
from .advantages import group_advantages
from .losses import kl
from .metrics import MetricsLog, plot
from .trainer import TrainConfig


@dataclass
class GRPOConfig(TrainConfig):
    """GRPO: TrainConfig plus the group shape."""

    group_size: int = 8
    """answers per prompt (the store's group sampler returns whole groups)"""
    groups_per_step: int = 16
    """prompts per batch; a multiple of the number of ranks"""
    scale_std: bool = True
    """divide advantages by the group's reward std (off: Dr. GRPO)"""


def train(cfg: GRPOConfig, source: trainer.StoreSource | None = None) -> trainer.LoopState:
    """Run cfg.steps steps (from where a checkpoint left off). ``source`` replaces the
    store (tests); None connects to cfg.target."""
    torch.set_num_threads(cfg.threads)
    torch.manual_seed(cfg.seed)
    d = distributed.init()
    if cfg.groups_per_step % d.world:
        raise ValueError("groups_per_step must be a multiple of the number of ranks")
    policy, version = trainer.initial_policy(cfg)
    policy = distributed.shard(policy, d)
    optimizer = trainer.make_optimizer(policy, cfg.lr, cfg.weight_decay)
    pairs = {"policy": (policy, optimizer)}
    if source is None:
        source = trainer.StoreSource(cfg, d, cfg.groups_per_step * cfg.group_size, cfg.group_size)
        if d.main:
            trainer.create_table(source.client, cfg, source.batch_size, cfg.group_size)
    state = trainer.start(cfg, pairs, policy, version, source, d)
    reference = trainer.reference_model(cfg, state, d)
    log = MetricsLog(cfg.out, d.main)
    t_start = time.perf_counter()

    while state.step < cfg.steps:
        t0 = time.perf_counter()
        # 1. whole groups from the store (rank 0), the same batch on every rank
        sampled = source.next(state.step + 1)
        metrics = trainer.rollout_metrics(sampled.rollouts, state.version, sampled.seconds)
        rollouts = sampled.rollouts.shard(d.rank, d.world)  # contiguous: whole groups per rank

        # 2. proximal and reference logprobs, truncated IS weights for stale rows
        metrics |= trainer.off_policy_extras(rollouts, policy, reference, cfg, d)

        # 3. group-normalised advantages, one per sequence, broadcast over its tokens
        rewards = rollouts.rewards
        if cfg.kl_coef > 0 and cfg.kl_in_reward:
            per_token = kl(rollouts.extras["proximal"], rollouts.extras["ref"], cfg.kl_estimator)
            rewards = rewards - cfg.kl_coef * (per_token * rollouts.loss_mask).sum(-1)
        adv = group_advantages(rewards, rollouts.group_index, cfg.scale_std)
        rollouts.extras["advantages"] = adv[:, None]  # (B, 1)

        # 4. clipped surrogate (+ KL, - entropy), micro-batched, clipped grads
        def objective(mb, norm):
            return trainer.policy_terms(policy, mb, cfg, norm)

        metrics |= trainer.optimise(rollouts, objective, [policy], [optimizer], cfg, d, state.generator)

        # 5. commit the step's cut, publish the new version, move the store's version
        #    forward, checkpoint, log
        trainer.finish_step(cfg, policy, pairs, state, source, sampled, metrics, t0, t_start, log, d)

    if d.main and log.path.exists():
        plot(log.path, log.path.with_suffix(".png"), "GRPO")
    return state


def main(argv: list[str] | None = None) -> None:
    train(trainer.parse(GRPOConfig, argv))
    distributed.close()


if __name__ == "__main__":
    main()
